"""The π0 recipe is RLinf's: `env=libero_10 model=pi0` composes, value by value, what RLinf's LIBERO-10 π0 PPO run and
its π0 model use, read in RLinf's and openpi's own files (not their docs); the table below names the file and commit of
each value. `model=pi0_tiny` is the same network choices at CPU size."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from embodirl.config import compose, validate
from embodirl.rollout.records import decisions_per_episode

_RLINF = "RLinf/RLinf "
#: the files (and commits) the values come from
MODEL = _RLINF + "examples/embodiment/config/model/pi0.yaml @ 558aeb38"
PPO = _RLINF + "examples/embodiment/config/libero_10_ppo_openpi.yaml @ 558aeb38"
EPS = _RLINF + "examples/embodiment/config/libero_10_ppo_openpi.yaml @ 94656929 (fix: eps bug)"
MANISKILL = _RLINF + "examples/embodiment/config/maniskill_ppo_openpi.yaml @ 558aeb38"
ACTION_MODEL = _RLINF + "rlinf/models/embodiment/openpi/openpi_action_model.py @ 558aeb38"
LOSSES = _RLINF + "rlinf/algorithms/losses.py @ 558aeb38"
OPENPI = "Physical-Intelligence/openpi src/openpi/models/pi0_config.py @ 15a9616a"

#: embodirl key: (value, the key or code it comes from, its file @ commit)
RLINF_PI0 = {
    # the network and what RL adds to it
    "model.flow.num_steps": (4, "num_steps: 4", MODEL),
    "model.action_chunk": (10, "num_action_chunks: 10", MODEL),
    "model.chunk_size": (50, "Pi0Config.action_horizon (RLinf's OpenPi0Config extends it)", OPENPI),
    "model.max_prompt_tokens": (48, "Pi0Config.max_token_len for π0", OPENPI),
    "model.flow.method": ("flow_sde", "openpi.noise_method: flow_sde", MODEL),
    "model.flow.noise_level": (0.5, "openpi.noise_level: 0.5", MODEL),
    "model.flow.noise_std_range": ([0.08, 0.16], "OpenPi0Config.noise_logvar_range [min_std, max_std]", ACTION_MODEL),
    "model.flow.noise_head_hidden_sizes": ([128, 64], "ExploreNoiseNet(hidden_dims=[128, 64])", ACTION_MODEL),
    "model.flow.joint_logprob": (True, "openpi.joint_logprob: True # False for flow_sde, True for flow_noise",
                                 MANISKILL),
    "model.train_expert": (True, "openpi.train_expert_only: True", MODEL),
    "model.lora.enabled": (False, "is_lora: False", MODEL),
    "model.lora.rank": (32, "lora_rank: 32", MODEL),
    "model.value_type": ("chunk_level", "add_value_head: True; reward_type: chunk_level", PPO),
    "model.value_head.features": ("expert", "OpenPi0Config.value_after_vlm: False (suffix_out mean)", ACTION_MODEL),
    "model.value_head.detach": (True, "actor.model.openpi.detach_critic_input: True", PPO),
    "model.value_head.hidden_sizes": ([512, 256, 128], "value_head_hidden_sizes = (512, 256, 128)", ACTION_MODEL),
    # the algorithm
    "algorithm.adv_type": ("gae", "adv_type: gae", PPO),
    "algorithm.update_epochs": (4, "update_epoch: 4", PPO),
    "algorithm.group_size": (1, "group_size: 1", PPO),
    "algorithm.logprob_type": ("chunk", "logprob_type: chunk_level", PPO),
    "algorithm.reward_type": ("chunk_level", "reward_type: chunk_level", PPO),
    "algorithm.normalize_advantages": (True, "normalize_advantages: True", PPO),
    "algorithm.gamma": (0.99, "gamma: 0.99", PPO),
    "algorithm.gae_lambda": (0.95, "gae_lambda: 0.95", PPO),
    "algorithm.clip_ratio_low": (0.2, "clip_ratio_low: 0.2", PPO),
    "algorithm.clip_ratio_high": (0.2, "clip_ratio_high: 0.2", PPO),
    "algorithm.clip_ratio_c": (3.0, "clip_ratio_c: 3.0", PPO),
    "algorithm.loss_agg_func": ("token-mean", "loss_agg_func: token-mean", PPO),
    "algorithm.value_clip": (0.2, "value_clip: 0.2", PPO),
    "algorithm.huber_delta": (10.0, "huber_delta: 10.0", PPO),
    "algorithm.value_coef": (1.0, "compute_ppo_actor_critic_loss: loss = actor_loss + critic_loss", LOSSES),
    "algorithm.kl_beta": (0.0, "kl_beta: 0.0", PPO),
    "algorithm.entropy_bonus": (0.0, "entropy_bonus: 0", PPO),
    # the rollout and the optimizer
    "env.train.num_envs": (64, "env.train.total_num_envs: 64", PPO),
    "env.train.max_episode_steps": (480, "env.train.max_episode_steps: 480", PPO),
    "rollout.rollout_epoch": (8, "algorithm.rollout_epoch: 8", PPO),
    "actor.fsdp.gradient_checkpointing": (False, "fsdp_config.gradient_checkpointing: False", PPO),
    "actor.optim.lr": (5.0e-6, "optim.lr: 5.0e-6", PPO),
    "actor.optim.value_lr": (1.0e-4, "optim.value_lr: 1.0e-4", PPO),
    "actor.optim.clip_grad": (2.0, "optim.clip_grad: 2.0", PPO),
    "actor.optim.weight_decay": (0.01, "optim.weight_decay: 0.01", PPO),
    "actor.optim.betas": ([0.9, 0.95], "optim.adam_beta1: 0.9, adam_beta2: 0.95", PPO),
    "actor.optim.eps": (1.0e-8, "optim.adam_eps: 1.0e-08", EPS),
}
#: RLinf's actor.global_batch_size: chunk-level samples (decisions) per optimizer step
RLINF_GLOBAL_BATCH_DECISIONS = 2048


def _leaf(cfg, key: str):
    value = OmegaConf.select(cfg, key, throw_on_missing=True)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


@pytest.fixture(scope="module")
def recipe():
    return compose(["env=libero_10", "model=pi0"])


@pytest.mark.parametrize("key", list(RLINF_PI0))
def test_the_pi0_recipe_has_rlinfs_value(recipe, key):
    value, rlinf_key, source = RLINF_PI0[key]
    found = _leaf(recipe, key)
    assert found == value and type(found) is type(value), f"{key} = {found!r}; RLinf's {rlinf_key} ({source})"


def test_the_recipe_validates_and_its_batch_is_rlinfs_in_trajectories(recipe):
    """RLinf's 2048-decision optimizer step in embodirl's unit (trajectories of 480 / 10 = 48 decisions): the nearest
    count that divides the 64 x 8 trajectories a step collects."""
    validate(recipe, check_envs=False, num_devices=8, accelerator="gpu")
    T = decisions_per_episode(recipe)
    rollout = recipe.env.train.num_envs * recipe.rollout.rollout_epoch
    assert T == 48 and rollout == 512
    divisors = [n for n in range(1, rollout + 1) if rollout % n == 0]
    nearest = min(divisors, key=lambda n: abs(n * T - RLINF_GLOBAL_BATCH_DECISIONS) / n)
    assert recipe.actor.global_batch_size == nearest == 32
    assert recipe.actor.micro_batch_size == 1


def test_the_tiny_preset_makes_the_same_choices_at_cpu_size(recipe):
    """`model=pi0_tiny` keeps the recipe's network choices (what trains, the critic, the flow's log-probabilities);
    only its sizes differ."""
    tiny = compose(["model=pi0_tiny"]).model
    for key in ("train_expert", "lora.enabled", "value_head.features", "value_head.detach", "flow.method",
                "flow.num_steps", "flow.noise_level", "flow.noise_std_range", "flow.joint_logprob"):
        assert _leaf(tiny, key) == _leaf(recipe.model, key), key
