"""The runner's part of a checkpoint, read back: ``runner/state.json`` (step counters, the start-planning
generator, the KL coefficient, the collapse guard's state), ``rng.json`` and ``worker_rng.json``.

A file that is not what the run wrote (truncated, edited by hand, from another version) ends the resume in one
sentence naming it and the way on (:class:`~embodirl.errors.ConfigError` on ``runner.resume_dir``), not in a
traceback from deep inside numpy's generator or the guard.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embodirl import checkpoint_layout as layout
from embodirl.errors import ConfigError
from embodirl.runner import checkpoint as ckpt

STATE = "state.json"


@dataclass
class RunState:
    """What ``runner/state.json`` restores besides the generators."""

    env_steps: float
    elapsed_min: float
    kl_coef: float


def _malformed(path: Path, reason: str) -> ConfigError:
    return ConfigError("runner.resume_dir", f"cannot resume from {path}: it is malformed ({reason}); resume from "
                                            "another checkpoint (runner.resume_dir=<run>/checkpoints/step_<n>) or "
                                            "start afresh in another runner.output_dir")


def _number(state: dict, key: str, default: float, path: Path) -> float:
    value = state.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _malformed(path, f"'{key}' is {value!r}, not a finite number")
    return float(value)


def restore(source: Path, starts_rng: np.random.Generator, guard, kl_coef: float, groups) -> RunState:
    """Restore checkpoint ``source``'s runner state: ``starts_rng``'s state, the ``guard``'s
    (:class:`~embodirl.runner.guard.CollapseGuard`), this process's generators and the Ray inference workers'
    (``groups``); returns the counters. A malformed file raises one :class:`ConfigError` sentence naming it."""
    folder = source / layout.RUNNER
    path = folder / STATE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise _malformed(path, "the file is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _malformed(path, f"not JSON: {exc}") from None
    if not isinstance(state, dict):
        raise _malformed(path, f"a JSON {type(state).__name__}, not an object")
    try:
        starts_rng.bit_generator.state = state["starts_rng"]
    except KeyError:
        raise _malformed(path, "no 'starts_rng' entry") from None
    except (TypeError, ValueError) as exc:
        raise _malformed(path, f"'starts_rng' is not a generator state: {exc}") from None
    restored = RunState(env_steps=_number(state, "env_steps", 0.0, path),
                        elapsed_min=_number(state, "elapsed_min", 0.0, path),
                        kl_coef=_number(state, "kl_coef", kl_coef, path))
    try:
        guard.load_state_dict(state.get("guard"))
    except (TypeError, ValueError) as exc:
        raise _malformed(path, f"its 'guard' entry is not the collapse guard's state: {exc}") from None
    for name, load in ((layout.RNG, lambda: ckpt.load_rng(folder)),
                       (layout.WORKER_RNG, lambda: groups.set_rng_states(ckpt.load_worker_rng(folder)))):
        try:
            load()
        except (KeyError, TypeError, ValueError) as exc:
            raise _malformed(folder / name, f"not a generator state: {type(exc).__name__}: {exc}") from None
    return restored
