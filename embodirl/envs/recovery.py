"""Crash recovery of :class:`~embodirl.envs.vector.ProcessVectorEnv`: a sub-env whose command failed
(a dead process, an exception, a non-finite observation or reward, a hang past ``step_timeout``) is
replaced by a new one from its factory and reset into the same episode start (task, init state, seed).

The parent remembers, per sub-env, what that takes (:class:`SubEnvSlot`); :class:`Recovery` does the
replacing and counts. ``max_restarts`` bounds the consecutive failures of one sub-env (a successful
command clears the count); past it :class:`SubEnvCrashed` propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from embodirl.envs.episodes import ResetOut
from embodirl.envs.subproc import LocalSubEnv, ProcessSubEnv, SubEnvFailure

log = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3
SubEnvHandle = LocalSubEnv | ProcessSubEnv


class SubEnvCrashed(RuntimeError):
    """A sub-environment kept failing after ``max_restarts`` consecutive restarts."""


@dataclass
class SubEnvSlot:
    """What the parent remembers about one sub-env, to restart it into the same episode."""

    handle: SubEnvHandle
    obs: dict[str, np.ndarray] | None = None
    task_id: int | None = None
    init_state_id: int | None = None
    seed: int | None = None
    failures: int = 0                       # consecutive failures (a successful command clears it)


class Recovery:
    """Replaces failed sub-envs and counts the restarts."""

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts
        self.num_restarts = 0               # restarts of all sub-envs since construction

    def restart(self, i: int, slot: SubEnvSlot, failure: SubEnvFailure, *, new_handle: Callable[[int], SubEnvHandle],
                render: bool, start_timeout: float, step_timeout: float | None) -> ResetOut:
        """Replace sub-env ``i`` by a new one from its factory (``new_handle(i)``: an unstarted handle) and
        reset it into the same episode."""
        while True:
            slot.failures += 1
            if slot.failures > self.max_restarts:
                raise SubEnvCrashed(f"sub-environment {i} failed {slot.failures} times in a row "
                                    f"(max_restarts={self.max_restarts}); last error: {failure}") from failure.cause
            self.num_restarts += 1
            log.warning("restarting sub-environment %d (restart %d in a row, %d in total): %s",
                        i, slot.failures, self.num_restarts, failure)
            slot.handle.kill()
            slot.handle = new_handle(i)
            try:
                slot.handle.start()
                slot.handle.recv(start_timeout)
                slot.handle.send("reset", dict(task_id=slot.task_id, init_state_id=slot.init_state_id,
                                               seed=slot.seed, render=render))
                return slot.handle.recv(step_timeout)
            except SubEnvFailure as again:
                failure = again
