"""Atomic, resumable checkpoints: ``<output_dir>/checkpoints/step_<n>/``.

A checkpoint is written into a temporary sibling folder and renamed into place only after every
file is flushed and a ``COMPLETE`` marker written, so a crash mid-save never leaves a folder that
looks complete: :func:`latest_checkpoint` ignores temporary folders and folders without the marker.

What goes in is decided by the caller as named parts; each part is a callable that writes into the
folder it is given (the learner writes the LoRA adapter in peft layout, value head, optimizer and
schedule; the runner writes RNG states, counters and the resolved config).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())


def save_checkpoint(output_dir: str | Path, step: int, parts: Mapping[str, Callable[[Path], None]],
                    keep_last: int | None = None) -> Path:
    """Write ``step_<step>`` atomically; each part writes into ``<folder>/<part name>/``."""
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, write in parts.items():
        sub = tmp / name
        sub.mkdir()
        write(sub)
    (tmp / COMPLETE).write_text(json.dumps({"step": step, "parts": sorted(parts)}))
    _fsync_tree(tmp)
    if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep_last:
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / COMPLETE).is_file():
            found.append((int(match.group(1)), path))
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def checkpoint_step(path: str | Path) -> int:
    match = _STEP_DIR.match(Path(path).name)
    if not match or not (Path(path) / COMPLETE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint folder (step_<n> with a {COMPLETE} marker)")
    return int(match.group(1))


def rng_state() -> dict:
    """Python, numpy and torch RNG states (CPU; CUDA when present)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng(folder: Path) -> None:
    torch.save(rng_state(), folder / "rng.pt")


def load_rng(folder: Path) -> None:
    # RNG states hold numpy arrays and tuples: not loadable with weights_only=True.
    set_rng_state(torch.load(folder / "rng.pt", weights_only=False))
