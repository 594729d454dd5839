"""What a checkpoint's ``COMPLETE`` marker lists: every file of the checkpoint with its size, so that a copy that
stopped half-way is told from a complete one.

``COMPLETE`` sorts first in a folder listing, so ``cp -r`` or ``rsync`` of a run folder interrupted mid-way leaves a
``step_<n>`` whose marker is in place while its tensors are missing or cut short. :func:`file_sizes` records the
files when the checkpoint is written (``{"step": n, "parts": [...], "files": {"actor/tensors/...": bytes, ...}}``);
:func:`damaged` compares them with the folder (sizes only: no file is read). Resuming skips a damaged checkpoint for
the previous complete one with a warning (:func:`embodirl.runner.checkpoint.latest_checkpoint`). A marker written
before the file list (``{"step", "parts"}``) is trusted as before.
"""

from __future__ import annotations

import json
from pathlib import Path

from embodirl.checkpoint_layout import COMPLETE
from embodirl.paths import inside

FILES = "files"


def file_sizes(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` (but a ``COMPLETE`` marker) by its path relative to it, with its size in bytes."""
    return {path.relative_to(folder).as_posix(): path.stat().st_size for path in sorted(folder.rglob("*"))
            if path.is_file() and path.name != COMPLETE}


def damaged(checkpoint: Path) -> str | None:
    """Why checkpoint folder ``checkpoint`` is not what its ``COMPLETE`` lists (a missing file, a file of another size,
    an unreadable marker), or None when it is (or its marker predates the file list)."""
    try:
        marker = json.loads((checkpoint / COMPLETE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return f"its {COMPLETE} marker is not the JSON a save writes"
    files = marker.get(FILES) if isinstance(marker, dict) else None
    if files is None:
        return None
    if not isinstance(files, dict):
        return f"its {COMPLETE} marker's file list is not a mapping"
    for name, size in files.items():
        path = inside(checkpoint, name)
        if path is None:
            return f"its {COMPLETE} marker lists {name}, outside the checkpoint"
        if not path.is_file():
            return f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, not the {size} its {COMPLETE} marker lists"
    return None
