"""``embodirl sft``'s configuration and data plumbing without a simulator: composition with config/sft.yaml, what
each sft key turns into, the checks, the statistics' mask and the step -> samples order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodirl.envs.base import EnvSpec
from embodirl.errors import ConfigError
from embodirl.sft import compose as sft_compose
from embodirl.sft.data import action_mask, batch_indices
from embodirl.sft.loop import unnorm_key

BASE = ["env=maniskill_pushcube_rgb", "model=openvla_oft_tiny", "data.path=/some/dataset"]
SPEC = EnvSpec(action_dim=4, max_episode_steps=16, task_descriptions=["push"], camera_names=["base_camera"],
               image_size=(56, 56), state_dim=5, name="PushCube-v1")


def test_composition_defaults_and_overrides():
    cfg = sft_compose.compose(BASE)
    assert cfg.data.path == "/some/dataset"
    assert cfg.runner.max_steps == 200 and cfg.runner.output_dir == f"outputs/sft/{cfg.runner.experiment_name}"
    assert sft_compose.check(cfg).sft.actor_options(tokens=True) == {"micro_batch_size": 8, "token_loss": True,
                                                                      "stop_token": True, "l1_head": False}
    assert sft_compose.check(cfg).sft.actor_options(tokens=False)["stop_token"] is False   # null: none for π0's flow
    assert unnorm_key(cfg, SPEC) == "PushCube-v1"          # the env's name, as the policy looks it up
    cfg = sft_compose.compose([*BASE, "runner.max_steps=5", "runner.output_dir=/tmp/x", "sft.batch_size=6",
                              "sft.micro_batch_size=2", "sft.stop_token=false", "model.unnorm_key=my_demos"])
    assert cfg.runner.max_steps == 5 and cfg.runner.output_dir == "/tmp/x"
    assert sft_compose.check(cfg).sft.actor_options(tokens=True) == {"micro_batch_size": 2, "token_loss": True,
                                                                      "stop_token": False, "l1_head": False}
    assert unnorm_key(cfg, SPEC) == "my_demos"


@pytest.mark.parametrize("overrides, key", [
    (["sft.micro_batch_size=16"], "sft.micro_batch_size"),
    (["sft.batch_size=0"], "sft.batch_size"),
    (["sft.l1_head=true"], "sft.l1_head"),
    (["sft.l1_head=true", "model.use_l1_regression=true"], "sft.l1_head"),   # the head must be trainable
    (["sft.stop_token=maybe"], "sft.stop_token"),
    (["sft.token_loss=maybe"], "sft.token_loss"),
    (["sft.micro_batch_size=0"], "sft.micro_batch_size"),
    (["sft.batch_size=eight"], "sft.batch_size"),
    (["actor.cpu_world_size=2"], "actor.cpu_world_size"),
    (["runner.max_steps=0"], "runner.max_steps"),
    (["runner.save_interval=-1"], "runner.save_interval"),
    (["actor.ema_decay=0.9"], "actor.ema_decay"),      # an RL-step average; SFT exports its trained weights
])
def test_checks_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as exc:
        sft_compose.check(sft_compose.compose([*BASE, *overrides]))
    assert exc.value.key == key


def test_binary_gripper_dimension_is_left_unnormalised():
    actions = np.array([[0.1, -1.0, 5.0, 0.0], [0.3, 1.0, 7.0, 0.0], [0.2, 1.0, 6.0, 0.0]])
    assert action_mask(actions).tolist() == [True, False, True, True]


def test_batches_are_a_function_of_the_step():
    seen = np.concatenate([batch_indices(10, 4, step, seed=3) for step in (1, 2, 3, 4, 5)])   # 2 epochs
    assert sorted(seen[:10].tolist()) == list(range(10)) and sorted(seen[10:20].tolist()) == list(range(10))
    assert not np.array_equal(seen[:10], seen[10:20])                       # a new order each epoch
    np.testing.assert_array_equal(batch_indices(10, 4, 3, seed=3), seen[8:12])
    assert not np.array_equal(batch_indices(10, 4, 1, seed=4), seen[:4])


def test_stop_token_adds_the_eos_label(compose_cfg):
    from embodirl.models.openvla_oft import build_policy

    torch.manual_seed(0)
    cfg = compose_cfg("model=openvla_oft_tiny", "model.action_chunk=2")
    policy = build_policy(dict(sft_compose.main_config(cfg).model) | {"lora": dict(cfg.model.lora)}, SPEC)
    obs = {"images": torch.randint(0, 255, (2, 1, 3, 56, 56), dtype=torch.uint8), "state": torch.zeros(2, 5),
           "instruction": ["push", "push"]}
    actions = torch.rand(2, 2, 4) * 2 - 1
    with torch.no_grad():
        plain = policy.supervised(obs, actions, stop_token=False)
        stop = policy.supervised(obs, actions, stop_token=True)
    assert float(plain["labels"]) == 16 and float(stop["labels"]) == 18
    assert float(stop["ce_sum"]) > float(plain["ce_sum"])
