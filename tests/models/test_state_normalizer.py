"""The state policy's observation normaliser through the real collector and actor (toy simulator):
after an update it holds the statistics of every valid state the update trained on, merged with earlier
ones; it is part of what the actor publishes, so a inference copy that loads the publication acts exactly
as the actor's policy; the states of an update are scored with the statistics they were collected with."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from embodirl import data as D
from embodirl.actor.actor import Actor
from embodirl.envs.registry import make_env
from embodirl.models.base import SamplingParams
from embodirl.models.registry import make_policy
from embodirl.rollout.collector import RolloutCollector
from embodirl.rollout.inference import PolicyInference
from tests.actor.helpers import actor_cfg, ppo

SAMPLE = SamplingParams()


def _valid_states(traj) -> torch.Tensor:
    return traj[D.STATE][traj[D.VALID].bool()].double()


@pytest.mark.parametrize("reuse_last_k", [0, 1], ids=["on-policy", "replay"])
def test_the_normaliser_learns_the_training_states_and_travels_with_the_weights(compose_cfg, reuse_last_k):
    cfg = compose_cfg("env=toy_reach", "model=state_mlp", "env.train.state_obs=true", "model.action_chunk=2",
                      "model.obs_norm=true", "env.train.max_episode_steps=8", "env.train.auto_reset=false")
    env = make_env(cfg.env.train, num_envs=4, seed=0)
    torch.manual_seed(0)
    policy = make_policy(cfg.model, env.spec)
    rollout_copy = copy.deepcopy(policy)                 # what an inference worker holds
    # with replay, step 2 trains on step 1's rows again: they still count once in the statistics
    actor = Actor(policy, actor_cfg(ppo(update_epochs=2), {"global_batch_size": 4, "micro_batch_size": 4,
                                                                 "replay_buffer.reuse_last_k": reuse_last_k}),
                      task_table=[])
    collector = RolloutCollector([env], PolicyInference(rollout_copy, env.spec.task_descriptions, SAMPLE),
                                 num_decisions=4, auto_reset=False, return_value=True)
    states = []
    for step in range(2):
        traj = collector.collect(seed=step)
        # the update scores the batch with the statistics it was collected with (approx. KL 0 before the
        # first optimizer step needs identical log-probs: the first epoch's first ratio is 1)
        before = {k: v.clone() for k, v in policy.obs_norm.state_dict().items()}
        torch.testing.assert_close(before, rollout_copy.obs_norm.state_dict())
        metrics = actor.step(traj)
        assert torch.isfinite(metrics["actor/pg_loss"])
        states.append(_valid_states(traj))
        seen = torch.cat(states)
        torch.testing.assert_close(policy.obs_norm.mean.double(), seen.mean(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(policy.obs_norm.var.double(), seen.var(0, unbiased=False), rtol=1e-4, atol=1e-6)
        assert float(policy.obs_norm.count.detach()) == seen.shape[0]
        # no gradient ever reaches the statistics: only the normaliser's own update moved them
        assert all(p.grad is None for p in policy.obs_norm.parameters())
        version, published = actor.publish_weights()
        assert {"obs_norm.mean", "obs_norm.var", "obs_norm.count"} <= set(published)
        rollout_copy.load_trainable_state_dict(published)
        obs = {"state": traj[D.STATE][:, 0], "task_id": traj[D.TASK_ID][:, 0]}
        greedy = SamplingParams(greedy=True)
        torch.testing.assert_close(rollout_copy.act(obs, greedy)[D.ACTION_CHUNK], policy.act(obs, greedy)[D.ACTION_CHUNK])
    # the normalised states the networks see are standardised
    z = policy.obs_norm(torch.cat(states).float())
    moving = torch.cat(states).std(0) > 1e-6
    np.testing.assert_allclose(z.mean(0)[moving].numpy(), 0.0, atol=1e-4)
    np.testing.assert_allclose(z.std(0, unbiased=False)[moving].numpy(), 1.0, atol=1e-3)


def test_without_obs_norm_the_policy_has_no_normaliser(compose_cfg):
    cfg = compose_cfg("env=toy_reach", "model=state_mlp", "env.train.state_obs=true", "model.obs_norm=false")
    env = make_env(cfg.env.train, num_envs=2, seed=0)
    policy = make_policy(cfg.model, env.spec)
    assert policy.obs_norm is None and not any(n.startswith("obs_norm") for n, _ in policy.named_parameters())
