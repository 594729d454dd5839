"""Writing a folder that replaces another only once it is complete: the OpenVLA-OFT export
(:func:`embodirl.models.openvla_oft.hf_checkpoint.save`) and ``embodirl demos overwrite=true``
(:class:`embodirl.demos.lerobot.writer.LeRobotWriter`).

The new folder is written beside its place as ``.<name>.writing-<pid>`` (:func:`temporary`); when it is complete,
:func:`swap_in` renames the old folder aside (``.<name>.replaced-<pid>``), renames the new one in, and only then
deletes the old one. A kill at any point leaves either folder complete under its own name or aside: the next writer
into the same parent (:func:`remove_stale`, which every :func:`temporary` call runs) deletes a half-written folder of a
process that is gone and puts back an old folder whose successor never came in.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import psutil

WRITING, REPLACED = "writing", "replaced"
_TEMPORARY = re.compile(rf"^\.(?P<name>.+)\.(?P<kind>{WRITING}|{REPLACED})-(?P<pid>\d+)$")


def temporary(final: str | os.PathLike) -> Path:
    """An empty folder to write ``final``'s successor into, beside it, after clearing stale temporaries."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(final.parent)
    tmp = final.parent / f".{final.name}.{WRITING}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def swap_in(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Put the complete folder ``tmp`` in place of ``final``; the old ``final`` is deleted only once ``tmp`` is in."""
    tmp, final = Path(tmp), Path(final)
    old = final.parent / f".{final.name}.{REPLACED}-{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def remove_stale(folder: str | os.PathLike) -> None:
    """Clear the temporaries in ``folder`` of writers that are gone (or of this process): a folder being written is
    deleted; a folder renamed aside whose successor never came in (a kill between the two renames) is put back."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for path in sorted(folder.iterdir(), key=lambda p: p.name):     # ".x.replaced-" after ".x.writing-"
        match = _TEMPORARY.match(path.name)
        if match is None or not path.is_dir():
            continue
        pid = int(match["pid"])
        if pid != os.getpid() and psutil.pid_exists(pid):
            continue                                                 # a writer at work
        final = folder / match["name"]
        if match["kind"] == REPLACED and not final.exists():
            os.replace(path, final)
        else:
            shutil.rmtree(path, ignore_errors=True)
