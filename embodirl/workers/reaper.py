"""The Ray processes a driver started go with it, however it ends.

``ray.init()`` without an address starts Ray's daemons as the driver's descendants: the GCS server, the raylet, the
log monitor and, through the raylet, the dashboard and runtime-env agents and the worker processes (which start the
simulators). A normal end stops them (``ray.shutdown()``), and after a ``kill -9`` of the driver the GCS server and
the raylet, and with them the workers, exit too; but the raylet's agents do not: with Ray 2.60, ``ray::DashboardAgent``
and ``ray::RuntimeEnvAgent`` of a training run were still running 40 s after its driver was killed, and would have
stayed until someone found them.

:func:`start` (called when embodirl starts a local Ray, never when it joins a cluster) launches a reaper: a small
process in a session of its own (a terminal's Ctrl-C or a kill of the driver's process group leaves it its job)
that waits on the driver's pidfd and meanwhile notes the driver's Ray descendants (``ray::*`` workers and agents,
``gcs_server``, ``raylet``, Ray's own Python daemons), at growing intervals (Ray starts its agents within its first
seconds). Once the driver has exited it gives them :data:`GRACE_S` to exit by themselves and then SIGKILLs those
still running with the same pid and start time (a recycled pid is never hit). It costs one short-lived scan of the
process table per interval.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)

#: seconds the driver's Ray processes get to exit by themselves once it is gone
GRACE_S = 5.0
#: the reaper's scans of the driver's descendants: first after this many seconds, then twice as long, up to the cap
FIRST_SCAN_S, MAX_SCAN_S = 1.0, 30.0

_CODE = r"""
import os, select, sys, time
import psutil
driver, grace, first, cap = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
me = os.getpid()
try:
    fd = os.pidfd_open(driver)
except (AttributeError, OSError):
    fd = None
print("watching", flush=True)
sys.stdout.close()
known = {}
def scan():
    try:
        children = psutil.Process(driver).children(recursive=True)
    except psutil.Error:
        return
    for p in children:
        try:
            name, cmd = p.name(), " ".join(p.cmdline())
            if p.pid != me and (name.startswith("ray::") or name in ("gcs_server", "raylet") or "/ray/" in cmd):
                known[p.pid] = p.create_time()
        except psutil.Error:
            pass
def driver_alive(wait):
    if fd is not None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return not poller.poll(wait * 1000)
    time.sleep(wait)
    return psutil.pid_exists(driver)
interval = first
while True:
    scan()
    if not driver_alive(interval):
        break
    interval = min(interval * 2, cap)
deadline = time.monotonic() + grace
def left():
    out = []
    for pid, created in known.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out
while left() and time.monotonic() < deadline:
    time.sleep(0.2)
for p in left():
    try:
        p.kill()
    except psutil.Error:
        pass
"""


def start(driver_pid: int | None = None) -> None:
    """Launch the reaper of ``driver_pid``'s (default: this process's) Ray processes (see module docstring)."""
    driver_pid = os.getpid() if driver_pid is None else int(driver_pid)
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _CODE, str(driver_pid), str(GRACE_S), str(FIRST_SCAN_S),
                                 str(MAX_SCAN_S)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError as exc:
        log.warning("the reaper of this run's Ray processes did not start (%s): after a kill -9 of this process "
                    "Ray's agents may stay behind", exc)
        return
    line = proc.stdout.readline() if proc.stdout else b""
    if proc.stdout:
        proc.stdout.close()
    if line.strip() != b"watching":
        log.warning("the reaper of this run's Ray processes did not start: after a kill -9 of this process "
                    "Ray's agents may stay behind")
