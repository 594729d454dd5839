"""Crash recovery of :class:`~embodirl.envs.vector.vector_env.ProcessVectorEnv`: a sub-env whose command failed
(a dead process, an exception, a non-finite observation or reward, a hang) is replaced by a new one from its
factory and reset into the same episode start (task, init state, seed).

The parent remembers, per sub-env, what that takes (:class:`SubEnvSlot`); :class:`Recovery` does the
replacing and counts. ``max_restarts`` bounds the consecutive failures of one sub-env (a successful
command clears the count); past it :class:`SubEnvCrashed` propagates.

A hang is told from a slow step by the sub-env's own recent step latency (:class:`HangLimits`): a step that
takes :data:`HANG_LATENCY_MULTIPLE` times the slowest of its last :data:`HANG_WINDOW` steps, and at least
:data:`HANG_FLOOR_S`, is presumed hung - a frozen PushCube simulator (steps of ~50 ms) is declared hung after
10 s instead of the ``step_timeout`` ceiling (``env.step_timeout_s``, 300 s), which still bounds every command
and alone applies to resets (a LIBERO reset that rebuilds its scene takes seconds, unlike the resets before it)
and to a sub-env's first steps. The vector env waits for all its sub-envs at once, so several frozen ones are
found together, and kills them with SIGKILL, which a stopped process cannot ignore.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from embodirl.envs.vector.episodes import ResetOut
from embodirl.envs.vector.subproc import LocalSubEnv, ProcessSubEnv, SubEnvFailure

log = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3
SubEnvHandle = LocalSubEnv | ProcessSubEnv
#: a step slower than this multiple of the sub-env's recent slowest step is presumed hung ...
HANG_LATENCY_MULTIPLE = 20.0
#: ... if it has also run this long (a loaded machine slows every step; swapping can stall one for seconds)
HANG_FLOOR_S = 10.0
#: steps of a sub-env that make its recent latency
HANG_WINDOW = 64
#: the commands whose recent latency predicts the next one's (a reset may rebuild a scene: it gets the ceiling)
ADAPTIVE_COMMANDS = ("step",)


class HangLimits:
    """How long each sub-env may take for its next command (see module docstring)."""

    def __init__(self, *, multiple: float = HANG_LATENCY_MULTIPLE, floor_s: float = HANG_FLOOR_S,
                 window: int = HANG_WINDOW):
        self.multiple, self.floor_s, self.window = float(multiple), float(floor_s), int(window)
        self._recent: dict[int, collections.deque] = {}

    def record(self, i: int, command: str, seconds: float) -> None:
        if command in ADAPTIVE_COMMANDS:
            self._recent.setdefault(i, collections.deque(maxlen=self.window)).append(float(seconds))

    def limit(self, i: int, command: str, ceiling: float | None) -> float | None:
        """Seconds sub-env ``i`` may take for ``command``; ``ceiling`` (``env.step_timeout_s``; None: wait
        forever, and no hang detection) bounds it."""
        recent = self._recent.get(i)
        if ceiling is None or command not in ADAPTIVE_COMMANDS or not recent:
            return ceiling
        return min(ceiling, max(self.floor_s, self.multiple * max(recent)))

    def describe(self, i: int) -> str:
        recent = self._recent.get(i)
        return f"its last {len(recent)} steps took at most {max(recent):.2f} s" if recent else "no step timed yet"


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
