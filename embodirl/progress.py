"""Progress lines for phases that can run for minutes (a 7B model's rollout or update): a :class:`Ticker` says
when another line is due, so a long step shows where it is instead of going quiet, and a short one prints
nothing."""

from __future__ import annotations

import os
import time

#: seconds between two progress lines of one phase (none before the phase has run this long);
#: ``EMBODIRL_PROGRESS_INTERVAL_S`` sets it
PROGRESS_INTERVAL_S = float(os.environ.get("EMBODIRL_PROGRESS_INTERVAL_S", 30.0))


class Ticker:
    """``due()`` is true once every ``interval_s`` seconds (default :data:`PROGRESS_INTERVAL_S`, read when the
    ticker is made; the first after ``interval_s``); ``elapsed`` counts from creation."""

    def __init__(self, interval_s: float | None = None):
        self.interval_s = float(PROGRESS_INTERVAL_S if interval_s is None else interval_s)
        self.start = self.last = time.perf_counter()

    def due(self) -> bool:
        now = time.perf_counter()
        if now - self.last < self.interval_s:
            return False
        self.last = now
        return True

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start
