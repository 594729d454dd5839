"""Numerics that must hold through the actor: k3 at extreme log-ratios, optimizer steps with nothing
to learn from, and rollout temperature 0 (greedy) through the policies' act/sampling path."""

from __future__ import annotations

import math

import pytest
import torch

from embodirl import data as D
from embodirl.actor.actor import Actor
from embodirl.algorithms import kl
from embodirl.models.base import SamplingParams
from embodirl.models.state_policy import StateMLPPolicy

from .helpers import TASKS, TinyTokenPolicy, actor_cfg, grpo, ppo, token_batch


def test_low_var_kl_gradient_is_finite_at_log_ratio_minus_100():
    logprob = torch.full((2, 3), -101.0, requires_grad=True)
    ref = torch.full((2, 3), -1.0)
    value = kl.kl_divergence(logprob, ref, "low_var_kl")
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(logprob.grad).all()


def test_kl_loss_at_extreme_log_ratio_still_updates_the_policy():
    """KL loss with logp - logp_ref = -100 on every token: the step is applied with a finite gradient
    (before the clamp, exp(100) overflowed, the gradient was NaN and the whole step was skipped)."""
    policy = TinyTokenPolicy()
    before = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    batch = token_batch(policy=policy)
    batch.set(D.LOGPROB_REF, batch.get(D.LOGPROB_BEHAVIOR) + 100.0)
    actor = Actor(policy, actor_cfg(ppo(kl_beta=0.1, use_kl_loss=True, kl_penalty="low_var_kl",
                                              update_epochs=1)), task_table=TASKS)
    metrics = actor.step(batch)
    assert math.isfinite(float(metrics["actor/grad_norm"]))
    assert actor.optimizer_steps == 1
    assert any(not torch.equal(p, before[n]) for n, p in policy.named_parameters() if p.requires_grad)


def test_optimizer_step_without_valid_decisions_is_skipped():
    """After a real step (Adam has momentum, weight decay is on), a step whose every group is filtered
    leaves the weights and the optimizer untouched."""
    policy = TinyTokenPolicy()
    cfg = actor_cfg(grpo(**{"filter_groups.enable": True, "filter_groups.min_success": 0.0,
                                "filter_groups.max_success": 1.0}),
                      {"optim.weight_decay": 0.1})
    actor = Actor(policy, cfg, task_table=TASKS)
    mixed = token_batch(policy=policy)
    success = torch.zeros_like(mixed.get(D.SUCCESS))
    success[::2] = mixed.get(D.VALID)[::2]               # half of every group succeeds: informative
    mixed.set(D.SUCCESS, success)
    actor.step(mixed)
    assert actor.optimizer_steps == 1
    weights = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    uninformative = token_batch(policy=policy, seed=1)
    uninformative.set(D.SUCCESS, uninformative.get(D.VALID).clone())   # every group all-success: all dropped
    metrics = actor.step(uninformative)
    assert float(metrics["filter/kept_fraction"]) == 0.0
    for n, p in policy.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, weights[n]), n
    assert actor.optimizer_steps == 1
    assert float(metrics["actor/skipped_empty_steps"]) == 1.0


def test_state_policy_temperature_zero_is_greedy():
    spec_policy = StateMLPPolicy(state_dim=4, action_dim=3, action_chunk=2, value_type="chunk_level")
    obs = {D.STATE: torch.randn(5, 4)}
    greedy = spec_policy.act(obs, SamplingParams(greedy=True))
    cold = spec_policy.act(obs, SamplingParams(temperature=0.0))
    for key in (D.ACTION_CHUNK, D.ACTION_SAMPLE, D.LOGPROB_BEHAVIOR):
        torch.testing.assert_close(cold[key], greedy[key], rtol=0, atol=0)
    # the actor scores greedy decisions at temperature 1: ratio 1 before any update
    actor = Actor(spec_policy, actor_cfg(ppo()), task_table=["t"], temperature=0.0)
    again = spec_policy.score_actions(obs, cold[D.ACTION_SAMPLE], temperature=actor.temperature)
    torch.testing.assert_close(again["logprob"], cold[D.LOGPROB_BEHAVIOR])


@pytest.mark.parametrize("top_k", [None, 5])
def test_openvla_oft_temperature_zero_is_greedy(top_k):
    from embodirl.envs.base import EnvSpec
    from embodirl.models.openvla_oft.resolve import load_preset
    from embodirl.models.registry import make_policy

    spec = EnvSpec(action_dim=7, max_episode_steps=100, task_descriptions=["t"], camera_names=["agentview"],
                   image_size=(64, 64), state_dim=8, name="libero_10")
    torch.manual_seed(0)
    policy = make_policy(load_preset("openvla_oft_tiny"), spec)
    g = torch.Generator().manual_seed(0)
    obs = {"images": torch.randint(0, 256, (2, 1, 3, 64, 64), dtype=torch.uint8, generator=g),
           "state": torch.randn(2, 8, generator=g), "instruction": ["open the drawer", "turn on the stove"]}
    greedy = policy.act(obs, SamplingParams(greedy=True))
    cold = policy.act(obs, SamplingParams(temperature=0.0, top_k=top_k))
    torch.testing.assert_close(cold[D.ACTION_TOKENS], greedy[D.ACTION_TOKENS], rtol=0, atol=0)
    torch.testing.assert_close(cold[D.LOGPROB_BEHAVIOR], greedy[D.LOGPROB_BEHAVIOR])
    assert torch.isfinite(cold[D.LOGPROB_BEHAVIOR]).all()
