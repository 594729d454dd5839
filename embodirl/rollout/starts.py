"""Where each env slot's episode starts: task ids, init states and GRPO groups.

Env slots are numbered globally ``0 .. N-1`` across env workers and pipeline stages (worker-major,
then stage, then simulator: slot ``n = (k * S + s) * B + b``). GRPO compares trajectories that share an
init state, so slots form groups of ``group_size`` consecutive ids (``group_id = n // G``) and, with
``use_fixed_reset_state_ids``, every slot of a group starts from the same ``(task_id, init_state_id)``, drawn as the
simulators draw theirs: from ``init_state_ids`` when listed, else from the env's training states (``spec.num_init_states``
per task, ids from ``spec.first_init_state``: :data:`~embodirl.envs.base.TRAIN_INIT_STATE_BASE` for held-out ones).
Without it the adapter chooses each start (``None``) unless the caller passes explicit ones
(evaluation sweeps over init states).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from embodirl.envs.base import CommonEnvConfig, EnvSpec
from embodirl.envs.registry import env_config
from embodirl.errors import ConfigError

NO_START = -1   # "the adapter's choice" in an int64 start array (ProcessVectorEnv reads < 0 as None)
# init states of simulators without a fixed set (ManiSkill's random initialisation) are drawn from this
# range; adapters treat such an id as a seed of the initialisation.
RANDOM_INIT_RANGE = 2**31 - 1


@dataclass(frozen=True)
class EpisodeStarts:
    """Per-slot episode starts, int64 ``[N]`` each; ``NO_START`` leaves the choice to the adapter."""

    task_ids: np.ndarray
    init_state_ids: np.ndarray

    def __len__(self) -> int:
        return int(self.task_ids.shape[0])

    def slice(self, start: int, stop: int) -> EpisodeStarts:
        return EpisodeStarts(self.task_ids[start:stop].copy(), self.init_state_ids[start:stop].copy())

    def take(self, rows: np.ndarray) -> EpisodeStarts:
        return EpisodeStarts(self.task_ids[rows].copy(), self.init_state_ids[rows].copy())

    def reset_kwargs(self) -> dict:
        """``task_ids``/``init_state_ids`` for :meth:`ChunkVectorEnv.reset` (None where all unset)."""
        def arg(values: np.ndarray):
            return None if np.all(values < 0) else values
        return dict(task_ids=arg(self.task_ids), init_state_ids=arg(self.init_state_ids))

    @staticmethod
    def unset(n: int) -> EpisodeStarts:
        return EpisodeStarts(np.full(n, NO_START, np.int64), np.full(n, NO_START, np.int64))

    @staticmethod
    def concat(parts: Sequence[EpisodeStarts]) -> EpisodeStarts:
        return EpisodeStarts(np.concatenate([p.task_ids for p in parts]),
                             np.concatenate([p.init_state_ids for p in parts]))


def group_ids(num_slots: int, group_size: int, slot_offset: int = 0) -> np.ndarray:
    """``group_id`` int64 ``[num_slots]`` of slots ``slot_offset ..``: blocks of ``group_size``."""
    return (np.arange(num_slots, dtype=np.int64) + slot_offset) // max(int(group_size), 1)


def allowed_tasks(env: CommonEnvConfig, spec: EnvSpec) -> list[int]:
    """Task ids the env split trains on (its ``task_subset``; default: the whole task table)."""
    ids = env.task_subset
    return list(ids) if ids else list(range(len(spec.task_descriptions)))


def plan_starts(env_cfg, spec: EnvSpec, num_slots: int, group_size: int, rng: np.random.Generator,
                ) -> EpisodeStarts:
    """Starts for one rollout of ``num_slots`` slots (see module docstring); ``env_cfg``: the env split, typed (or a
    mapping of it, converted here)."""
    env = env_config(env_cfg)
    if not env.use_fixed_reset_state_ids or group_size <= 1:
        return EpisodeStarts.unset(num_slots)
    if num_slots % group_size:
        raise ConfigError("algorithm.group_size", f"{num_slots} env slots do not hold whole groups of {group_size}")
    tasks = allowed_tasks(env, spec)
    num_groups = num_slots // group_size
    task_per_group = np.asarray([tasks[i] for i in rng.integers(len(tasks), size=num_groups)], np.int64)  # (groups,)
    first = spec.first_init_state           # held-out training states: ids from TRAIN_INIT_STATE_BASE on
    if env.init_state_ids:                  # the listed states (the simulators draw from them too)
        listed = np.asarray(env.init_state_ids, np.int64)
        init_per_group = listed[rng.integers(len(listed), size=num_groups)]                   # (groups,)
    elif spec.num_init_states:
        limits = np.asarray([spec.num_init_states[t] for t in task_per_group], np.int64)
        init_per_group = first + (rng.random(num_groups) * limits).astype(np.int64)           # (groups,)
    else:
        init_per_group = rng.integers(first, RANDOM_INIT_RANGE, size=num_groups, dtype=np.int64)
    return EpisodeStarts(np.repeat(task_per_group, group_size), np.repeat(init_per_group, group_size))
