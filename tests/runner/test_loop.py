"""The runner through the real CLI (subprocess) on the toy test task with the state policy."""

from __future__ import annotations

import json
import os

import imageio.v3 as iio
import pytest

from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

BASE = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.num_envs=4",
        "env.eval.num_envs=4", "runner.eval_episodes_per_task=1", "runner.progress_bar=false",
        "runner.logger.tensorboard=false"]


def cli(args, cwd):
    return cli_runs.run(args, cwd, expect=0)


def test_train_writes_outputs_and_eval_only(tmp_path):
    cli(["train", *BASE, "runner.max_steps=2", "runner.save_interval=2", "runner.val_check_interval=2",
         "runner.eval_num_videos=1", "runner.experiment_name=t"], tmp_path)
    out = tmp_path / "outputs" / "t"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if "train/success_rate" in r] == [1, 2]
    assert any("eval/success_rate" in r for r in records)
    for key in ("time/collect", "time/update", "time/publish_weights", "actor/pg_loss", "critic/value_loss", "env/steps_per_s"):
        assert key in records[0], key
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file()
    info = json.loads((out / "eval" / "step_2" / "eval_info.json").read_text())
    assert info["overall"]["n_episodes"] == 4 and len(info["per_task"]) == 4
    video = out / "eval" / "step_2" / info["overall"]["video_paths"][0]
    frames = iio.imread(video)
    assert frames.ndim == 4 and frames.shape[0] >= 2
    # evaluation only, from the run's checkpoint
    cli(["eval", *BASE, "runner.experiment_name=t_eval", f"runner.resume_dir={out}", "runner.eval_num_videos=0"],
        tmp_path)
    info = json.loads((tmp_path / "outputs" / "t_eval" / "eval_info.json").read_text())
    assert info["overall"]["n_episodes"] == 4
    assert (tmp_path / "outputs" / "t_eval" / "eval_success.png").is_file()


@pytest.mark.slow
def test_resume_reproduces_uninterrupted_metrics(tmp_path):
    common = [*BASE, "runner.save_interval=2", "runner.val_check_interval=0"]
    cli(["train", *common, "runner.max_steps=4", "runner.experiment_name=full"], tmp_path)
    cli(["train", *common, "runner.max_steps=2", "runner.experiment_name=part"], tmp_path)
    # as a checkpoint written before the learner ranks were called actor ranks: its actor state under learner/
    step_2 = tmp_path / "outputs" / "part" / "checkpoints" / "step_2"
    (step_2 / "actor").rename(step_2 / "learner")
    cli(["train", *common, "runner.max_steps=4", "runner.experiment_name=part"], tmp_path)   # resumes at step 2
    full = read_metrics(tmp_path / "outputs" / "full" / "metrics.jsonl")
    part = read_metrics(tmp_path / "outputs" / "part" / "metrics.jsonl")
    assert [r["step"] for r in part] == [1, 2, 3, 4]
    for a, b in zip(full, part):
        for key in ("train/return", "actor/pg_loss", "critic/value_loss", "actor/approx_kl", "actor/entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)


def test_a_long_step_says_where_it_is(tmp_path):
    """With progress lines due at once (EMBODIRL_PROGRESS_INTERVAL_S=0; 30 s by default) a step reports its
    rollouts, the decisions inside each and the update's optimizer steps while they run."""
    proc = cli_runs.run(["train", *BASE, "runner.max_steps=1", "rollout.rollout_epoch=2",
                         "runner.val_check_interval=0", "runner.save_interval=0"], tmp_path,
                        env={**os.environ, "EMBODIRL_PROGRESS_INTERVAL_S": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "[step 1] collecting rollout 2 of 2" in out
    assert "rollout: decision 1 of " in out and "episodes running" in out
    assert "update: optimizer step 1 of " in out
