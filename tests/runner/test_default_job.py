"""The default job learns: `embodirl train` with the default config (ManiSkill PushCube, state policy
with the state normaliser, joint-delta control, chunk-level PPO), cut to its first 40 training steps (64k
simulator steps) with the learning rate decaying as in the whole 100-step job, through the real CLI.

The test asserts the greedy evaluation success (50 episodes) before training is low and at step 40 clears a
bar the untrained policy never does. The bar is set from the seed sweep of docs/results/default-job.md (seeds 1-10 of the whole
job on this project's machine): at step 40 they scored 0.30 to 0.92 (median 0.68), the untrained policy 0.00.
RL on another CPU follows another trajectory from the same seed, so one seed here stands for a draw from that
distribution: the bar (0.2) sits below its worst seed, and a learner that does not learn stays near 0. Step 40,
not the job's 100: the suite's slowest tests are made cheaper rather than dropped (60 steps until 2026-11-28, 50
until 2026-12-07, when the suite took 40 minutes on CI's 2-core machine)."""

from __future__ import annotations

import math

import pytest

from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

STEPS = 40


@pytest.mark.slow
def test_default_job_learns_pushcube(tmp_path):
    proc = cli_runs.run(
        ["train", "runner.seed=1", f"runner.max_steps={STEPS}", "actor.optim.lr_decay_steps=100",
         f"runner.val_check_interval={STEPS}", "runner.val_before_train=true", "runner.save_interval=0",
         "runner.progress_bar=false", "runner.logger.tensorboard=false", "runner.eval_num_videos=1"],
        tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "outputs" / "maniskill_pushcube_state_mlp"
    records = read_metrics(out / "metrics.jsonl")
    evals = {r["step"]: r["eval/success_rate"] for r in records if "eval/success_rate" in r}
    print("eval success by step:", evals)
    assert sorted(evals) == [0, STEPS]
    assert evals[0] <= 0.15                                   # the untrained policy rarely pushes the cube home
    assert evals[STEPS] >= 0.2, evals
    # the recipe's model.init_log_std=-1.0 is the policy the run starts from: a Gaussian's entropy per action
    # dimension is 0.5 * ln(2 pi e) + log std (0.42 here, 0.92 at the model's default -0.5); one update barely moves it
    first = next(r for r in records if "actor/entropy" in r)
    assert abs(first["actor/entropy"] - (0.5 * math.log(2 * math.pi * math.e) - 1.0)) < 0.05, first["actor/entropy"]
    assert f"[eval step {STEPS}] success" in proc.stdout      # the curve is printed as the run goes
    assert list((out / "eval" / f"step_{STEPS}" / "videos").rglob("*.mp4"))
