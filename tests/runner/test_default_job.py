"""The README's default job learns: `embodirl train` with the default config (ManiSkill PushCube,
state policy, chunk-level PPO), cut to its first 100 training steps (160k simulator steps).

The full job (400 steps, ~15 minutes on 2 cores) is what the README's curve shows; this test runs the
same configuration through the real CLI and asserts the greedy evaluation success of step 100 (50
episodes) clears a bar the untrained policy does not (measured: 0.00-0.10 before training; 0.60 at step
100 with the default seed, the value of the README's run)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from embodirl.runner.metrics_logger import read_metrics


@pytest.mark.slow
def test_default_job_learns_pushcube(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "embodirl.cli", "train", "runner.max_steps=100", "runner.val_check_interval=50",
         "runner.val_before_train=true", "runner.save_interval=0", "runner.progress_bar=false",
         "runner.logger.tensorboard=false", "runner.eval_num_videos=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=1500, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "outputs" / "maniskill_pushcube_state_mlp"
    evals = {r["step"]: r["eval/success_rate"] for r in read_metrics(out / "metrics.jsonl") if "eval/success_rate" in r}
    print("eval success by step:", evals)
    assert sorted(evals) == [0, 50, 100]
    assert evals[0] <= 0.15                                   # the untrained policy rarely pushes the cube home
    assert evals[100] >= 0.35, evals
    assert "[eval step 100] success" in proc.stdout           # the curve is printed as the run goes
    assert list((out / "eval" / "step_100" / "videos").rglob("*.mp4"))
