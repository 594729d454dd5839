"""Demonstrations -> SFT -> RL on real ManiSkill PushCube from 64 px camera images, through the CLI: the results page's
"Result on this machine" chain with both training phases cut short. ``embodirl demos`` records 100 expert
episodes, ``embodirl sft`` fully fine-tunes the tiny OpenVLA-OFT for 150 steps on their action tokens (the results page's
300 until 2026-12-03: half the SFT's 275 CPU-s, and the checkpoints still clear every bar below), and ``embodirl
train`` runs 2 GRPO steps from that checkpoint with the results page's thirteenth-round RL settings (groups of 2 from
fixed initial states, rollout temperature 0.5, a moving average of the weights for evaluation, a learning rate
warmed up over 20 optimizer steps; 8 simulators), evaluating (greedy, the same 50 initial states with 5
simulators) before and after. Smaller than the results page's RL phase (16 simulators, 10 for evaluation): the
simulators' start-up was a third of it.

What it asserts holds for any draw of the SFT checkpoint: the SFT fits the demonstrations (action-token
accuracy over its last 20 steps >= 0.4, chance is 1/256); the checkpoint RL loads acts as the SFT left it
(greedy return per episode on the 50 initial states: mean >= 3.5, where the untrained tiny policy gets 1.63 and
at most 3.04 in any episode); RL trains the loaded policy (the greedy evaluation of an unchanged policy repeats
itself exactly, so some episode's return must differ after the updates); and those updates do not wreck it (no
fall of more than 15 points of success, mean return at least 0.7 of its start). Measured with these settings on
this project's 2-core AMD EPYC machine (2026-12-03), ``runner.seed`` 1/2/3 of the SFT: token accuracy
0.525/0.545/0.556, mean return 16.97/9.91/13.38, success 0.42/0.14/0.20 before RL and
0.42/0.18/0.24 after; with lr 1e-3 instead, seeds 1/2 gave returns 15.28/6.25. 300 SFT steps gave token
accuracy 0.58-0.62 and returns 5.9 and 13.7. Those demonstrations started from seeds 0-99, the evaluated states
among them; since 2026-12-06 they start from held-out training states (``embodirl demos``' default), and seed 1
gave success 0.24 and mean return 9.83 before RL, 0.26 and 11.50 after (the same machine, beside an RL run).
100 SFT steps instead (2026-12-07, the same machine, ``runner.seed`` 1-4, two at a time) fit as well (token accuracy
0.451/0.476/0.476/0.459) but act worse: mean return 9.19/10.74/5.30/3.24 before RL, seed 4 below the 3.5 bar, so the
SFT keeps its 150 steps.

The checkpoint's greedy *success* is printed, not asserted: it is a draw of the closed loop, not of the fit.
Until 2026-12-03 it had to reach 4 of 50 (0.38 in the results page's run, 0.26-0.30 on this project's machine, 0.18 on
issue 23's), and a change of summation order in the SFT loss alone (the same token accuracy to 0.001 over the
last 20 steps) took one checkpoint to 0.04 on this machine. The earlier RL settings (temperature 1, groups of 8,
the full rate of 2e-4 from the first optimizer step) moved the policy by an approximate KL of 0.08-0.13 per
update and failed the no-fall bar on a fresh machine of CI's kind (0.38 -> 0.18, 2026-12-01); from the same
checkpoint these settings moved it by 0.003 and kept 0.38. Whether GRPO *raises* the success in a few steps is
not asserted: from one checkpoint, 15 steps gave +0.34 (seed 1) and +0.04 (seed 2) on this machine, and +0.38
and +0.10 on two others; a draw that small is not a test. The results page reports the longer runs; that GRPO learns
at all is asserted where it is robust (``tests/runner/test_tiny_vla_learning.py``)."""

from __future__ import annotations

import json
import subprocess

import pytest

from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

DEMOS = ["env=maniskill_pushcube_rgb", "env.train.image_size=[64,64]"]   # demos has no env.eval
COMMON = [*DEMOS, "env.eval.image_size=[64,64]", "model=openvla_oft_tiny", "cluster.use_ray=false",
          "actor.fsdp.full_finetune=true", "runner.progress_bar=false", "runner.logger.tensorboard=false"]
SFT_STEPS = 150
SFT = ["sft.batch_size=32", "actor.optim.lr=5e-4", f"runner.max_steps={SFT_STEPS}", f"runner.save_interval={SFT_STEPS}",
       "runner.torch_threads=1",   # the suite's other worker shares the cores (on 2: 750 s beside it, 294 s alone)
       "runner.val_check_interval=0"]
RL_STEPS = 2   # 4 until 2026-11-28: what is asserted needs updates, not many of them
RL = ["algorithm=grpo", "algorithm.group_size=2", "env.train.use_fixed_reset_state_ids=true", "env.train.num_envs=8",
      "env.train.ignore_terminations=true", "env.eval.ignore_terminations=true", "rollout.rollout_epoch=2",
      "actor.optim.lr=2e-4", "actor.optim.warmup_steps=20", "actor.optim.lr_schedule=cosine",
      "actor.optim.lr_decay_steps=40", "rollout.temperature=0.5", "actor.ema_decay=0.9",
      f"runner.max_steps={RL_STEPS}", f"runner.val_check_interval={RL_STEPS}", "runner.val_before_train=true",
      "env.eval.num_envs=5", "runner.eval_num_videos=0", "runner.save_interval=0"]


def cli(args, cwd) -> subprocess.CompletedProcess:
    return cli_runs.run(args, cwd, timeout=1200, expect=0)


def _episodes(run, step) -> dict[int, tuple[bool, float]]:
    info = json.loads((run / "eval" / f"step_{step}" / "eval_info.json").read_text())
    return {e["init_state_id"]: (e["success"], e["return"]) for e in info["per_episode"]}


@pytest.mark.slow
def test_rl_trains_an_sft_checkpoint_through_the_cli(tmp_path):
    ds, sft, rl = tmp_path / "ds", tmp_path / "sft", tmp_path / "rl"
    cli(["demos", *DEMOS, "num_episodes=100", "progress_bar=false", f"output_dir={ds}"], tmp_path)
    cli(["sft", *COMMON, *SFT, f"data.path={ds}", f"runner.output_dir={sft}"], tmp_path)
    model = sft / "checkpoints" / f"step_{SFT_STEPS}" / "model"
    cli(["train", *COMMON, *RL, f"model.path={model}", f"runner.output_dir={rl}"], tmp_path)
    fit = [r["sft/token_accuracy"] for r in read_metrics(sft / "metrics.jsonl") if "sft/token_accuracy" in r]
    assert len(fit) == SFT_STEPS and sum(fit[-20:]) / 20 >= 0.4, f"the SFT did not fit the demonstrations: {fit[-20:]}"
    evals = {r["step"]: r["eval/success_rate"] for r in read_metrics(rl / "metrics.jsonl") if "eval/success_rate" in r}
    before, after = _episodes(rl, 0), _episodes(rl, RL_STEPS)
    returns = {step: sum(r for _, r in episodes.values()) / len(episodes) for step, episodes in ((0, before),
                                                                                                (RL_STEPS, after))}
    print("greedy success by RL step:", evals, "mean return:", returns)
    assert sorted(evals) == [0, RL_STEPS]
    assert sorted(before) == sorted(after) and len(before) == 50          # the same 50 initial states
    assert returns[0] >= 3.5, f"the loaded checkpoint acts like an untrained policy (mean return 1.63): {returns}"
    assert any(before[k][1] != after[k][1] for k in before), f"{RL_STEPS} GRPO steps left the greedy policy unchanged"
    assert evals[RL_STEPS] >= evals[0] - 0.15, f"{RL_STEPS} GRPO steps wrecked the SFT checkpoint: {evals}"
    assert returns[RL_STEPS] >= 0.7 * returns[0], f"{RL_STEPS} GRPO steps wrecked the SFT checkpoint: {returns}"
