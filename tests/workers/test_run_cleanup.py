"""A whole run (driver + Ray env and inference workers with shared-memory rings) killed mid-rollout with
SIGKILL or Ctrl-C leaves no entry of its run in /dev/shm.

After the driver dies, the driver's janitor sweeps at once, but a worker keeps its segments until Ray ends it
(its raylet notices the dead driver) and the worker's own janitor runs; on two loaded cores that took over 30 s
once, so the deadline says "eventually, within two minutes", not how fast."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from embodirl.channel import segments

START_TIMEOUT_S = 300.0
CLEANUP_DEADLINE_S = 120.0

_DRIVER = textwrap.dedent("""
    from embodirl.config import compose
    from embodirl.workers.groups import WorkerGroups

    if __name__ == "__main__":
        cfg = compose(["env=toy_reach", "model=state_mlp", "env.train.state_obs=true", "env.train.num_envs=4",
                       "actor.global_batch_size=4", "env_workers.num_workers=2",
                       "env.train.max_episode_steps=100000"])
        groups = WorkerGroups.from_config(cfg, remote=True)
        print("ready", flush=True)
        while True:
            groups.collect()
""")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL], ids=["sigkill"])
def test_killed_run_leaves_nothing_in_dev_shm(sig, tmp_path):
    run = "k" + os.urandom(3).hex()
    prefix = segments.run_prefix(run)
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    env = dict(os.environ, EMBODIRL_SHM_RUN=run)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    family: list[int] = []
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(segments.listing(prefix)) < 6 and time.monotonic() < deadline:   # 2 rings, 2 FIFOs each
            time.sleep(0.05)
        assert len(segments.listing(prefix)) >= 6, "the env workers' rings never appeared"
        family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(proc.pid, sig)
        proc.wait(60)
        deadline = time.monotonic() + CLEANUP_DEADLINE_S
        while segments.listing(prefix) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert segments.listing(prefix) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in family:   # the killed driver's private Ray daemons
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        segments.sweep(prefix)
