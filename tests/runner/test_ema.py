"""``actor.ema_decay``: evaluation acts with an exponential moving average of the trained weights, and nothing else
changes. Through the CLI on the toy task with the state policy: the training steps of a run with the average are
those of the run without it, its evaluations are not, a checkpoint's policy export holds the average (``embodirl
eval`` of it repeats the training-time evaluation), and a resumed run carries the average on. The average itself:
``tests/actor/test_ema.py``."""

from __future__ import annotations

import json
import subprocess

import pytest

from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

# dense rewards: an episode's return traces its whole trajectory, so equal returns mean equal episodes
TOY = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.cameras=[]",
       "env.eval.cameras=[]", "env.train.num_envs=8", "env.eval.num_envs=8", "env.train.reward_mode=dense",
       "env.eval.reward_mode=dense", "runner.eval_episodes_per_task=4", "runner.eval_num_videos=0",
       "runner.progress_bar=false", "runner.logger.tensorboard=false", "actor.optim.lr=3e-3",
       "runner.val_check_interval=3", "runner.save_interval=3"]
COMPARED = ("train/return", "actor/pg_loss", "critic/value_loss", "actor/approx_kl", "actor/entropy", "actor/grad_norm")
EMA = "actor.ema_decay=0.8"


def cli(cmd: str, args, cwd) -> subprocess.CompletedProcess:
    return cli_runs.run([cmd, *TOY, *args], cwd, expect=0)


def episode_returns(path) -> list[float]:
    return [e["return"] for e in json.loads(path.read_text())["per_episode"]]


def test_evaluation_acts_with_the_average_and_training_is_unchanged(tmp_path):
    plain, ema, resumed = tmp_path / "plain", tmp_path / "ema", tmp_path / "resumed"
    cli("train", ["runner.max_steps=6", f"runner.output_dir={plain}"], tmp_path)
    cli("train", ["runner.max_steps=6", EMA, f"runner.output_dir={ema}"], tmp_path)
    a, b = read_metrics(plain / "metrics.jsonl"), read_metrics(ema / "metrics.jsonl")
    train_a, train_b = ([r for r in m if "train/return" in r] for m in (a, b))
    assert [r["step"] for r in train_b] == list(range(1, 7))
    for x, y in zip(train_a, train_b):       # the same process on the same machine: the same numbers
        for key in COMPARED:
            assert x[key] == y[key], (x["step"], key)
    for step in (3, 6):   # ... while evaluation acted with other weights
        assert episode_returns(plain / "eval" / f"step_{step}" / "eval_info.json") != \
            episode_returns(ema / "eval" / f"step_{step}" / "eval_info.json")

    # the checkpoint's policy export is the average: evaluating it repeats the training-time evaluation
    out = tmp_path / "eval_step3"
    cli("eval", [EMA, f"runner.resume_dir={ema / 'checkpoints' / 'step_3'}", f"runner.output_dir={out}"], tmp_path)
    assert episode_returns(out / "eval_info.json") == pytest.approx(
        episode_returns(ema / "eval" / "step_3" / "eval_info.json"), rel=1e-6, abs=1e-9)

    # a run resumed from step 3 carries the average on: its step-6 evaluation is the uninterrupted run's
    cli("train", ["runner.max_steps=6", EMA, f"runner.resume_dir={ema / 'checkpoints' / 'step_3'}",
                  f"runner.output_dir={resumed}"], tmp_path)
    assert episode_returns(resumed / "eval" / "step_6" / "eval_info.json") == pytest.approx(
        episode_returns(ema / "eval" / "step_6" / "eval_info.json"), rel=1e-6, abs=1e-9)

