"""No shared-memory entry outlives its run: close, exit, SIGTERM, Ctrl-C, SIGKILL (owner and group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from embodirl.channel import segments
from embodirl.channel.shm_channel import ShmChannel

CLEANUP_DEADLINE_S = 20.0   # generous: the janitor reacts within milliseconds, the machine may be busy

# A process that owns a ring, prints its entries, then waits to be ended in the way the test chooses.
_OWNER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from embodirl.channel import segments
    from embodirl.channel.shm_channel import ShmChannel
    if os.environ.get("OWN_RUN"):
        segments.own_run()
    channel = ShmChannel({"images": np.zeros((4, 3, 32, 32), np.uint8)}, num_slots=2, tag="test")
    channel.put({"images": np.ones((4, 3, 32, 32), np.uint8)})
    print(" ".join(segments.owned()), flush=True)
    if sys.argv[1] == "exit":
        sys.stdin.readline()
        sys.exit(0)
    if sys.argv[1] == "kill-children":  # what a Ray worker does as it exits: its children die first
        import psutil
        sys.stdin.readline()
        for child in psutil.Process().children():
            child.kill()
        os._exit(0)
    time.sleep(600)
""")


def _wait_gone(names, deadline_s=CLEANUP_DEADLINE_S):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        left = [n for n in names if os.path.exists(os.path.join(segments.SHM_DIR, n))]
        if not left:
            return []
        time.sleep(0.05)
    return left


def _spawn_owner(mode: str, run: str, own_run: bool = False, **popen):
    env = dict(os.environ, EMBODIRL_SHM_RUN=run)
    if own_run:
        env["OWN_RUN"] = "1"
    # the default SIGINT disposition, as a terminal's Ctrl-C finds it: a shell without job control runs
    # background commands (e.g. `bash .ci/run &`) with SIGINT ignored, and children inherit that
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            **popen)
    names = proc.stdout.readline().split()
    assert len(names) == 3, f"owner printed {names!r}"   # the segment and its two FIFOs
    assert all(n.startswith(f"erl_{run}_{proc.pid}_") for n in names)
    assert all(os.path.exists(os.path.join(segments.SHM_DIR, n)) for n in names)
    return proc, names


@pytest.fixture
def run_id():
    rid = "t" + os.urandom(3).hex()
    yield rid
    segments.sweep(f"erl_{rid}_")


def test_close_unlinks_segment_and_fifos():
    channel = ShmChannel({"x": np.zeros(8, np.float32)}, num_slots=2)
    names = [channel.info.segment, channel.info.fifo, channel.info.ready]
    assert all(n in segments.listing() for n in names)
    channel.close()
    assert not [n for n in names if n in segments.listing()]


@pytest.mark.parametrize("mode", ["exit", "kill-children"])
def test_an_exit_without_close_cleans_up(run_id, mode):
    """``exit``: a normal exit. ``kill-children``: Ray kills a worker's child processes as the worker exits, and
    the janitor must not be one of them (it was, and a Ctrl-C'd Ray run left its actor's weights segment)."""
    proc, names = _spawn_owner(mode, run_id)
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.wait(30) == 0
    assert _wait_gone(names) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["sigterm", "ctrl-c", "sigkill"])
def test_owner_killed_by_signal_leaves_nothing(run_id, sig):
    proc, names = _spawn_owner("wait", run_id)
    os.kill(proc.pid, sig)
    proc.wait(30)
    assert _wait_gone(names) == []


# A Ray worker's SIGTERM handler stops it by raising SystemExit (ray/_private/worker.py, main_loop). Its main thread
# waits in Ray's C++ task loop, so the first Python code it runs after the signal is often an object's __del__, where
# an exception is swallowed: the worker printed "Exception ignored in ... Traceback ... SystemExit" into the run's
# output and went on until Ray killed it.
_RAY_WORKER_IN_A_FINALIZER = textwrap.dedent("""
    import os, signal, time
    import numpy as np
    from ray._raylet import raise_sys_exit_with_custom_error_message
    from embodirl.channel import segments
    from embodirl.channel.shm_channel import ShmChannel

    def ray_workers_handler(signum, frame):   # the handler Ray's worker main loop installs
        raise_sys_exit_with_custom_error_message("The process receives a SIGTERM.", exit_code=1)

    signal.signal(signal.SIGTERM, ray_workers_handler)
    channel = ShmChannel({"images": np.zeros((4, 3, 32, 32), np.uint8)}, num_slots=2, tag="test")
    print(" ".join(segments.owned()), flush=True)

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):   # Python code after the signal: its handlers run here
                pass

    Finalized()
    time.sleep(20)
    print("still running", flush=True)
""")


def test_a_sigterm_inside_a_finalizer_still_stops_a_ray_worker_quietly(run_id):
    proc = subprocess.Popen([sys.executable, "-c", _RAY_WORKER_IN_A_FINALIZER], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, EMBODIRL_SHM_RUN=run_id), text=True)
    out, err = proc.communicate(timeout=60)
    names = (out.splitlines() or [""])[0].split()
    assert len(names) == 3, (out, err)
    assert proc.returncode == 1 and "still running" not in out, (out, err)   # Ray's exit code, at once
    assert "Exception ignored" not in err and "Traceback" not in err, err
    assert _wait_gone(names) == []


def test_sigkill_of_a_whole_process_group_leaves_nothing(run_id):
    # the run owner and everything in its process group die at once (what a terminal's kill -9 -PGID or
    # a container stop does); the janitors live in their own sessions and still clean up
    proc, names = _spawn_owner("wait", run_id, own_run=True, start_new_session=True)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert _wait_gone(names) == []
    assert segments.listing(f"erl_{run_id}_") == []


def test_sweep_removes_a_prefix_and_refuses_foreign_names(run_id):
    proc, names = _spawn_owner("wait", run_id)
    try:
        removed = segments.sweep(segments.process_prefix(proc.pid, run_id))
        assert sorted(removed) == sorted(names)
        assert segments.listing(f"erl_{run_id}_") == []
    finally:
        proc.kill()
        proc.wait(30)
    with pytest.raises(ValueError, match="refusing"):
        segments.sweep("psm_")


def test_forked_child_does_not_unlink_parent_segments():
    channel = ShmChannel({"x": np.zeros(8, np.float32)}, num_slots=1)
    try:
        pid = os.fork()
        if pid == 0:   # child: runs the exit-time cleanup, which must not touch the parent's ring
            try:
                segments._release_all()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert channel.info.segment in segments.listing()
    finally:
        channel.close()
