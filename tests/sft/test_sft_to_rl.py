"""Demonstrations -> SFT -> RL on real ManiSkill PushCube from 64 px camera images, through the CLI: the README's
"Result on this machine" run cut short. ``embodirl demos`` records 100 expert episodes, ``embodirl sft``
fully fine-tunes the tiny OpenVLA-OFT for 300 steps on their action tokens, and ``embodirl train`` runs GRPO
from that checkpoint for 15 steps; the greedy evaluation (50 episodes) before and after the RL steps must show
the rise.

The README's run trained the SFT on one torch thread (0.38 after SFT, 0.48 after 15 GRPO steps, 0.64 after
30); here the SFT uses both cores (2.5 instead of 4.1 minutes), which sums in another order: 0.28 after SFT,
0.62 after 15 GRPO steps on this project's machine, 7.6 minutes in all. Runs are deterministic on one machine,
not across machines, so the threshold (+0.06) sits well below the measured rise."""

from __future__ import annotations

import subprocess
import sys

import pytest

from embodirl.runner.metrics_logger import read_metrics

DEMOS = ["env=maniskill_pushcube_rgb", "env.train.image_size=[64,64]"]   # demos has no env.eval
COMMON = [*DEMOS, "env.eval.image_size=[64,64]", "model=openvla_oft_tiny", "cluster.use_ray=false",
          "actor.fsdp.full_finetune=true", "runner.progress_bar=false", "runner.logger.tensorboard=false"]
SFT = ["sft.batch_size=32", "actor.optim.lr=5e-4", "runner.max_steps=300", "runner.save_interval=300",
       "runner.torch_threads=2",   # no simulator runs beside the SFT: both cores compute (2.5 vs 4.1 minutes)
       "runner.val_check_interval=0"]
RL = ["algorithm=grpo", "algorithm.group_size=8", "env.train.use_fixed_reset_state_ids=true", "env.train.num_envs=16",
      "env.train.ignore_terminations=true", "env.eval.ignore_terminations=true", "rollout.rollout_epoch=2",
      "actor.optim.lr=2e-4", "runner.max_steps=15", "runner.val_check_interval=15", "runner.val_before_train=true",
      "env.eval.num_envs=10", "runner.eval_num_videos=0", "runner.save_interval=0"]


def cli(args, cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "embodirl.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


@pytest.mark.slow
def test_grpo_raises_the_success_of_an_sft_checkpoint(tmp_path):
    ds, sft, rl = tmp_path / "ds", tmp_path / "sft", tmp_path / "rl"
    cli(["demos", *DEMOS, "num_episodes=100", "progress_bar=false", f"output_dir={ds}"], tmp_path)
    cli(["sft", *COMMON, *SFT, f"data.path={ds}", f"runner.output_dir={sft}"], tmp_path)
    model = sft / "checkpoints" / "step_300" / "model"
    cli(["train", *COMMON, *RL, f"model.path={model}", f"runner.output_dir={rl}"], tmp_path)
    evals = {r["step"]: r["eval/success_rate"] for r in read_metrics(rl / "metrics.jsonl") if "eval/success_rate" in r}
    print("greedy success by RL step:", evals)
    assert sorted(evals) == [0, 15]
    assert evals[0] >= 0.2, f"the SFT checkpoint should already push the cube home sometimes: {evals}"
    assert evals[15] >= evals[0] + 0.06, f"GRPO did not raise the SFT checkpoint's success: {evals}"
