"""Checkpoints configure the model: OFT's heads and image count come from the checkpoint's files, contradicting
settings and RL over untrained action tokens are refused in one sentence before anything starts, and
``embodirl eval model.path=<dir>`` runs a public L1 + proprio checkpoint with no extra flags."""

from __future__ import annotations

import json

import pytest
import torch

from embodirl.config import compose, validate
from embodirl.errors import ConfigError
from embodirl.models.base import SamplingParams
from embodirl.models.openvla_oft import build_policy
from tests import cli_runs
from tests.models.test_openvla_checkpoint import (
    SPEC,
    STATS,
    copy_of,
    direct_model,
    observation,
    oft_action_head_file,
    one_sentence,
    tiny,
    write_public_checkpoint,
)

TINY_LIBERO = ["env=libero_10", "model=openvla_oft_tiny", "env.train.image_size=[64,64]",
               "env.eval.image_size=[64,64]"]


@pytest.fixture(scope="module")
def l1_checkpoint(tmp_path_factory):
    """OFT's LIBERO layout: weights, statistics, proprio projector and L1 action head (random weights)."""
    model = direct_model(seed=3)
    path = write_public_checkpoint(tmp_path_factory.mktemp("oft") / "l1", model)
    head = oft_action_head_file(path, model.cfg.llm_dim, 7)
    return model, path, head


def test_l1_and_proprio_come_from_the_files(l1_checkpoint):
    model, path, head = l1_checkpoint
    policy = build_policy(tiny(path=str(path)), SPEC)          # no use_l1_regression / use_proprio given
    assert policy.cfg.use_l1_regression and policy.cfg.use_proprio and policy.cfg.num_images_in_input == 2
    loaded = policy.core.action_head.state_dict()
    assert all(torch.equal(loaded[k], head[k]) for k in head)
    state = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(policy.core.proprio_projector(state), model.proprio_projector(state))
    # the greedy chunk is the head's regression, not decoded tokens: changing the head changes the chunk
    obs = observation()
    chunk = policy.act(obs, SamplingParams(greedy=True))["action_chunk"]
    with torch.no_grad():
        policy.core.action_head.model.fc2.bias.add_(0.1)
    assert not torch.equal(policy.act(obs, SamplingParams(greedy=True))["action_chunk"], chunk)


def test_token_checkpoint_without_heads_is_one_image_no_proprio(l1_checkpoint, tmp_path):
    _, path, _ = l1_checkpoint
    tokens = copy_of(path, tmp_path, "tokens")
    for name in ("action_head--100_checkpoint.pt", "proprio_projector--100_checkpoint.pt"):
        (tokens / name).unlink()
    policy = build_policy(tiny(path=str(tokens)), SPEC)
    assert (policy.cfg.use_l1_regression, policy.cfg.use_proprio, policy.cfg.num_images_in_input) == (False, False, 1)
    # an image count written in config.json wins, and an explicit setting must agree with it
    config = json.loads((tokens / "config.json").read_text())
    (tokens / "config.json").write_text(json.dumps({**config, "num_images_in_input": 2}))
    assert build_policy(tiny(path=str(tokens)), SPEC).cfg.num_images_in_input == 2
    with pytest.raises(ConfigError) as exc:
        build_policy(tiny(path=str(tokens), num_images_in_input=1), SPEC)
    assert exc.value.key == "model.num_images_in_input" and "config.json" in one_sentence(exc)


@pytest.mark.parametrize("setting, key, fragment", [
    ("use_l1_regression=false", "model.use_l1_regression", "action_head--100_checkpoint.pt"),
    ("use_proprio=false", "model.use_proprio", "proprio_projector--100_checkpoint.pt"),
    ("unnorm_key=bridge_orig", "model.unnorm_key", "dataset_statistics.json"),
])
def test_contradicting_setting_is_one_sentence_before_workers(l1_checkpoint, setting, key, fragment):
    _, path, _ = l1_checkpoint
    cfg = compose([*TINY_LIBERO, f"model.path={path}", f"model.{setting}", "runner.only_eval=true"])
    with pytest.raises(ConfigError) as exc:
        validate(cfg, num_devices=2, accelerator="cpu")
    assert exc.value.key == key and fragment in one_sentence(exc), str(exc.value)


def test_unknown_suite_statistics_are_named(l1_checkpoint, tmp_path):
    _, path, _ = l1_checkpoint
    cfg = compose(["env=libero_spatial", "model=openvla_oft_tiny", f"model.path={path}", "runner.only_eval=true"])
    with pytest.raises(ConfigError) as exc:
        validate(cfg, num_devices=2, accelerator="cpu")
    message = one_sentence(exc)
    assert exc.value.key == "model.unnorm_key" and "libero_spatial" in message
    assert all(key in message for key in STATS)


@pytest.mark.parametrize("override", [["model.use_l1_regression=false"], []])
def test_token_rl_from_an_l1_checkpoint_is_refused(l1_checkpoint, override):
    _, path, _ = l1_checkpoint
    cfg = compose([*TINY_LIBERO, f"model.path={path}", *override, "algorithm=grpo",
                   "env.train.use_fixed_reset_state_ids=true", "algorithm.group_size=2", "env.train.num_envs=2",
                   "actor.global_batch_size=2"])
    with pytest.raises(ConfigError) as exc:
        validate(cfg, num_devices=2, accelerator="cpu")
    message = one_sentence(exc)
    assert "action tokens were never trained" in message and "embodirl eval" in message, message
    assert exc.value.key == ("model.use_l1_regression" if override else "model.path")
    # evaluation of the same directory passes the checks
    validate(compose([*TINY_LIBERO, f"model.path={path}", "runner.only_eval=true"]), num_devices=2, accelerator="cpu")


def test_refusal_through_the_cli_writes_nothing(l1_checkpoint, tmp_path):
    _, path, _ = l1_checkpoint
    proc = cli_runs.run(["train", "env=libero_10", "model=openvla_oft", f"model.path={path}",
                         "model.use_l1_regression=false", "algorithm=grpo"], tmp_path, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "model.use_l1_regression" in lines[0] and "never trained" in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cli_eval_runs_a_public_l1_proprio_checkpoint_without_flags(l1_checkpoint, tmp_path):
    """docs/evaluation.md's evaluation command on a checkpoint in OFT's layout: real LIBERO, one short episode."""
    _, path, _ = l1_checkpoint
    proc = cli_runs.run(
        ["eval", *TINY_LIBERO, f"model.path={path}", "cluster.use_ray=false", "env.eval.task_ids=[0]",
         "env.eval.num_envs=1", "runner.eval_episodes_per_task=1", "env.eval.max_episode_steps=16",
         "runner.eval_num_videos=0", "runner.progress_bar=false", "runner.logger.tensorboard=false",
         "runner.experiment_name=oft_l1"], tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "L1 regression head, proprio token, 2 image(s) per decision" in output, output[-4000:]
    info = json.loads((tmp_path / "outputs" / "oft_l1" / "eval_info.json").read_text())
    assert info["overall"]["n_episodes"] == 1
