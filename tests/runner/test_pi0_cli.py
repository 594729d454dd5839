"""π0 through the CLI (embodirl/models/pi0/): ``embodirl train env=maniskill_pushcube_rgb model=pi0_tiny`` (64 px
camera images, the real simulator) with each flow log-probability and each algorithm, in this process and on Ray
workers with two gloo FSDP2 actor ranks; the first minibatch's importance ratio is 1; ``embodirl eval`` of the run's
checkpoint reproduces the run's own last evaluation. Episodes are cut to 16 steps: what is checked is the path,
not learning (tests/runner/test_pi0_tiny_learning.py, docs/results/pi0-pushcube.md)."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
from test_vla_cli import cli

from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

PI0 = ["env=maniskill_pushcube_rgb", "env.train.image_size=[64,64]", "env.eval.image_size=[64,64]", "model=pi0_tiny",
       "env.train.num_envs=4", "env.eval.num_envs=2", "env.train.max_episode_steps=16", "env.eval.max_episode_steps=16",
       "runner.eval_episodes_per_task=4", "runner.eval_num_videos=0", "runner.progress_bar=false",
       "runner.logger.tensorboard=false", "runner.max_steps=2", "runner.save_interval=2", "runner.val_check_interval=2"]
ALGORITHMS = {"grpo": ["algorithm=grpo", "algorithm.group_size=2", "env.train.use_fixed_reset_state_ids=true"],
              "ppo": ["algorithm=ppo"]}
#: one decision scored by the rollout and by the actor in one process: the same float32 operations
RATIO_ERROR_IN_PROCESS = 1e-6
#: across processes (a Ray inference worker, two FSDP2 ranks that gather their shards): float32 rounding of another
#: summation order, for log-probs of ~100 elements
RATIO_ERROR_ACROSS = 1e-4


def _eval_info(folder) -> dict:
    return json.loads((folder / "eval_info.json").read_text())


@pytest.mark.parametrize("algorithm,method", [("grpo", "flow_sde"), ("ppo", "flow_noise")])
def test_pi0_trains_and_its_checkpoint_evaluates_the_same(tmp_path, algorithm, method):
    run = os.urandom(3).hex()
    cli(["train", *PI0, *ALGORITHMS[algorithm], f"model.flow.method={method}", "cluster.use_ray=false",
         "runner.experiment_name=train"], tmp_path, f"t{run}")
    records = read_metrics(tmp_path / "outputs" / "train" / "metrics.jsonl")
    steps = [r for r in records if "actor/first_step_ratio_error" in r]
    assert len(steps) == 2
    assert all(r["actor/first_step_ratio_error"] <= RATIO_ERROR_IN_PROCESS for r in steps), steps
    assert all(r["actor/approx_kl"] >= 0 for r in steps)
    if algorithm == "ppo":
        assert all("critic/value_loss" in r for r in steps)
    evals = [r for r in records if "eval/success_rate" in r]
    checkpoint = tmp_path / "outputs" / "train" / "checkpoints" / "step_2"
    assert (checkpoint / "policy" / "trainable.safetensors").is_file()
    cli(["eval", *PI0, *ALGORITHMS[algorithm], f"model.flow.method={method}", "cluster.use_ray=false",
         f"runner.resume_dir={checkpoint}", "runner.experiment_name=eval"], tmp_path, f"e{run}")
    during, after = _eval_info(tmp_path / "outputs" / "train" / "eval" / "step_2"), _eval_info(tmp_path / "outputs" / "eval")
    assert after["overall"]["success_rate"] == evals[-1]["eval/success_rate"]
    # the same deterministic episodes: PushCube's dense reward shows any difference in the actions in the returns
    assert len(after["per_episode"]) == 4
    assert [e["return"] for e in after["per_episode"]] == [e["return"] for e in during["per_episode"]]


@pytest.mark.slow
def test_pi0_on_ray_workers_trains_on_two_gloo_actor_ranks_as_on_one(tmp_path):
    """The Ray path with one and with two FSDP2 actor ranks: the same first update (the VLM layers, whose keys and
    values reach the expert through the cache, get their gradients reduced over the ranks like every other unit)."""
    run = os.urandom(3).hex()
    runs = {}
    for ranks in (1, 2):
        name = f"ray{ranks}"
        cli(["train", *PI0, *ALGORITHMS["ppo"], "model.flow.method=flow_sde", "cluster.use_ray=true",
             f"actor.cpu_world_size={ranks}", "actor.global_batch_size=4", "actor.micro_batch_size=1",
             "runner.val_check_interval=0", "runner.save_interval=0", f"runner.experiment_name={name}"], tmp_path,
            f"{name}{run}")
        runs[ranks] = [r for r in read_metrics(tmp_path / "outputs" / name / "metrics.jsonl") if "actor/world_size" in r]
    assert [r["actor/world_size"] for r in runs[2]] == [2.0, 2.0]         # runner.max_steps=2
    for records in runs.values():
        assert all(r["actor/first_step_ratio_error"] <= RATIO_ERROR_ACROSS for r in records), records
    first = {ranks: records[0] for ranks, records in runs.items()}
    assert first[1]["actor/grad_norm"] > 0
    for key in ("train/return", "actor/pg_loss", "critic/value_loss", "actor/grad_norm", "actor/approx_kl"):
        assert math.isclose(first[1][key], first[2][key], rel_tol=1e-4, abs_tol=1e-6), (key, first[1][key], first[2][key])


def _cli(args, cwd) -> subprocess.CompletedProcess:
    return cli_runs.run(args, cwd, timeout=300)


def test_a_bad_pi0_checkpoint_is_one_sentence_and_doctor_describes_a_good_one(compose_cfg, tmp_path):
    """``model.path`` handed to eval: a garbage weight file, a config.json that is not JSON, another model's config -
    each exits 2 with one sentence naming the file before anything starts; doctor checks a good checkpoint."""
    import torch

    from embodirl.envs.base import EnvSpec
    from embodirl.models.registry import make_policy

    spec = EnvSpec(action_dim=7, max_episode_steps=16, task_descriptions=["reach"], camera_names=["main"],
                   image_size=(64, 64), name="toy")
    torch.manual_seed(0)
    good = make_policy(compose_cfg("model=pi0_tiny").model, spec).save_pretrained(tmp_path / "good")
    work = tmp_path / "work"
    work.mkdir()
    proc = _cli(["doctor", "model=pi0_tiny", "env=toy_reach", f"model.path={good}"], work)
    line = next(line for line in proc.stdout.splitlines() if "checkpoint" in line)
    assert "π0, 1 weight file(s), chunk 8 x 8" in line and "value/noise heads" in line, proc.stdout
    cases = {"model.safetensors": (b"\xff" * 64, "is not a safetensors file"),
             "config.json": (b"{not json", "is not JSON"),
             "config.json ": (json.dumps({"model_type": "llama"}).encode(), "describes a 'llama' model")}
    for name, (content, fragment) in cases.items():
        bad = tmp_path / f"bad_{len(content)}"
        subprocess.run(["cp", "-r", str(good), str(bad)], check=True)
        (bad / name.strip()).write_bytes(content)
        proc = _cli(["eval", "model=pi0_tiny", "env=toy_reach", f"model.path={bad}"], work)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert lines[0].startswith("embodirl: model.path:") and fragment in lines[0], lines[0]
        assert list(work.iterdir()) == []
