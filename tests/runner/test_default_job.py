"""The README's default job learns, on two seeds: `embodirl train` with the default config (ManiSkill
PushCube, state policy with the state normaliser, chunk-level PPO), cut to its first 60 training steps
(96k simulator steps, ~2.5 minutes each on 2 quiet cores).

Each seed runs the real CLI and the test asserts the greedy evaluation success (50 episodes) before training
is low and at step 60 clears a bar the untrained policy never does. Measured on this project's machine:
0.00-0.10 before training; at step 60 0.76 (seed 1) and 0.82 (seed 2). Runs are deterministic on one
machine but not across machines, so the bar (0.5) leaves room."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from embodirl.runner.metrics_logger import read_metrics


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_default_job_learns_pushcube(tmp_path, seed):
    proc = subprocess.run(
        [sys.executable, "-m", "embodirl.cli", "train", f"runner.seed={seed}", "runner.max_steps=60",
         "runner.val_check_interval=60", "runner.val_before_train=true", "runner.save_interval=0",
         "runner.progress_bar=false", "runner.logger.tensorboard=false", "runner.eval_num_videos=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=1200, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "outputs" / "maniskill_pushcube_state_mlp"
    evals = {r["step"]: r["eval/success_rate"] for r in read_metrics(out / "metrics.jsonl") if "eval/success_rate" in r}
    print(f"seed {seed}: eval success by step:", evals)
    assert sorted(evals) == [0, 60]
    assert evals[0] <= 0.15                                   # the untrained policy rarely pushes the cube home
    assert evals[60] >= 0.5, evals
    assert "[eval step 60] success" in proc.stdout            # the curve is printed as the run goes
    assert list((out / "eval" / "step_60" / "videos").rglob("*.mp4"))
