"""A run owns its folder: who holds it, and what a new run may do with a folder that already holds files.

* **The lock** (:class:`FolderLock`): ``fcntl.flock`` on ``<folder>/.lock`` for the whole run, training or
  evaluation, with a record of the holder (host, pid, start time, command) in that file. A second run into a held
  folder is refused in one sentence naming the holder. The kernel drops the lock when the holder exits, however it
  exits: a killed run leaves no stale lock (on NFS flock needs a server with lock support).
* **Training** (:func:`training_start`): a folder holding a run (complete checkpoints or logged steps in
  ``metrics.jsonl``) is resumed only when its saved config has the same hyper-parameters
  (:func:`hyperparameter_differences`: every key but those in :data:`RESUME_FREE`); otherwise, and for
  ``runner.resume_mode=disable`` or a start from another folder's checkpoint, the run is refused in one sentence
  naming the differing keys and how to start elsewhere. A run already at ``runner.max_steps`` raises
  :class:`~embodirl.errors.AlreadyTrained` (the CLI's exit status 3).
* **Evaluation** (:func:`check_eval_folder`): never into a training run's folder; a folder holding an earlier
  evaluation is rewritten only when that evaluation scored the same weights (:mod:`embodirl.runner.weights`).

Everything here reads the folder and raises before any worker starts; nothing is written but the lock file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from embodirl import checkpoint_layout as layout
from embodirl.errors import AlreadyTrained, ConfigError
from embodirl.runner import checkpoint as ckpt
from embodirl.runner.metrics_logger import flatten

LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
EVAL_INFO = "eval_info.json"
#: what a resumed run may change: how it is driven, logged, evaluated and placed, not what a training step computes
#: (a key, or a prefix ending in "."); runner.seed is the one runner key that is a hyper-parameter
RESUME_FREE = ("runner.", "cluster.", "env.eval.", "env_workers.", "model.device", "actor.cpu_world_size",
               "actor.enable_offload", "actor.compile", "actor.fsdp.cpu_offload", "actor.fsdp.gradient_checkpointing",
               "actor.replay_buffer.max_bytes", "rollout.num_workers", "rollout.pipeline_stage_num",
               "rollout.enable_offload", "rollout.compile", "rollout.channel.", "env.train.processes",
               "env.train.video.", "env.train.step_timeout_s")
RESUME_BOUND = ("runner.seed",)
#: a learning-rate decay that follows runner.max_steps (config.yaml's default) follows it when a run is extended
DECAY_STEPS = "actor.optim.lr_decay_steps"
#: differing keys named in a refusal
SHOWN = 4
#: errno values of a write that found no room: a full disk, a full quota, a file-size limit
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
NO_ROOM_TEXT = ("No space left on device", "Disk quota exceeded", "File too large")


class FolderLock:
    """``with FolderLock(folder):`` holds ``folder`` for this process (see module docstring). ``key``: the config
    key a refusal names."""

    def __init__(self, folder: str | Path, key: str = "runner.output_dir"):
        self.folder, self.key = Path(folder), key
        self._fd: int | None = None

    def __enter__(self) -> FolderLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ConfigError(self.key, f"{self.folder} is in use by another run ({holder}); wait for it to end, or "
                                        "choose another folder with runner.experiment_name=<name> or "
                                        "runner.output_dir=<folder>") from None
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(["embodirl", *sys.argv[1:]])}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)                # the record names a holder only while one holds the lock
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _holder(fd: int) -> str:
    """The lock file's record as words: ``pid 12 on host-a since 2026-01-02 10:11:12 UTC``."""
    try:
        record = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
        return f"pid {record['pid']} on {record['host']} since {record['since']}"
    except (ValueError, KeyError, OSError):
        return "a run that is starting"


# --- what a folder holds --------------------------------------------------------------------------------------------
def logged_steps(folder: Path) -> int:
    """How many lines ``metrics.jsonl`` holds (0 when there is none)."""
    path = Path(folder) / METRICS_FILE
    if not path.is_file():
        return 0
    with path.open("rb") as handle:
        return sum(1 for line in handle if line.strip())


def holds_run(folder: Path) -> str | None:
    """What of a training run ``folder`` holds, in words (``checkpoints up to step_20 and 20 lines of
    metrics.jsonl``), or None when it holds neither checkpoints nor metrics."""
    latest = ckpt.latest_checkpoint(folder)
    lines = logged_steps(folder)
    parts = ([f"checkpoints up to {latest.name}"] if latest is not None else []) + \
        ([f"{lines} lines of {METRICS_FILE}"] if lines else [])
    return " and ".join(parts) or None


def _free(key: str) -> bool:
    return key not in RESUME_BOUND and any(key == p or (p.endswith(".") and key.startswith(p)) for p in RESUME_FREE)


def config_values(cfg) -> dict:
    """A config (typed, composed or loaded from YAML) as flat ``{dotted key: value}``, as the YAML it is saved as."""
    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.create(OmegaConf.to_yaml(cfg))
    container = OmegaConf.to_container(node, resolve=True)
    assert isinstance(container, dict)      # a config is a mapping of sections
    return flatten(container)


def hyperparameter_differences(saved: Path, cfg) -> list[str]:
    """The hyper-parameters of config ``cfg`` that differ from the config saved at ``saved``, as
    ``actor.optim.lr=0.0003 (this run: 0.0001)``; keys only one side has (a newer version's) are not compared. An
    unreadable or missing file is one entry saying so."""
    try:
        old = config_values(OmegaConf.load(saved))
    except Exception as exc:  # a missing or damaged file: its settings are unknown
        return [f"settings that cannot be read ({saved}: {type(exc).__name__})"]
    new = config_values(cfg)
    differ = []
    for key in sorted(old.keys() & new.keys()):
        if _free(key) or old[key] == new[key]:
            continue
        if key == DECAY_STEPS and old[key] == old.get("runner.max_steps") and new[key] == new.get("runner.max_steps"):
            continue
        differ.append(f"{key}={ckpt.show_value(old[key])} (this run: {ckpt.show_value(new[key])})")
    return differ


# --- training -------------------------------------------------------------------------------------------------------
def training_start(cfg, folder: Path) -> Path | None:
    """The checkpoint a training run into ``folder`` starts from (None: the start), after the folder rules of the
    module docstring; ``cfg``: the typed config. Raises :class:`ConfigError` or :class:`AlreadyTrained`."""
    r = cfg.runner
    folder = Path(folder)
    source = ckpt.resume_source(r.resume_dir, r.resume_mode, folder)
    elsewhere = ("start it in a folder of its own with runner.experiment_name=<name> or runner.output_dir=<folder>")
    if (folder / EVAL_INFO).is_file():
        raise ConfigError("runner.output_dir", f"{folder} holds an evaluation ({EVAL_INFO}), not a training run; "
                                               f"{elsewhere}")
    held = holds_run(folder)
    if held is not None:
        if layout.DISABLE in (r.resume_mode, r.resume_dir):
            key = "runner.resume_mode" if r.resume_mode == layout.DISABLE else "runner.resume_dir"
            raise ConfigError(key, f"is {layout.DISABLE}, a fresh start, but {folder} holds a run ({held}) that it "
                                   f"would overwrite; resume that run with runner.resume_mode=auto and its settings, "
                                   f"or {elsewhere}")
        if source is not None and not source.resolve().is_relative_to(folder.resolve()):
            raise ConfigError("runner.output_dir", f"{folder} holds another run ({held}); a run resumed from {source} "
                                                   f"needs a folder of its own: {elsewhere}")
        saved = (source / layout.CONFIG / CONFIG_FILE) if source is not None else folder / CONFIG_FILE
        differ = hyperparameter_differences(saved, cfg)
        if differ:
            more = f" and {len(differ) - SHOWN} more" if len(differ) > SHOWN else ""
            raise ConfigError("runner.output_dir", f"{folder} holds a run ({held}) trained with "
                                                   f"{', '.join(differ[:SHOWN])}{more}; resuming it needs the same "
                                                   f"settings (see {saved}), or {elsewhere}")
    if source is not None and ckpt.checkpoint_step(source) >= r.max_steps:
        step = ckpt.checkpoint_step(source)
        raise AlreadyTrained(f"{folder} is already trained to step {step} (runner.max_steps={r.max_steps}): nothing "
                             f"to train; raise runner.max_steps to continue it, evaluate it with embodirl eval "
                             f"runner.resume_dir={source}, or start a new run with runner.experiment_name=<name>")
    return source


# --- evaluation -----------------------------------------------------------------------------------------------------
def check_eval_folder(folder: Path, weights: dict) -> None:
    """An evaluation scoring ``weights`` (:func:`~embodirl.runner.weights.weights_record`) may write ``folder``: not a
    training run's, nor one holding the evaluation of other weights."""
    folder = Path(folder)
    elsewhere = "choose another folder with runner.experiment_name=<name> or runner.output_dir=<folder>"
    held = holds_run(folder)
    if held is not None:
        raise ConfigError("runner.output_dir", f"{folder} is a training run's folder ({held}); embodirl eval writes a "
                                               f"folder of its own: {elsewhere} (runner.resume_dir={folder} evaluates "
                                               f"that run's latest checkpoint)")
    earlier = folder / EVAL_INFO
    if not earlier.is_file():
        return
    try:
        scored = json.loads(earlier.read_text()).get("weights")
    except (ValueError, OSError, AttributeError):
        scored = None
    if scored != weights:
        what = (f"{scored.get('path') or 'a random init'}" + (f" (step {scored['step']})" if scored.get("step") else "")
                if isinstance(scored, dict) else "weights it does not record")
        raise ConfigError("runner.output_dir", f"{folder} holds the evaluation of {what}, not of these weights; "
                                               f"{elsewhere}")


# --- a full disk ----------------------------------------------------------------------------------------------------
def no_room(exc: BaseException) -> str | None:
    """Why ``exc`` (or what it wraps: a Ray task error, torch's checkpoint exception) is a write that found no room
    (a full disk or quota, a file-size limit), in words; None when it is something else."""
    seen = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in NO_ROOM:
            return f"{cause.strerror}" + (f": {cause.filename}" if cause.filename else "")
        text = str(cause)
        for phrase in NO_ROOM_TEXT:
            if phrase in text:
                return phrase
        cause = cause.__cause__ or cause.__context__
    return None
