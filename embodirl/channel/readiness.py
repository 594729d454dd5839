"""Waiting until file descriptors are readable, with ``poll(2)``.

``select(2)`` takes only descriptors numbered below ``FD_SETSIZE`` (1,024): in a process with more files or sockets
open (a Ray worker holding many connections, a data loader), ``select.select`` raises ``ValueError`` for the ring
it should wait on, and a loop that retries spins without serving. ``poll`` has no such limit.
"""

from __future__ import annotations

import math
import select
from collections.abc import Iterable


def wait_readable(fds: Iterable[int], timeout: float | None = None) -> list[int]:
    """The descriptors of ``fds`` that are readable (or closed at the other end, or invalid: a caller looks again)
    within ``timeout`` seconds (None: wait for ever); empty on timeout."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    wait_ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return [fd for fd, _ in poller.poll(wait_ms)]
