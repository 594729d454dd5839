"""Which weights an evaluation scores: their content hash and the record ``embodirl eval`` writes into
``eval_info.json`` (and prints), ``embodirl compare`` into ``compare_info.json``.

The record (``weights`` in ``eval_info.json``)::

    kind        "run_checkpoint" (runner.resume_dir names one) | "model_path" | "random_init"
    path        the checkpoint folder step_<n>, or model.path; null for a random init
    step        the run checkpoint's step, else null
    sha256      of the weight files (:func:`weights_digest`): the checkpoint's policy/ folder, or model.path
    model_path, model_path_sha256   a run checkpoint's base weights (model.path), when it has some
    seed        a random init's runner.seed
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from embodirl import checkpoint_layout as layout

HASH_CHUNK = 1 << 20
RUN_CHECKPOINT, MODEL_PATH, RANDOM_INIT = "run_checkpoint", "model_path", "random_init"


def weights_digest(path: Path) -> str:
    """SHA-256 of a weights file, or of a folder's files (each one's relative name, size and bytes, in name
    order): equal digests, equal weights."""
    path = Path(path)
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        name = file.name if file == path else str(file.relative_to(path))
        digest.update(f"{name}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as handle:
            while chunk := handle.read(HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def local_copy(path: str) -> Path | None:
    """``model.path`` on this machine: the file or folder, or a hub id's downloaded snapshot (None when it is not
    downloaded yet)."""
    local = Path(path).expanduser()
    if local.exists():
        return local.absolute()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=str(path), local_files_only=True))
    except Exception:                        # not a hub id, or not in the hub cache yet
        return None


def _digest_of(path: str | None) -> str | None:
    local = local_copy(path) if path else None
    return weights_digest(local) if local is not None else None


def weights_record(model_path: str | None, source: Path | None, seed: int) -> dict:
    """The record of the weights an evaluation acts with (see module docstring): checkpoint ``source``'s ``policy/``
    over ``model_path``'s base weights, or ``model_path`` alone, or a random init from ``seed``."""
    if source is not None:
        from embodirl.runner.checkpoint import checkpoint_step

        record = {"kind": RUN_CHECKPOINT, "path": str(Path(source).absolute()), "step": checkpoint_step(source),
                  "sha256": weights_digest(Path(source) / layout.POLICY)}
        if model_path:
            record.update(model_path=str(model_path), model_path_sha256=_digest_of(model_path))
        return record
    if model_path:
        local = local_copy(model_path)
        return {"kind": MODEL_PATH, "path": str(local if local is not None else model_path), "step": None,
                "sha256": weights_digest(local) if local is not None else None}
    return {"kind": RANDOM_INIT, "path": None, "step": None, "sha256": None, "seed": int(seed)}


def complete_record(record: dict) -> dict:
    """``record`` with the hashes of a hub id's weights that were downloaded after it was made (by the workers)."""
    if record["kind"] == MODEL_PATH and record["sha256"] is None:
        return weights_record(record["path"], None, 0)
    if record.get("model_path") and record.get("model_path_sha256") is None:
        return {**record, "model_path_sha256": _digest_of(record["model_path"])}
    return record


def describe(record: dict) -> str:
    """One line for the console: ``weights: <path> (step n), sha256 <hex>``."""
    if record["kind"] == RANDOM_INIT:
        return f"weights: a random init (runner.seed={record['seed']}), no checkpoint"
    step = f" (step {record['step']})" if record["step"] is not None else ""
    sha = record["sha256"] or "not hashed (a hub id not downloaded)"
    text = f"weights: {record['path']}{step}, sha256 {sha}"
    if record.get("model_path"):
        text += f", over model.path {record['model_path']} (sha256 {record.get('model_path_sha256')})"
    return text
