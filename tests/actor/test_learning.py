"""A GRPO update and a PPO update on real toy-task trajectories raise the log-probability of the
better actions (and lower that of the worse ones). Trajectories are collected with the plain loop
env.reset -> policy.act -> env.step, from the toy reach task with state observations and the
Gaussian state policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodirl import data as D
from embodirl.actor.actor import Actor
from embodirl.envs.registry import make_env
from embodirl.models.base import SamplingParams
from embodirl.models.state_policy import StateMLPPolicy
from tests.env_options import env_option

from .helpers import actor_cfg, grpo, ppo

N, G, H = 16, 4, 4


def toy_env(num_envs: int):
    cfg = env_option("toy_reach")
    cfg.update(cameras=[], state_obs=True, action_dim=2, reward_mode="dense", max_episode_steps=24)
    return make_env(cfg, num_envs=num_envs, seed=0)


def collect(env, policy: StateMLPPolicy, *, seed: int) -> D.TensorDict:
    """One batch of episodes ``[N, T]``; groups of G envs share a task and an init state."""
    torch.manual_seed(seed)
    T = -(-env.spec.max_episode_steps // H)
    groups = np.arange(N) // G
    task_ids = groups % len(env.spec.task_descriptions)
    obs, _ = env.reset(task_ids=task_ids, init_state_ids=groups + 10 * seed)
    rec = {k: [] for k in (D.STATE, D.TASK_ID, D.ACTION_SAMPLE, D.ACTION_CHUNK, D.LOGPROB_BEHAVIOR, D.VALUE,
                           D.REWARD, D.TERMINATED, D.TRUNCATED, D.VALID, D.SUCCESS)}
    ended = np.zeros(N, bool)
    for _ in range(T):
        out = policy.act(obs, SamplingParams(), return_value=True)
        next_obs, reward, terminated, truncated, info = env.step(out[D.ACTION_CHUNK].numpy())
        valid = ~ended
        rec[D.STATE].append(torch.as_tensor(obs[D.STATE]))
        rec[D.TASK_ID].append(torch.as_tensor(obs[D.TASK_ID]))
        for key in (D.ACTION_SAMPLE, D.ACTION_CHUNK, D.LOGPROB_BEHAVIOR, D.VALUE):
            rec[key].append(out[key])
        rec[D.REWARD].append(torch.as_tensor(reward * valid, dtype=torch.float32))
        rec[D.TERMINATED].append(torch.as_tensor(terminated & valid))
        rec[D.TRUNCATED].append(torch.as_tensor(truncated & valid))
        rec[D.VALID].append(torch.as_tensor(valid))
        rec[D.SUCCESS].append(torch.as_tensor(info["success"] & valid))
        ended |= terminated | truncated
        obs = next_obs
    fields = {k: torch.stack(v, 1) for k, v in rec.items()}
    fields[D.GROUP_ID] = torch.as_tensor(groups)
    with torch.no_grad():
        bootstrap = policy.act(obs, SamplingParams(), return_value=True)[D.VALUE]
    return D.make_trajectory(fields, extras={D.BOOTSTRAP_VALUE: bootstrap.float()})


def decision_logprob(policy, batch) -> torch.Tensor:
    """log pi(action chunk | state) per decision ``(N, T)`` under ``policy``."""
    n, T = batch.batch_size
    with torch.no_grad():
        out = policy.score_actions({D.STATE: batch.get(D.STATE).flatten(0, 1)}, batch.get(D.ACTION_SAMPLE).flatten(0, 1),
                              return_value=False, return_entropy=False)
    return out["logprob"].sum(-1).view(n, T)


@pytest.mark.parametrize("alg", [grpo(update_epochs=2), ppo(update_epochs=4)], ids=["grpo", "ppo"])
def test_update_raises_log_prob_of_better_actions(alg):
    env = toy_env(N)
    try:
        torch.manual_seed(0)
        policy = StateMLPPolicy(4, 2, H, hidden_sizes=(64, 64), critic_hidden_sizes=(64, 64))
        batch = collect(env, policy, seed=1)
    finally:
        env.close()
    cfg = actor_cfg(alg, {"global_batch_size": N, "micro_batch_size": 4, "optim.lr": 3e-3})
    actor = Actor(policy, cfg, task_table=env.spec.task_descriptions)
    prepared, _ = actor.prepare(batch)
    before = decision_logprob(policy, prepared)
    actor.update(prepared)
    change = decision_logprob(policy, prepared) - before  # (N, T)

    valid, advantage = prepared.get(D.VALID), prepared.get(D.ADVANTAGE)
    better, worse = valid & (advantage > 0), valid & (advantage < 0)
    assert better.any() and worse.any()
    assert change[better].mean() > 0, "the better actions became less likely"
    assert change[worse].mean() < 0, "the worse actions became more likely"
    # the larger the advantage, the larger the gain: positive correlation over valid decisions
    a, c = advantage[valid], change[valid]
    corr = ((a - a.mean()) * (c - c.mean())).mean() / (a.std() * c.std())
    assert corr > 0.3
