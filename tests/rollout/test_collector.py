"""The in-process rollout loop on the real toy simulator with real policies.

The pipelined collector is checked against a plain loop (same env, same deterministic policy), and its
episode bookkeeping (valid masks, early stop, auto-reset, bootstrap values, GRPO groups, lost
episodes re-collected after a simulator is SIGKILLed) on real runs.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from embodirl import data as D
from embodirl.envs import toy
from embodirl.envs.registry import make_env
from embodirl.models.base import Policy, SamplingParams
from embodirl.models.registry import make_policy
from embodirl.rollout.collector import RolloutCollector
from embodirl.rollout.inference import PolicyInference
from embodirl.rollout.starts import EpisodeStarts, group_ids, plan_starts

GREEDY = SamplingParams(greedy=True)


class OraclePolicy(Policy):
    """The toy task's scripted oracle behind the policy interface (reaches the goal from the image)."""

    action_field = D.ACTION_SAMPLE

    def __init__(self, H: int, A: int, step_size: float):
        super().__init__()
        self.action_chunk, self.action_dim, self.step_size = H, A, step_size

    def act(self, obs, sampling, *, return_value=False):
        numpy_obs = {k: v.numpy() for k, v in obs.items() if isinstance(v, torch.Tensor)}
        chunk = torch.from_numpy(toy.oracle_actions(numpy_obs, self.action_chunk, self.action_dim, self.step_size))
        B = chunk.shape[0]
        return {D.ACTION_CHUNK: chunk, D.ACTION_SAMPLE: chunk.reshape(B, -1),
                D.LOGPROB_BEHAVIOR: torch.zeros(B, self.action_chunk * self.action_dim)}

    def score_actions(self, obs, actions, **kwargs):  # pragma: no cover - not used by rollouts
        raise NotImplementedError


@pytest.fixture
def toy_cfg(compose_cfg):
    def make(*overrides):
        return compose_cfg("env=toy_reach", "model=state_mlp", "env.train.state_obs=true", *overrides)
    return make


def _envs(env_cfg, S, B, offset=0):
    return [make_env(env_cfg, num_envs=B, seed=0, env_offset=offset + s * B) for s in range(S)]


def _plain_loop(env, policy, spec, T, starts, seed):
    """Reference: step one env batch for T decisions with a policy, no pipelining, no recorder."""
    obs, _ = env.reset(seed=seed, **starts.reset_kwargs())
    alive = np.ones(env.num_envs, bool)
    rows = {"reward": [], "valid": [], "action": [], "state": []}
    for _ in range(T):
        with torch.inference_mode():
            out = policy.act({"state": torch.from_numpy(obs["state"]), "task_id": torch.from_numpy(obs["task_id"])},
                             GREEDY)
        rows["valid"].append(alive.copy())
        rows["state"].append(obs["state"].copy())
        rows["action"].append(out[D.ACTION_CHUNK].numpy())
        obs, reward, term, trunc, _ = env.step(out[D.ACTION_CHUNK].numpy())
        rows["reward"].append(np.where(alive, reward, 0.0))
        alive &= ~(term | trunc)
    return {k: np.stack(v, axis=1) for k, v in rows.items()}


def test_pipelined_collector_matches_a_plain_loop(toy_cfg):
    cfg = toy_cfg("env.train.max_episode_steps=40")
    S, B, T = 2, 3, 10
    envs = _envs(cfg.env.train, S, B)
    policy = make_policy(cfg.model, envs[0].spec)
    torch.manual_seed(0)
    starts = EpisodeStarts(np.array([0, 1, 2, 3, 0, 1]), np.array([5, 6, 7, 8, 9, 10]))
    inference = PolicyInference(policy, envs[0].spec.task_descriptions, GREEDY, background=True)
    collector = RolloutCollector(envs, inference, num_decisions=T, return_value=True, seed=11)
    traj = collector.collect(starts)
    inference.close()
    D.validate(traj)
    assert traj.batch_size == torch.Size([S * B, T])
    for s in range(S):
        ref_env = make_env(cfg.env.train, num_envs=B, seed=0, env_offset=s * B)
        ref = _plain_loop(ref_env, policy, ref_env.spec, T, starts.slice(s * B, (s + 1) * B), seed=11 + s * B)
        rows = slice(s * B, (s + 1) * B)
        np.testing.assert_array_equal(traj[D.VALID][rows].numpy(), ref["valid"])
        np.testing.assert_allclose(traj[D.REWARD][rows].numpy(), ref["reward"])
        np.testing.assert_allclose(traj[D.STATE][rows].numpy(), ref["state"])
        np.testing.assert_allclose(traj[D.ACTION_CHUNK][rows].numpy(), ref["action"])
    np.testing.assert_array_equal(traj[D.TASK_ID][:, 0].numpy(), starts.task_ids)
    np.testing.assert_array_equal(traj[D.INIT_STATE_ID][:, 0].numpy(), starts.init_state_ids)
    assert (traj[D.WEIGHT_VERSION] == 0).all()


def test_records_have_contract_shapes_and_episode_masks(toy_cfg):
    cfg = toy_cfg()
    B, T = 4, 6   # 24 steps / H=4: every episode ends by the last decision (success or time limit)
    envs = _envs(cfg.env.train, 1, B)
    spec = envs[0].spec
    policy = make_policy(cfg.model, spec)
    collector = RolloutCollector(envs, PolicyInference(policy, spec.task_descriptions, weight_version=3),
                                 num_decisions=T, return_value=True, group_size=2, slot_offset=4)
    traj = collector.collect()
    sizes = D.validate(traj)
    H, A = policy.action_chunk, spec.action_dim
    assert sizes["H"] == H and sizes["A"] == A and sizes["L"] == H * A
    assert traj[D.VALUE].shape == (B, T)
    assert traj[D.REWARD].dtype == torch.float32
    np.testing.assert_array_equal(traj[D.GROUP_ID][:, 0].numpy(), [2, 2, 3, 3])
    assert (traj[D.WEIGHT_VERSION] == 3).all()
    done = traj[D.TERMINATED] | traj[D.TRUNCATED]
    for n in range(B):
        ends = torch.nonzero(done[n]).flatten().tolist()
        assert len(ends) == 1, "one episode per row without auto-reset"
        end = ends[0]
        assert traj[D.VALID][n, : end + 1].all() and not traj[D.VALID][n, end + 1:].any()
        assert (traj[D.REWARD][n, end + 1:] == 0).all()
    # every episode ended inside the horizon: nothing to bootstrap
    assert (D.get_extra(traj, D.BOOTSTRAP_VALUE) == 0).all()


def test_oracle_succeeds_and_finished_stages_stop_early(toy_cfg):
    cfg = toy_cfg("env.train.max_episode_steps=200")
    B, T = 4, 50
    envs = _envs(cfg.env.train, 2, B)
    spec = envs[0].spec
    oracle = OraclePolicy(4, spec.action_dim, float(cfg.env.train.step_size))
    collector = RolloutCollector(envs, PolicyInference(oracle, spec.task_descriptions), num_decisions=T)
    traj = collector.collect()
    D.validate(traj)
    assert traj[D.SUCCESS][:, -1].all()
    assert traj[D.TERMINATED].any(dim=1).all()
    lengths = traj[D.VALID].sum(dim=1)
    assert (lengths < T).all()
    # decisions after the last episode of a stage ended were never sent to the policy or the env
    assert collector.stats.decisions == int(sum(lengths.view(2, B).max(dim=1).values))
    assert (traj[D.REWARD].sum(dim=1) == 1.0).all()          # sparse reward: 1 on the success step


def test_horizon_cut_episodes_get_bootstrap_values(toy_cfg):
    cfg = toy_cfg("env.train.max_episode_steps=200")
    B, T = 3, 4
    envs = _envs(cfg.env.train, 1, B)
    spec = envs[0].spec
    policy = make_policy(cfg.model, spec)
    starts = EpisodeStarts(np.array([0, 1, 2]), np.array([0, 1, 2]))
    collector = RolloutCollector(envs, PolicyInference(policy, spec.task_descriptions, GREEDY), num_decisions=T,
                                 return_value=True)
    traj = collector.collect(starts, seed=0)
    assert not (traj[D.TERMINATED] | traj[D.TRUNCATED])[:, -1].any()
    # replay the recorded chunks on a fresh env: the bootstrap value is the critic's value of the
    # observation after the last chunk
    replay = make_env(cfg.env.train, num_envs=B, seed=0)
    obs, _ = replay.reset(seed=0, **starts.reset_kwargs())
    for t in range(T):
        np.testing.assert_allclose(obs["state"], traj[D.STATE][:, t].numpy())
        obs = replay.step(traj[D.ACTION_CHUNK][:, t].numpy())[0]
    with torch.inference_mode():
        expected = policy.act({"state": torch.from_numpy(obs["state"])}, GREEDY, return_value=True)[D.VALUE]
    torch.testing.assert_close(D.get_extra(traj, D.BOOTSTRAP_VALUE), expected)


def test_auto_reset_keeps_rows_valid_across_episodes(toy_cfg):
    cfg = toy_cfg("env.train.auto_reset=true", "env.train.max_episode_steps=8")
    B, T = 2, 7   # 7 decisions x 4 steps = 28 steps: at least three episodes per row
    envs = _envs(cfg.env.train, 1, B)
    spec = envs[0].spec
    policy = make_policy(cfg.model, spec)
    traj = RolloutCollector(envs, PolicyInference(policy, spec.task_descriptions), num_decisions=T,
                            auto_reset=True, return_value=True).collect()
    assert traj[D.VALID].all()
    assert ((traj[D.TERMINATED] | traj[D.TRUNCATED]).sum(dim=1) >= 3).all()


def test_fixed_reset_groups_share_init_states(toy_cfg):
    cfg = toy_cfg("env.train.use_fixed_reset_state_ids=true")
    B, G, T = 6, 3, 6
    envs = _envs(cfg.env.train, 1, B)
    spec = envs[0].spec
    starts = plan_starts(cfg.env.train, spec, B, G, np.random.default_rng(0))
    assert (starts.init_state_ids.reshape(2, G) == starts.init_state_ids[::G, None]).all()
    assert (starts.task_ids.reshape(2, G) == starts.task_ids[::G, None]).all()
    policy = make_policy(cfg.model, spec)
    traj = RolloutCollector(envs, PolicyInference(policy, spec.task_descriptions, GREEDY), num_decisions=T,
                            group_size=G).collect(starts)
    np.testing.assert_array_equal(traj[D.GROUP_ID][:, 0].numpy(), group_ids(B, G))
    np.testing.assert_array_equal(traj[D.INIT_STATE_ID][:, 0].numpy(), starts.init_state_ids)
    # same start, same deterministic policy: members of a group see the same first observation
    first = traj[D.STATE][:, 0].view(2, G, -1)
    assert torch.equal(first, first[:, :1].expand_as(first))
    # without the flag the adapter chooses: no shared starts are imposed
    free = plan_starts(toy_cfg().env.train, spec, B, G, np.random.default_rng(0))
    assert (free.init_state_ids < 0).all()


class _KillingInference(PolicyInference):
    """Inference that SIGKILLs one simulator process just before answering decision ``at``."""

    def __init__(self, *args, env, victim: int, at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.env, self.victim, self.at, self.calls = env, victim, at, 0

    def request(self, obs, *, return_value=False):
        if self.calls == self.at:
            os.kill(self.env.pids[self.victim], signal.SIGKILL)
        self.calls += 1
        return super().request(obs, return_value=return_value)


def test_simulator_killed_mid_episode_is_collected_again(toy_cfg):
    cfg = toy_cfg("env.train.processes=true", "env.train.max_episode_steps=40")
    B, T = 3, 10
    envs = _envs(cfg.env.train, 1, B)
    try:
        spec = envs[0].spec
        policy = make_policy(cfg.model, spec)
        inference = _KillingInference(policy, spec.task_descriptions, GREEDY, env=envs[0], victim=1, at=3)
        starts = EpisodeStarts(np.array([0, 1, 2]), np.array([3, 4, 5]))
        collector = RolloutCollector(envs, inference, num_decisions=T)
        traj = collector.collect(starts, seed=5)
        assert envs[0].num_restarts == 1
        assert collector.stats.restarts == 1 and collector.stats.recollected_rows == 1
        # the lost row was collected again from its start: a whole valid episode like an undisturbed run
        clean_envs = _envs(cfg.env.train, 1, B)
        try:
            clean = RolloutCollector(clean_envs, PolicyInference(policy, spec.task_descriptions, GREEDY),
                                     num_decisions=T).collect(starts, seed=5)
        finally:
            clean_envs[0].close()
        for key in (D.VALID, D.REWARD, D.STATE, D.ACTION_CHUNK, D.TERMINATED, D.TRUNCATED):
            torch.testing.assert_close(traj[key], clean[key], msg=key)
    finally:
        envs[0].close()
