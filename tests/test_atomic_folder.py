"""Replacing a folder only once its successor is complete (embodirl/atomic_folder.py): what a writer killed at each
point leaves, and what the next writer makes of it. The kills themselves are real in the callers' tests (the OpenVLA-OFT
export in tests/models/test_openvla_checkpoint.py, `embodirl demos overwrite=true` in tests/demos/test_demos_cli.py);
here the states a kill can leave are laid out one by one, with the pid of a process that has ended."""

from __future__ import annotations

import os
import subprocess
import sys

from embodirl import atomic_folder


def ended_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def folder(path, text: str):
    path.mkdir()
    (path / "file").write_text(text)
    return path


def test_the_next_writer_clears_or_puts_back_what_a_killed_one_left(tmp_path):
    dead, alive = ended_pid(), os.getppid()
    # killed while writing: the half-written folder goes, the old one stays
    folder(tmp_path / "a", "old")
    folder(tmp_path / f".a.writing-{dead}", "half")
    # killed between the two renames: the old folder, renamed aside, is put back (the new one is dropped)
    folder(tmp_path / f".b.replaced-{dead}", "old")
    folder(tmp_path / f".b.writing-{dead}", "new")
    # killed after the new one came in: the old one, aside, goes
    folder(tmp_path / "c", "new")
    folder(tmp_path / f".c.replaced-{dead}", "old")
    # a writer still at work is left alone
    folder(tmp_path / f".d.writing-{alive}", "busy")
    atomic_folder.remove_stale(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [f".d.writing-{alive}", "a", "b", "c"]
    assert [(tmp_path / n / "file").read_text() for n in ("a", "b", "c")] == ["old", "old", "new"]


def test_swap_in_replaces_the_folder_and_leaves_nothing_beside_it(tmp_path):
    folder(tmp_path / "x", "old")
    tmp = atomic_folder.temporary(tmp_path / "x")
    (tmp / "file").write_text("new")
    assert (tmp_path / "x" / "file").read_text() == "old"             # untouched until the new one is complete
    atomic_folder.swap_in(tmp, tmp_path / "x")
    assert os.listdir(tmp_path) == ["x"] and (tmp_path / "x" / "file").read_text() == "new"
