"""Deadlines of calls to workers that are alive but stuck (``runner.worker_deadline``).

Simulators have hang detection of their own (:mod:`embodirl.envs.vector.recovery`); this module gives the same to
every other call that waits on a Ray worker: an env worker's collection, an inference worker's weight update or a
decision it streams back, an actor rank's update, publication or checkpoint. A call is presumed hung when it has
taken ``multiple`` times the slowest of the last :data:`WINDOW` calls of its kind (the same method of the same worker
group) and at least ``floor_s``; a kind not timed yet (the first update, the first checkpoint, building a 7B policy)
waits ``first_call_s``. A CUDA kernel or a collective that never returns, or a process stopped with SIGSTOP, is
found this way instead of blocking the run until the 30-minute process-group timeout, or for ever.

:class:`CallTimes` keeps the recent times and says the next deadline; :class:`WorkerHung` is the one sentence that
names the worker. The run then rebuilds every worker group from its last complete checkpoint (up to
``runner.max_restarts`` times, as for an actor rank that died) or stops (``runner.worker_deadline.action``).
"""

from __future__ import annotations

import collections
import os
import signal
import socket
from collections.abc import Iterable

#: calls of one kind whose slowest sets the next deadline
WINDOW = 16
#: seconds a worker may take to answer a liveness probe (``ready``) once a deadline has passed
PROBE_S = 5.0
KEY = "runner.worker_deadline"


class WorkerHung(RuntimeError):
    """A worker did not finish a call within its deadline (the message is one sentence naming it). ``pids``: the
    ``(host, pid)`` of the workers named, which are killed at once when on this host (a stopped process ignores
    everything but SIGKILL); ``label``: what they are (``inference worker``, ``actor rank``, ...)."""

    def __init__(self, message: str, pids: Iterable[tuple[str | None, int | None]] = (), label: str = ""):
        super().__init__(message)
        self.pids = list(pids)
        self.label = label

    def __reduce__(self):
        return type(self), (str(self), self.pids, self.label)

    def kill_local(self) -> None:
        """SIGKILL the named workers that run on this host (Ray kills the others when their group closes)."""
        host = socket.gethostname()
        for where, pid in self.pids:
            if where == host and pid:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass


class CallTimes:
    """Recent durations of each kind of call of one worker group, and the deadline of the next (see module docstring).
    ``settings``: the typed ``runner.worker_deadline`` section; None (or ``floor_s: null``): no deadline."""

    def __init__(self, settings=None, window: int = WINDOW):
        self.settings = settings
        self._recent: dict[str, collections.deque] = {}
        self.window = int(window)

    @property
    def enabled(self) -> bool:
        return self.settings is not None and self.settings.floor_s is not None

    def record(self, kind: str, seconds: float) -> None:
        self._recent.setdefault(kind, collections.deque(maxlen=self.window)).append(float(seconds))

    def limit(self, kind: str) -> float | None:
        """Seconds the next call of ``kind`` may take (None: no deadline)."""
        if not self.enabled:
            return None
        s, recent = self.settings, self._recent.get(kind)
        if not recent:
            return max(float(s.floor_s), float(s.first_call_s))
        return max(float(s.floor_s), float(s.multiple) * max(recent))

    def describe(self, kind: str) -> str:
        """Why the deadline of ``kind`` is what it is (for the sentence)."""
        s, recent = self.settings, self._recent.get(kind)
        if not recent:
            return f"its first {kind} call, {KEY}.first_call_s={s.first_call_s:g}"
        return (f"{s.multiple:g} x the slowest of its last {len(recent)} {kind} calls, {max(recent):.2f} s, and at least "
                f"{KEY}.floor_s={s.floor_s:g}")


def is_stopped(info: dict | None) -> bool:
    """The worker process ``info`` describes (``pid``, ``host``) is on this host and stopped (SIGSTOP, a debugger)."""
    if not info or not info.get("pid") or info.get("host") != socket.gethostname():
        return False
    import psutil

    try:
        return psutil.Process(int(info["pid"])).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def where(info: dict | None, stopped: bool = False) -> str:
    """`` (pid 123, node 3f2a..., stopped)``: a worker's process as the sentence names it."""
    if not info or not info.get("pid"):
        return ""
    node = info.get("node_id")
    parts = [f"pid {info['pid']}"] + ([f"node {str(node)[:12]}"] if node else []) + (["stopped"] if stopped else [])
    return f" ({', '.join(parts)})"
