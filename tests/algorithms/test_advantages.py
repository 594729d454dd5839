"""Advantage estimators against straightforward per-element loops on random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from embodirl import data as D
from embodirl.algorithms import advantages as A
from embodirl.algorithms.section import AlgorithmSection
from embodirl.errors import ConfigError
from tests.algorithms.helpers import algorithm


def params(**values) -> AlgorithmSection:
    """The algorithm section for these tests: undiscounted, lambda 1, ungrouped, unless given."""
    return algorithm(**{"gamma": 1.0, "gae_lambda": 1.0, "group_size": 1, "norm_adv_by_std_in_grpo": True, **values})


def random_episodes(N: int, T: int, *, H: int | None = None, seed: int = 0, auto_reset: bool = False):
    """Random rows: each row is an episode that terminates, truncates or runs past the row's end;
    decisions after the end are invalid (with ``auto_reset`` a new episode starts instead)."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.zeros(N, T, dtype=torch.bool)
    term = torch.zeros(N, T, dtype=torch.bool)
    trunc = torch.zeros(N, T, dtype=torch.bool)
    for n in range(N):
        t = 0
        while t < T:
            length = int(torch.randint(1, T + 1, (1,), generator=g))
            end = min(t + length, T)
            valid[n, t:end] = True
            if t + length <= T:
                # without auto-reset an episode may also just stop (a cut, e.g. a crashed simulator)
                kind = int(torch.randint(0, 2 if auto_reset else 3, (1,), generator=g))
                if kind == 0:
                    term[n, end - 1] = True
                elif kind == 1:
                    trunc[n, end - 1] = True
            if not auto_reset:
                break
            t = end
    shape = (N, T) if H is None else (N, T, H)
    reward = torch.randn(*shape, generator=g)
    value = torch.randn(*shape, generator=g)
    # garbage at invalid decisions must not leak into valid ones
    reward = torch.where(valid if H is None else valid[..., None], reward, torch.full_like(reward, 1e3))
    bootstrap = torch.randn(N, generator=g) if H is None else torch.randn(N, H, generator=g)
    return reward, value, valid, term, trunc, bootstrap


def gae_loop(reward, value, valid, term, trunc, bootstrap, gamma, lam):
    """Reference GAE over a flat time axis per row, scalar Python."""
    N, S = valid.shape
    adv = torch.zeros(N, S)
    for n in range(N):
        valid_idx = [t for t in range(S) if valid[n, t]]
        final = valid_idx[-1] if valid_idx else None
        running = 0.0
        for t in reversed(range(S)):
            if not valid[n, t]:
                running = 0.0
                continue
            if term[n, t]:
                next_v = 0.0
            elif t == final and bootstrap is not None:
                next_v = float(bootstrap[n])
            elif t == S - 1:
                next_v = 0.0
            else:
                next_v = float(value[n, t + 1])
            delta = float(reward[n, t]) + gamma * next_v - float(value[n, t])
            continues = (t + 1 < S) and bool(valid[n, t + 1]) and not term[n, t] and not trunc[n, t]
            running = delta + (gamma * lam * running if continues else 0.0)
            adv[n, t] = running
    return adv, torch.where(valid, adv + value, torch.zeros_like(adv))


@pytest.mark.parametrize("with_bootstrap", [True, False])
@pytest.mark.parametrize("auto_reset", [False, True])
def test_gae_chunk_level_matches_loop(with_bootstrap, auto_reset):
    reward, value, valid, term, trunc, bootstrap = random_episodes(16, 9, seed=3, auto_reset=auto_reset)
    bootstrap = bootstrap if with_bootstrap else None
    inp = A.AdvantageInputs(reward=reward, value=value, valid=valid, terminated=term, truncated=trunc,
                            bootstrap_value=bootstrap)
    adv, ret = A.gae(inp, params(gamma=0.9, gae_lambda=0.8))
    ref_adv, ref_ret = gae_loop(reward, value, valid, term, trunc, bootstrap, 0.9, 0.8)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_bootstrap", [True, False])
def test_gae_action_level_unrolls_the_chunk(with_bootstrap):
    N, T, H = 12, 6, 3
    reward, value, valid, term, trunc, bootstrap = random_episodes(N, T, H=H, seed=5)
    bootstrap = bootstrap if with_bootstrap else None
    inp = A.AdvantageInputs(reward=reward, value=value, valid=valid, terminated=term, truncated=trunc,
                            bootstrap_value=bootstrap)
    adv, ret = A.gae(inp, params(gamma=0.95, gae_lambda=0.7))
    assert adv.shape == (N, T, H)
    # reference: one step per action; flags act after the chunk's last action
    step_valid = valid[:, :, None].expand(N, T, H).reshape(N, T * H)
    step_term = torch.zeros(N, T, H, dtype=torch.bool)
    step_term[:, :, -1] = term
    step_trunc = torch.zeros(N, T, H, dtype=torch.bool)
    step_trunc[:, :, -1] = trunc
    ref_adv, ref_ret = gae_loop(reward.reshape(N, -1), value.reshape(N, -1), step_valid, step_term.reshape(N, -1),
                                step_trunc.reshape(N, -1), None if bootstrap is None else bootstrap[:, 0], 0.95, 0.7)
    torch.testing.assert_close(adv.reshape(N, -1), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.reshape(N, -1), ref_ret, rtol=1e-5, atol=1e-5)


def test_gae_bootstraps_through_truncation_not_termination():
    # two one-decision episodes with identical reward and value; only the flags differ
    reward = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    value = torch.tensor([[0.5, 0.0], [0.5, 0.0]])
    valid = torch.tensor([[True, False], [True, False]])
    term = torch.tensor([[True, False], [False, False]])
    trunc = torch.tensor([[False, False], [True, False]])
    inp = A.AdvantageInputs(reward=reward, value=value, valid=valid, terminated=term, truncated=trunc,
                            bootstrap_value=torch.tensor([2.0, 2.0]))
    adv, _ = A.gae(inp, params(gamma=0.5, gae_lambda=1.0))
    assert adv[0, 0].item() == pytest.approx(1.0 - 0.5)            # terminated: no bootstrap
    assert adv[1, 0].item() == pytest.approx(1.0 + 0.5 * 2.0 - 0.5)  # truncated: bootstrap_value
    assert (adv[:, 1] == 0).all()
    # without extras the next decision's recorded value (the frozen final observation) is used
    inp.bootstrap_value = None
    inp.value = torch.tensor([[0.5, 3.0], [0.5, 3.0]])
    adv, _ = A.gae(inp, params(gamma=0.5, gae_lambda=1.0))
    assert adv[0, 0].item() == pytest.approx(0.5)
    assert adv[1, 0].item() == pytest.approx(1.0 + 0.5 * 3.0 - 0.5)


def grouped_inputs(N=12, T=5, G=4, seed=0, H=None):
    reward, _, valid, term, trunc, _ = random_episodes(N, T, H=H, seed=seed)
    group_id = torch.arange(N) // G
    return A.AdvantageInputs(reward=reward, valid=valid, terminated=term, truncated=trunc, group_id=group_id)


def scores_loop(inp):
    N, T = inp.valid.shape
    out = []
    for n in range(N):
        s = 0.0
        for t in range(T):
            if inp.valid[n, t]:
                s += float(inp.reward[n, t].sum())
        out.append(s)
    return out


@pytest.mark.parametrize("by_std", [True, False])
@pytest.mark.parametrize("H", [None, 3])
def test_grpo_matches_loop(by_std, H):
    G = 4
    inp = grouped_inputs(G=G, H=H, seed=7)
    adv, ret = A.grpo(inp, params(group_size=G, norm_adv_by_std_in_grpo=by_std))
    scores = scores_loop(inp)
    N, T = inp.valid.shape
    for n in range(N):
        group = scores[(n // G) * G:(n // G + 1) * G]
        mean = sum(group) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (G - 1))
        expected = (scores[n] - mean) / (std + A.STD_EPS) if by_std else scores[n] - mean
        for t in range(T):
            want = expected if inp.valid[n, t] else 0.0
            assert adv[n, t].item() == pytest.approx(want, rel=1e-5, abs=1e-5)
            assert ret[n, t].item() == pytest.approx(scores[n] if inp.valid[n, t] else 0.0, rel=1e-5, abs=1e-4)


def test_rloo_matches_loop():
    G = 3
    inp = grouped_inputs(N=9, G=G, seed=11)
    adv, _ = A.rloo(inp, params(group_size=G))
    scores = scores_loop(inp)
    for n in range(9):
        members = list(range((n // G) * G, (n // G + 1) * G))
        baseline = sum(scores[m] for m in members if m != n) / (G - 1)
        for t in range(inp.valid.shape[1]):
            want = scores[n] - baseline if inp.valid[n, t] else 0.0
            assert adv[n, t].item() == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_grouped_estimators_reject_mixed_groups_and_bad_sizes():
    inp = grouped_inputs(N=8, G=4)
    inp.group_id = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="group_id"):
        A.grpo(inp, params(group_size=4))
    with pytest.raises(ValueError, match="multiple"):
        A.rloo(grouped_inputs(N=8, G=4), params(group_size=3))
    with pytest.raises(ValueError, match="group_size >= 2"):
        A.grpo(grouped_inputs(N=8, G=4), params(group_size=1))


@pytest.mark.parametrize("H", [None, 2])
def test_reinforce_plus_plus_matches_loop(H):
    N, T = 10, 7
    reward, _, valid, term, trunc, _ = random_episodes(N, T, H=H, seed=13, auto_reset=True)
    inp = A.AdvantageInputs(reward=reward, valid=valid, terminated=term, truncated=trunc)
    gamma = 0.9
    adv, ret = A.reinforce_plus_plus(inp, params(gamma=gamma))
    # reference: return-to-go along the flat step axis, restarting at episode ends
    flat_r = reward.reshape(N, -1) if H else reward
    h = H or 1
    S = flat_r.shape[1]
    step_valid = valid[:, :, None].expand(N, T, h).reshape(N, S)
    ends = torch.zeros(N, T, h, dtype=torch.bool)
    ends[:, :, -1] = term | trunc
    ends = ends.reshape(N, S)
    rtg = torch.zeros(N, S)
    for n in range(N):
        running = 0.0
        for s in reversed(range(S)):
            if not step_valid[n, s]:
                running = 0.0
                continue
            cont = s + 1 < S and bool(step_valid[n, s + 1]) and not ends[n, s]
            running = float(flat_r[n, s]) + (gamma * running if cont else 0.0)
            rtg[n, s] = running
    vals = [float(rtg[n, s]) for n in range(N) for s in range(S) if step_valid[n, s]]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    want = torch.where(step_valid, (rtg - mean) / (std + A.STD_EPS), torch.zeros_like(rtg))
    torch.testing.assert_close(ret.reshape(N, S), rtg, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv.reshape(N, S), want, rtol=1e-5, atol=1e-5)


def test_remax_matches_loop_and_needs_baseline():
    inp = grouped_inputs(N=6, G=2, seed=17)
    with pytest.raises(ValueError, match="baseline"):
        A.remax(inp, params())
    inp.reward_baseline = torch.randn(6)
    adv, _ = A.remax(inp, params())
    scores = scores_loop(inp)
    for n in range(6):
        for t in range(inp.valid.shape[1]):
            want = scores[n] - float(inp.reward_baseline[n]) if inp.valid[n, t] else 0.0
            assert adv[n, t].item() == pytest.approx(want, rel=1e-5, abs=1e-5)


def make_batch(N=8, T=6, H=2, A_dim=3, seed=0, action_level=False):
    reward, value, valid, term, trunc, bootstrap = random_episodes(N, T, H=H if action_level else None, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    fields = {
        D.TASK_ID: torch.zeros(N, dtype=torch.int64),
        D.ACTION_CHUNK: torch.zeros(N, T, H, A_dim),
        D.REWARD: reward, D.VALUE: value, D.VALID: valid, D.TERMINATED: term, D.TRUNCATED: trunc,
        D.GROUP_ID: torch.arange(N) // 4,
        D.SUCCESS: torch.rand(N, T, generator=g) > 0.5,
    }
    return D.make_trajectory(fields, extras={D.BOOTSTRAP_VALUE: bootstrap})


def algo_cfg(**over):
    cfg = {"adv_type": "gae", "reward_type": "chunk_level", "gamma": 0.9, "gae_lambda": 0.8, "group_size": 4,
           "norm_adv_by_std_in_grpo": True, "normalize_advantages": False}
    cfg.update(over)
    return algorithm(**cfg)


def test_compute_advantages_fills_fields_and_uses_bootstrap_extra():
    batch = make_batch()
    out = A.compute_advantages(batch, algo_cfg())
    D.validate(out)
    ref_adv, ref_ret = gae_loop(batch.get(D.REWARD), batch.get(D.VALUE), batch.get(D.VALID), batch.get(D.TERMINATED),
                                batch.get(D.TRUNCATED), D.get_extra(batch, D.BOOTSTRAP_VALUE), 0.9, 0.8)
    torch.testing.assert_close(out.get(D.ADVANTAGE), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.get(D.RETURNS), ref_ret, rtol=1e-5, atol=1e-5)
    assert D.ADVANTAGE not in batch.keys()  # the input batch is left alone


def test_normalize_advantages_whitens_valid_entries():
    batch = make_batch(N=16, seed=4)
    out = A.compute_advantages(batch, algo_cfg(normalize_advantages=True))
    adv, valid = out.get(D.ADVANTAGE), out.get(D.VALID)
    assert adv[valid].mean().abs() < 1e-5
    assert adv[valid].std().item() == pytest.approx(1.0, abs=1e-4)
    assert (adv[~valid] == 0).all()


def test_reward_type_checks():
    chunk = make_batch()
    with pytest.raises(ValueError, match="action_level"):
        A.compute_advantages(chunk, algo_cfg(reward_type="action_level"))
    per_action = make_batch(action_level=True)
    # a chunk-level estimator sums per-action rewards over the chunk
    out = A.compute_advantages(per_action.exclude(D.VALUE), algo_cfg(adv_type="grpo", reward_type="chunk_level"))
    assert out.get(D.ADVANTAGE).shape == (8, 6)
    with pytest.raises(ConfigError, match="unknown advantage estimator 'nope'"):
        A.compute_advantages(chunk, algo_cfg(adv_type="nope"))
