"""The minutes a run prints (``time/elapsed_min``, the eval curve) count from the start of the command's
process, so start-up (interpreter, imports, config) is inside them, as the results pages' curves say."""

from __future__ import annotations

import os
import subprocess
import sys

from embodirl.runner.metrics_logger import read_metrics

DELAY_S = 12.0


def test_the_run_clock_starts_with_the_command_process(tmp_path):
    # the process sleeps before the command's entry point runs: those seconds are start-up the clock must hold
    code = f"import time; time.sleep({DELAY_S}); from embodirl.cli import main; main()"
    proc = subprocess.run(
        [sys.executable, "-c", code, "train", "env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true",
         "env.train.num_envs=2", "runner.max_steps=1", "runner.val_check_interval=0", "runner.save_interval=0",
         "runner.progress_bar=false", "runner.logger.tensorboard=false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "outputs" / "toy_reach_state_mlp" / "metrics.jsonl")
    assert rows[0]["step"] == 1
    assert rows[0]["time/elapsed_min"] * 60 >= DELAY_S, rows[0]["time/elapsed_min"]
