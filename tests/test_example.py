"""examples/train_pushcube_state.py, run as a newcomer runs it: a few steps on real ManiSkill simulators."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_pushcube_state.py"
STEP_LINE = re.compile(r"^step +(\d+) +return +(\S+) +success +(\S+) +pg_loss +(\S+) +value_loss +(\S+) +\S+ s$")


@pytest.mark.slow   # ~50 s on 2 busy cores, most of it starting the ManiSkill sub-processes
def test_example_trains_pushcube_for_two_steps():
    done = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "2", "--num-envs", "2", "--max-episode-steps", "8"],
                          capture_output=True, text=True, timeout=600, cwd=EXAMPLE.parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0].startswith("PushCube-v1: 2 envs"), done.stdout
    rows = [STEP_LINE.match(line) for line in done.stdout.splitlines()]
    rows = [[float(x) for x in m.groups()] for m in rows if m]
    assert [int(r[0]) for r in rows] == [1, 2], done.stdout
    for _, episode_return, success, pg_loss, value_loss in rows:
        assert all(math.isfinite(x) for x in (episode_return, pg_loss, value_loss)), done.stdout
        assert 0.0 <= success <= 1.0
        assert episode_return > 0.0       # PushCube's dense reward is positive at every step
        assert value_loss > 0.0           # the critic was trained on a non-trivial target
