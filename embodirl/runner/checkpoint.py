"""Atomic, resumable checkpoints: ``<output_dir>/checkpoints/step_<n>/``.

The layout of one checkpoint folder: :mod:`embodirl.checkpoint_layout`.

Only the trained tensors are stored: the frozen base weights come from ``model.path`` (or the random
init of ``runner.seed``), as when the run started. ``embodirl eval runner.resume_dir=<step folder>``
reads nothing but ``policy/``.

Atomicity: a checkpoint is written into a temporary sibling folder ``.tmp_step_<n>_<pid>``, every file
is flushed to disk, the ``COMPLETE`` marker is written, and only then is the folder renamed into place.
A crash (even SIGKILL) mid-save therefore never leaves a ``step_<n>`` that looks complete, and
:func:`list_checkpoints` / :func:`latest_checkpoint` ignore temporary folders and folders without the
marker. The marker lists every file with its size (:mod:`embodirl.runner.manifest`): :func:`latest_checkpoint`
passes over a checkpoint whose files do not match it (a copy of the run folder that stopped half-way) with a
warning, and an explicit ``runner.resume_dir`` of one is refused in one sentence. Older checkpoints are never
touched by a save (except by ``keep_last``, which spares the newest, the one just written and the collapse guard's
best); temporary folders of dead processes are removed by the next save.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from embodirl.checkpoint_layout import (
    CHECKPOINTS,
    COMPLETE,
    CONFIG,
    DISABLE,
    LEGACY_RNG,
    LEGACY_WORKER_RNG,
    MODEL_CONFIG,
    POLICY,
    RNG,
    WORKER_RNG,
)
from embodirl.errors import ConfigError, last_line
from embodirl.runner import manifest
from embodirl.runner.metrics_logger import flatten
from embodirl.runtime import rng_state, rng_state_from_json, rng_state_to_json, set_rng_state

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.(?:tmp|old)_step_\d+_(\d+)$")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):   # files before the folders that list them
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
        elif path.is_dir():
            _fsync_dir(path)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_temporaries(root: Path) -> None:
    """Temporary folders left by processes that died mid-save."""
    for path in root.iterdir():
        match = _TMP_DIR.match(path.name)
        if match and (int(match.group(1)) == os.getpid() or not psutil.pid_exists(int(match.group(1)))):
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(output_dir: str | Path, step: int, parts: Mapping[str, Callable[[Path], None]],
                    keep_last: int | None = None, keep: Iterable[str | Path | None] = ()) -> Path:
    """Write ``step_<step>`` atomically (see module docstring); each part writes into
    ``<folder>/<part name>/``. ``keep_last`` (``runner.keep_last``) removes all but the newest complete checkpoints,
    never the one just written nor those in ``keep`` (the collapse guard's best)."""
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(root)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}_{os.getpid()}"
    tmp.mkdir()
    try:
        for name, write in parts.items():
            sub = tmp / name
            sub.mkdir()
            write(sub)
        (tmp / COMPLETE).write_text(json.dumps({"step": step, "parts": sorted(parts),
                                                manifest.FILES: manifest.file_sizes(tmp)}))
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        # Re-saving a step (a run resumed from an earlier checkpoint of this folder): move the old one
        # aside first. A crash in between loses only this step's old copy, never an older checkpoint.
        old = root / f".old_step_{step}_{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    if keep_last:
        kept = {Path(p).resolve() for p in (final, *keep) if p}
        for stale in list_checkpoints(output_dir)[:-keep_last]:
            if stale.resolve() not in kept:
                shutil.rmtree(stale, ignore_errors=True)
    return final


def is_checkpoint(path: str | Path) -> bool:
    """``path`` is a complete checkpoint folder (``step_<n>`` with its marker)."""
    path = Path(path)
    return bool(_STEP_DIR.match(path.name)) and (path / COMPLETE).is_file()


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run's output folder, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in root.iterdir() if is_checkpoint(p)]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path, *, warn: bool = True) -> Path | None:
    """The newest complete checkpoint whose files are those its marker lists; a newer one whose are not is passed
    over with a warning (see module docstring)."""
    for path in reversed(list_checkpoints(output_dir)):
        why = manifest.damaged(path)
        if why is None:
            return path
        if warn:
                log.warning("checkpoint %s is incomplete (%s: a copy that stopped half-way?); passing over it for the "
                        "previous complete one", path, why)
    return None


def find_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint ``path`` designates: itself when it is a complete checkpoint folder, else the
    latest complete checkpoint of the run folder ``path`` (or of its ``checkpoints/`` folder);
    None when there is none."""
    path = Path(path).expanduser()
    if is_checkpoint(path):
        return path
    if path.name == CHECKPOINTS:
        path = path.parent
    return latest_checkpoint(path)


def is_model_checkpoint(path: str | Path) -> bool:
    """``path`` is a model checkpoint directory (``config.json`` + weights, e.g. a public OpenVLA-OFT
    checkpoint) rather than a run's checkpoint."""
    path = Path(path).expanduser()
    return not is_checkpoint(path) and (path / MODEL_CONFIG).is_file()


def eval_model_path(runner) -> str | None:
    """For evaluation only: ``runner.resume_dir`` when it names a model checkpoint (e.g. a public
    OpenVLA-OFT directory), which then loads as ``model.path``; else None. ``runner``: the typed section."""
    resume_dir = runner.resume_dir
    if not runner.only_eval or resume_dir in (None, "", "auto", DISABLE):
        return None
    return str(Path(str(resume_dir)).expanduser()) if is_model_checkpoint(str(resume_dir)) else None


def resume_source(resume_dir: str | None, resume_mode: str, output_dir: str | Path) -> Path | None:
    """The checkpoint a run starts from (``runner.resume_dir`` / ``runner.resume_mode``):

    * ``resume_mode: disable`` or ``resume_dir: disable`` - none, a fresh start;
    * ``resume_dir: null`` or ``auto`` - the latest complete checkpoint of ``output_dir`` (none yet: a
      fresh start);
    * a path - that ``step_<n>`` folder, or the latest complete checkpoint of that run folder (or of
      its ``checkpoints/``).

    An explicit path without a complete checkpoint raises one :class:`ConfigError` sentence naming
    ``runner.resume_dir``; nothing is read or written besides looking at the folder.
    """
    if resume_mode == DISABLE or resume_dir == DISABLE:
        return None
    if resume_dir in (None, "", "auto"):
        return latest_checkpoint(output_dir)
    path = Path(str(resume_dir)).expanduser()
    how = f"give a run's output folder or one of its checkpoints/step_<n> folders, or set runner.resume_dir={DISABLE}"
    if not path.is_dir():
        raise ConfigError("runner.resume_dir", f"'{path}' is not an existing folder; {how}")
    found = find_checkpoint(path)
    if found is not None:
        why = manifest.damaged(found)
        if why is not None:
            earlier = latest_checkpoint(found.parent.parent, warn=False) if _STEP_DIR.match(path.name) else None
            raise ConfigError("runner.resume_dir", f"'{found}' is incomplete ({why}: a copy that stopped half-way?); "
                                                   + (f"use {earlier}, the latest complete one" if earlier else how))
        return found
    if is_model_checkpoint(path):
        raise ConfigError("runner.resume_dir", f"'{path}' is a model checkpoint ({MODEL_CONFIG} and weights), not a "
                                               f"run's checkpoint; load it with model.path={path}")
    if _STEP_DIR.match(path.name):
        complete = find_checkpoint(path.parent)
        raise ConfigError("runner.resume_dir", f"'{path}' has no {COMPLETE} marker (its save was interrupted); "
                                               + (f"use {complete}, the latest complete one" if complete else how))
    raise ConfigError("runner.resume_dir", f"'{path}' holds no complete checkpoint (checkpoints/step_<n>/ with a "
                                           f"{COMPLETE} marker); {how}")


#: the sections whose values decide what a checkpoint's tensors are (architecture, adapters, full fine-tuning),
#: less the keys that may differ between the run that wrote it and one that loads it
_LAYOUT_SECTIONS = ("model", "actor.fsdp")
_LAYOUT_FREE = {"model.path", "model.device"}


def written_with(source: Path, cfg) -> str:
    """Why a run with config ``cfg`` cannot load checkpoint ``source``, from the ``config.yaml`` saved with it:
    `` (the checkpoint was written with actor.fsdp.full_finetune=false (this run: true); ...)``, naming up to
    three differing keys of the model and adapter layout (``model.name=...`` when none differs or the file
    cannot be read), or ``""`` when the checkpoint has no saved config."""
    written = source / CONFIG / "config.yaml"
    if not written.is_file():
        return ""
    from omegaconf import OmegaConf

    try:
        old = OmegaConf.load(written)
        what = f"model.name={old.model.name}"
        new = OmegaConf.create(OmegaConf.to_yaml(cfg))
        differ = []
        for section in _LAYOUT_SECTIONS:
            a, b = (_flat_section(c, section) for c in (old, new))
            differ += [f"{key}={show_value(a.get(key))} (this run: {show_value(b.get(key))})"
                       for key in sorted(a.keys() | b.keys()) if key not in _LAYOUT_FREE and a.get(key) != b.get(key)]
        what = ", ".join(differ[:3]) if differ else what
    except Exception:                                        # an unreadable config.yaml: the name alone, if any
        try:
            what = f"model.name={OmegaConf.load(written).model.name}"
        except Exception:
            return ""
    return f" (the checkpoint was written with {what}; use that run's model options, see {written})"


def _flat_section(cfg: Any, section: str) -> dict:
    """``section`` of an OmegaConf config as flat ``{dotted key: value}`` (resolved); one it lacks raises."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(OmegaConf.select(cfg, section) or {}, resolve=True)
    assert isinstance(container, dict)      # a section is a mapping
    return flatten(container, section + ".")


def load_policy_weights(policy, source: Path, cfg) -> None:
    """Load checkpoint ``source``'s trained weights (its ``policy/`` folder, nothing else) into ``policy``; a
    checkpoint of another model is one sentence naming the keys of ``cfg`` that differ (``embodirl eval``)."""
    try:
        policy.load_trainable(source / POLICY)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError("runner.resume_dir", f"{str(exc).rstrip('.')}{written_with(source, cfg)}") from None


def load_actor_state(actors, source: Path, cfg) -> None:
    """Restore every actor rank from checkpoint ``source`` (trained weights, optimizer, schedule, replay buffer,
    counters); a checkpoint of another model or adapter layout is one sentence naming the keys of ``cfg`` that
    differ from the run that wrote it (``embodirl train`` and ``embodirl sft`` resume through here)."""
    try:
        actors.load(source.resolve())
    except Exception as exc:
        raise ConfigError("runner.resume_dir",
                          f"cannot resume from {source}: {last_line(exc)}{written_with(source, cfg)}") from None


def show_value(value) -> str:
    """A YAML-like spelling of a config value (``false``, ``null``, ``[a, b]``)."""
    return json.dumps(value) if isinstance(value, bool | None | list) else str(value)


def checkpoint_step(path: str | Path) -> int:
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint folder (step_<n> with a {COMPLETE} marker)")
    match = _STEP_DIR.match(Path(path).name)
    assert match is not None                # is_checkpoint matched it
    return int(match.group(1))


def save_rng(folder: Path) -> None:
    """The driver's generator states as JSON (``rng.json``, no pickle: see
    :func:`~embodirl.runtime.rng_state_to_json`)."""
    _write_json(folder / RNG, rng_state_to_json(rng_state()))


def load_rng(folder: Path) -> None:
    """Restore :func:`save_rng`. A checkpoint from before the JSON files has ``rng.pt`` instead: see
    :func:`_load_legacy_rng`."""
    if not (folder / RNG).exists() and (folder / LEGACY_RNG).exists():
        state = _load_legacy_rng(folder / LEGACY_RNG)
    else:
        state = rng_state_from_json(json.loads((folder / RNG).read_text()))
    if state is not None:
        set_rng_state(state)


def save_worker_rng(folder: Path, states: list[dict] | None) -> None:
    """The inference workers' RNG states (remote workers sample in their own processes) as JSON; None:
    nothing to save (in-process workers use the driver's generators, saved in ``rng.json``)."""
    if states is not None:
        _write_json(folder / WORKER_RNG, [rng_state_to_json(state) for state in states])


def load_worker_rng(folder: Path) -> list[dict] | None:
    """:func:`save_worker_rng`'s states; None when there are none (or an old ``worker_rng.pt`` that
    cannot be read safely)."""
    if (folder / WORKER_RNG).exists():
        return [rng_state_from_json(d) for d in json.loads((folder / WORKER_RNG).read_text())]
    if (folder / LEGACY_WORKER_RNG).exists():
        return _load_legacy_rng(folder / LEGACY_WORKER_RNG)
    return None


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


def _load_legacy_rng(path: Path):
    """An RNG file of a checkpoint written before ``rng.json`` (``torch.save`` of python/numpy/torch
    states). Read with torch's restricted unpickler (``weights_only=True``), which builds only tensors,
    containers and the allow-listed numpy types of the MT19937 key array, so it runs no code from the
    file. None, with a warning, when that fails: the generators then keep this run's seeding."""
    import importlib

    try:
        multiarray = importlib.import_module("numpy._core.multiarray")  # numpy >= 2
    except ImportError:
        multiarray = importlib.import_module("numpy.core.multiarray")
    numpy_types: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
        np.ndarray, np.dtype, type(np.dtype(np.uint32)), multiarray._reconstruct]
    try:
        with torch.serialization.safe_globals(numpy_types):
            return torch.load(path, weights_only=True)
    except Exception as exc:
        log.warning("RNG state not restored from %s: an old pickled file that does not load with "
                    "weights_only=True (%s); the generators keep this run's seeding", path, type(exc).__name__)
        log.debug("loading %s failed: %s", path, exc)
        return None
