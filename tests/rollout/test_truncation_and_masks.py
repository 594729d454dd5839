"""Episode ends through the real collector (toy simulator, real state policy) and the real actor:

* a decision the time limit truncates gets, as its successor value, the critic's value of that
  episode's own final observation - without auto-reset and with it, at the row's end and inside a row
  (checked against a plain reference loop over the same env, and through GAE itself);
* actions an episode's end inside a chunk left unexecuted are flagged, kept out of the policy loss at
  token, action and chunk level, and their values are never successor values at action level.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodirl import data as D
from embodirl.actor.actor import Actor
from embodirl.algorithms.advantages import compute_advantages
from embodirl.envs import toy
from embodirl.envs.registry import make_env
from embodirl.models.base import SamplingParams
from embodirl.models.registry import make_policy
from embodirl.rollout.collector import RolloutCollector
from embodirl.rollout.inference import PolicyInference
from embodirl.rollout.starts import EpisodeStarts
from tests.algorithms.helpers import algorithm as algorithm_section

GREEDY = SamplingParams(greedy=True)
B, H = 3, 4


@pytest.fixture
def toy_cfg(compose_cfg):
    def make(*overrides):
        # a tiny step: the point never reaches a goal, so every episode ends at the time limit
        return compose_cfg("env=toy_reach", "model=state_mlp", "env.train.state_obs=true", f"model.action_chunk={H}",
                           "env.train.step_size=0.001", *overrides)
    return make


def _act(policy, obs):
    with torch.inference_mode():
        return policy.act({"state": torch.from_numpy(np.asarray(obs["state"])),
                           "task_id": torch.from_numpy(np.asarray(obs["task_id"]))}, GREEDY, return_value=True)


def _reference_final_values(env, policy, T, starts, seed, auto_reset):
    """A plain loop over the env: V(final observation) at every decision that truncated its episode."""
    obs, _ = env.reset(seed=seed, **starts.reset_kwargs())
    alive = np.ones(env.num_envs, bool)
    truncated_at = np.zeros((env.num_envs, T), bool)
    final_value = np.zeros((env.num_envs, T), np.float32)
    for t in range(T):
        if not alive.any():
            break
        out = _act(policy, obs)
        obs, _, term, trunc, info = env.step(out[D.ACTION_CHUNK].numpy())
        rows = alive & trunc
        final_obs = info["final_obs"] if auto_reset else obs
        truncated_at[:, t] = rows
        final_value[rows, t] = _act(policy, final_obs)[D.VALUE].numpy()[rows]
        if not auto_reset:
            alive &= ~(term | trunc)
    return truncated_at, final_value


@pytest.mark.parametrize("auto_reset,max_steps,T", [
    (False, 12, 3),   # truncated by the last chunk of the row
    (False, 6, 4),    # inside the row: the second chunk crosses the limit, the stage then stops
    (True, 6, 4),     # auto-reset: truncations inside the row (next episode follows) and at its end
], ids=["row-end", "inside-row", "auto-reset"])
def test_truncated_decisions_bootstrap_with_their_own_final_observation(toy_cfg, auto_reset, max_steps, T):
    cfg = toy_cfg(f"env.train.max_episode_steps={max_steps}", f"env.train.auto_reset={str(auto_reset).lower()}")
    env = make_env(cfg.env.train, num_envs=B, seed=0)
    spec = env.spec
    torch.manual_seed(0)
    policy = make_policy(cfg.model, spec)
    with torch.no_grad():                   # values that differ clearly between observations
        for p in policy.critic.parameters():
            p.add_(0.5 * torch.randn_like(p))
    starts = EpisodeStarts(np.array([0, 1, 2]), np.array([3, 4, 5]))
    collector = RolloutCollector([env], PolicyInference(policy, spec.task_descriptions, GREEDY), num_decisions=T,
                                 auto_reset=auto_reset, return_value=True)
    traj = collector.collect(starts, seed=0)

    reference_env = make_env(cfg.env.train, num_envs=B, seed=0)
    truncated_at, expected = _reference_final_values(reference_env, policy, T, starts, 0, auto_reset)
    truncated = (traj[D.TRUNCATED] & traj[D.VALID]).numpy()
    np.testing.assert_array_equal(truncated, truncated_at)
    assert truncated.any() and not traj[D.TERMINATED].any()

    # through GAE (gamma 1, lambda 0): advantage = r + V(successor) - V, so the successor value GAE used is
    # advantage - r + V; at every truncated decision it is V(that episode's final observation)
    algorithm = algorithm_section(adv_type="gae", reward_type="chunk_level", gamma=1.0, gae_lambda=0.0, group_size=1,
                                  norm_adv_by_std_in_grpo=True, normalize_advantages=False)
    prepared = compute_advantages(traj, algorithm)
    successor = prepared[D.ADVANTAGE] - prepared[D.REWARD] + prepared[D.VALUE]
    np.testing.assert_allclose(successor.numpy()[truncated], expected[truncated], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(traj[D.FINAL_VALUE].numpy()[truncated], expected[truncated], rtol=1e-6, atol=1e-6)
    if auto_reset:   # inside the row the next decision starts another episode: its value is not the successor
        inside = truncated[:, :-1]
        next_value = traj[D.VALUE].numpy()[:, 1:]
        assert np.abs(next_value[inside] - expected[:, :-1][inside]).min() > 1e-3


def test_chunks_cut_by_the_time_limit_flag_their_unexecuted_actions(toy_cfg):
    cfg = toy_cfg("env.train.max_episode_steps=6", "env.train.auto_reset=true")
    env = make_env(cfg.env.train, num_envs=B, seed=0)
    policy = make_policy(cfg.model, env.spec)
    traj = RolloutCollector([env], PolicyInference(policy, env.spec.task_descriptions, GREEDY), num_decisions=4,
                            auto_reset=True, return_value=True).collect(seed=0)
    executed = traj[D.EXECUTED]                                          # (B, T, H): 4 + 2 steps per episode
    assert executed.shape == (B, 4, H)
    torch.testing.assert_close(executed.sum(-1), torch.tensor([[4, 2, 4, 2]] * B))


# --- mid-chunk terminations through the actor -------------------------------------------------------
class _Oracle(torch.nn.Module):
    """The toy task's scripted oracle behind the inference interface (reaches the goal mid-chunk)."""

    def __init__(self, policy, step_size):
        super().__init__()
        self.policy, self.step_size = policy, step_size

    def parameters(self, recurse=True):
        return self.policy.parameters(recurse)

    def act(self, obs, sampling, *, return_value=False):
        numpy_obs = {k: v.numpy() for k, v in obs.items() if isinstance(v, torch.Tensor)}
        chunk = torch.from_numpy(toy.oracle_actions(numpy_obs, H, self.policy.action_dim, self.step_size))
        N = chunk.shape[0]
        sample = chunk.reshape(N, -1)
        ev = self.policy.score_actions({"state": obs["state"]}, sample, return_value=True, return_entropy=False)
        out = {D.ACTION_CHUNK: chunk, D.ACTION_SAMPLE: sample, D.LOGPROB_BEHAVIOR: ev["logprob"].float()}
        if return_value:
            out[D.VALUE] = ev[D.VALUE].float()
        return out


def _oracle_batch(compose_cfg, value_type="chunk_level"):
    reward = "action_level" if value_type == "action_level" else "chunk_level"
    cfg = compose_cfg("env=toy_reach", "model=state_mlp", "env.train.state_obs=true", f"model.action_chunk={H}",
                      "env.train.reward_mode=dense", f"env.train.reward_type={reward}",
                      f"model.value_type={value_type}")
    env = make_env(cfg.env.train, num_envs=8, seed=0)
    torch.manual_seed(0)
    policy = make_policy(cfg.model, env.spec)
    oracle = _Oracle(policy, float(cfg.env.train.step_size))
    traj = RolloutCollector([env], PolicyInference(oracle, env.spec.task_descriptions, GREEDY), num_decisions=6,
                            return_value=True).collect(seed=0)
    ended = traj[D.TERMINATED] & traj[D.VALID]
    mid_chunk = ended & ~traj[D.EXECUTED].all(-1)
    assert mid_chunk.sum() >= 2, "the oracle should reach its goal inside a chunk in several rows"
    return cfg, policy, traj


def _perturb_unexecuted(traj, fields):
    """A copy whose unexecuted actions carry garbage in ``fields`` (per-action or per-token)."""
    noisy = traj.clone()
    unexecuted = traj[D.VALID][:, :, None] & ~traj[D.EXECUTED]           # (N, T, H)
    g = torch.Generator().manual_seed(1)
    for key in fields:
        x = noisy.get(key)
        mask = unexecuted if x.shape[2] == H else unexecuted.repeat_interleave(x.shape[2] // H, dim=2)
        x[mask] = torch.randn(x[mask].shape, generator=g) * 50
    return noisy


@pytest.mark.parametrize("logprob_type", ["token", "action", "chunk"])
def test_unexecuted_actions_do_not_reach_the_policy_loss(compose_cfg, logprob_type):
    cfg, policy, traj = _oracle_batch(compose_cfg)
    noisy = _perturb_unexecuted(traj, (D.LOGPROB_BEHAVIOR, D.ACTION_SAMPLE))
    algorithm = {**dict(cfg.algorithm), "adv_type": "reinforce_plus_plus", "logprob_type": logprob_type,
                 "update_epochs": 1}
    actor_cfg = {**dict(cfg.actor), "global_batch_size": 8, "micro_batch_size": 8}
    states = []
    for batch in (traj, noisy):
        actor_policy = _copy(policy)
        actor = Actor(actor_policy, {"algorithm": algorithm, "actor": actor_cfg}, task_table=["t"] * 8)
        metrics = actor.step(batch)
        assert np.isfinite(float(metrics["actor/grad_norm"]))
        states.append(actor.publish_weights(full=True)[1])
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0, msg=key)


def test_unexecuted_action_values_are_never_successor_values(compose_cfg):
    cfg, _, traj = _oracle_batch(compose_cfg, value_type="action_level")
    assert traj[D.VALUE].shape[2] == H
    noisy = _perturb_unexecuted(traj, (D.VALUE,))
    algorithm = algorithm_section(adv_type="gae", reward_type="action_level", gamma=0.9, gae_lambda=0.95, group_size=1,
                                  norm_adv_by_std_in_grpo=True, normalize_advantages=True)
    a, b = compute_advantages(traj, algorithm), compute_advantages(noisy, algorithm)
    ran = traj[D.VALID][:, :, None] & traj[D.EXECUTED]
    torch.testing.assert_close(a[D.ADVANTAGE][ran], b[D.ADVANTAGE][ran])
    torch.testing.assert_close(a[D.RETURNS][ran], b[D.RETURNS][ran])
    assert (a[D.ADVANTAGE][~ran] == 0).all()


def _copy(policy):
    import copy

    return copy.deepcopy(policy)


def test_unexecuted_actions_carry_no_kl_reward_penalty(compose_cfg):
    from embodirl.actor.actor import prepare_batch

    cfg, _, traj = _oracle_batch(compose_cfg)
    traj.set(D.LOGPROB_REF, traj[D.LOGPROB_BEHAVIOR] - 0.3)
    noisy = _perturb_unexecuted(traj, (D.LOGPROB_REF,))
    algorithm = {**dict(cfg.algorithm), "adv_type": "reinforce_plus_plus", "use_kl_loss": False, "kl_penalty": "kl"}
    (a, ma), (b, mb) = (prepare_batch(x, algorithm, kl_coef=0.5) for x in (traj, noisy))
    torch.testing.assert_close(a[D.REWARD], b[D.REWARD])
    torch.testing.assert_close(ma["kl/reward_penalty_kl"], mb["kl/reward_penalty_kl"])
    assert not torch.equal(a[D.REWARD], traj[D.REWARD])          # the penalty itself applies
