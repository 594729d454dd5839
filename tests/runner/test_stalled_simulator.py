"""A simulator process that stops answering (a hang, not a crash) is killed after ``env.step_timeout_s``,
replaced, and its episode collected again: a real training run through the CLI with a toy simulator process
that hangs on purpose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from embodirl.config import compose, validate
from embodirl.errors import ConfigError
from embodirl.runner.metrics_logger import read_metrics

TOY = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.num_envs=4",
       "env.eval.num_envs=4", "runner.progress_bar=false", "runner.logger.tensorboard=false",
       "runner.val_check_interval=0", "runner.save_interval=0"]


def test_a_hung_simulator_is_replaced_and_its_episode_collected_again(tmp_path):
    marker = tmp_path / "hung"
    proc = subprocess.run([sys.executable, "-m", "embodirl.cli", "train", *TOY, "runner.max_steps=2",
                           "env.train.processes=true", "env.train.hang_at_step=2", f"env.train.hang_marker={marker}",
                           "env.train.step_timeout_s=3", "runner.experiment_name=hang"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.is_file()                                     # one simulator did hang
    records = read_metrics(tmp_path / "outputs" / "hang" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert sum(r["train/dropped_episodes"] for r in records) >= 1   # its episode was collected again
    assert all(r["train/episodes"] >= 4 for r in records)


@pytest.mark.parametrize("override, key", [
    ("env.train.step_timeout_s=0", "env.train.step_timeout_s"),
    ("env.eval.step_timeout_s=-1", "env.eval.step_timeout_s"),
    ("env.train.hang_at_step=2", "env.hang_at_step"),            # no marker, no processes
])
def test_timeout_and_hang_settings_are_checked(override, key):
    with pytest.raises(ConfigError) as exc:
        validate(compose([*TOY, override]))
    assert key in str(exc.value) and "\n" not in str(exc.value)
