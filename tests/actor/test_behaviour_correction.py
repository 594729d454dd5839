"""The rollout copy's log-probs differ from the learner's (merged bf16 weights, compiled kernels): with
``algorithm.recompute_old_logprob`` the actor clips the ratio to its own log-probs and weights each unit's loss by the
truncated ``pi_prox / pi_behaviour`` (``algorithm.behaviour_is_cap``), and every update reports the gap's mean, p99 and
max. A known mismatch is injected into the behaviour log-probs of a real batch and the actor's update is checked
against the same update with the weights folded into the advantages by hand."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from embodirl import data as D
from embodirl.actor.actor import Actor
from embodirl.algorithms import behaviour_gap

from .helpers import TASKS, TinyTokenPolicy, actor_cfg, grpo, token_batch

N, T = 8, 4
#: the injected pi_learner / pi_behaviour per decision: equal, above, far above the cap (2), below
WEIGHTS = torch.tensor([1.0, 1.5, 3.0, 0.5])


def _weights() -> torch.Tensor:
    return WEIGHTS[torch.arange(N * T) % len(WEIGHTS)].view(N, T)   # (N, T)


def _actor(policy, cap, recompute=True) -> Actor:
    cfg = actor_cfg(grpo(recompute_old_logprob=recompute, behaviour_is_cap=cap),
                    {"global_batch_size": N, "micro_batch_size": 4})
    return Actor(copy.deepcopy(policy), cfg, task_table=TASKS)


def _prepared(policy):
    batch = token_batch(N=N, T=T, policy=policy, seed=3)
    prepared, _ = _actor(policy, 2.0).prepare(batch)
    return prepared


def _mismatched(prepared):
    """Behaviour log-probs lowered by log w at every token of a decision: pi_learner / pi_behaviour = w."""
    out = prepared.clone()
    out.set(D.LOGPROB_BEHAVIOR, prepared.get(D.LOGPROB_BEHAVIOR) - _weights().log()[:, :, None])
    return out


def _trained(actor, batch) -> tuple[dict, dict[str, torch.Tensor]]:
    metrics = actor.update(batch)
    return metrics, {k: v.detach().clone() for k, v in actor.policy.named_parameters() if v.requires_grad}


def _close(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


def test_truncated_importance_weights_correct_a_known_mismatch():
    policy = TinyTokenPolicy()
    prepared = _prepared(policy)
    valid = prepared.get(D.VALID)
    capped = _weights().clamp(max=2.0)

    corrected_metrics, corrected = _trained(_actor(policy, 2.0), _mismatched(prepared))
    # the same update with the truncated weights folded into the advantages and no correction
    by_hand = prepared.clone()
    by_hand.set(D.ADVANTAGE, prepared.get(D.ADVANTAGE) * capped.to(prepared.get(D.ADVANTAGE).dtype))
    _, expected = _trained(_actor(policy, None), by_hand)
    _, uncorrected = _trained(_actor(policy, None), _mismatched(prepared))

    assert _close(corrected, expected)
    assert not _close(corrected, uncorrected)          # the weights changed the update
    assert corrected_metrics["actor/is_weight_mean"].item() == pytest.approx(capped[valid].mean().item(), rel=1e-5)
    assert corrected_metrics["actor/is_weight_truncated_fraction"].item() == pytest.approx(
        (_weights()[valid] >= 2.0).float().mean().item())


def test_the_gap_is_reported_as_mean_p99_and_max():
    policy = TinyTokenPolicy()
    prepared = _mismatched(_prepared(policy))
    actor = _actor(policy, 2.0, recompute=False)       # the gap is reported whether or not it is corrected
    metrics = actor.update(prepared)
    # the first optimizer step holds every row (global batch = N): its gaps are |log w| at each valid decision's tokens
    gaps = _weights().log().abs()[prepared.get(D.VALID)]
    assert metrics["actor/behaviour_gap_mean"].item() == pytest.approx(gaps.mean().item(), abs=1e-5)
    assert metrics["actor/behaviour_gap_max"].item() == pytest.approx(math.log(3.0), abs=1e-5)
    exact = torch.quantile(gaps, behaviour_gap.QUANTILE).item()
    assert exact - 1e-5 <= metrics["actor/behaviour_gap_p99"].item() <= exact * 10 ** 0.05 + 1e-5
    assert "actor/is_weight_mean" not in metrics       # no recompute: the rollout's log-probs are the old ones


def test_the_histogram_percentile_is_within_a_bin_of_the_exact_one():
    g = torch.Generator().manual_seed(0)
    logprob = torch.randn(64, 8, 6, generator=g)
    behaviour = logprob + torch.randn(64, 8, 6, generator=g).mul(3).exp().mul(1e-3)   # gaps over six decades
    mask = torch.rand(64, 8, 6, generator=g) < 0.8
    pieces = [behaviour_gap.statistics(logprob[i::3], behaviour[i::3], mask[i::3]) for i in range(3)]
    stats = None
    for piece in pieces:                                 # three ranks' statistics, summed as the all-reduce does
        stats = behaviour_gap.merge(stats, piece)
    got = behaviour_gap.summary(stats)
    gaps = (logprob - behaviour).abs()[mask]
    exact = torch.quantile(gaps, 0.99).item()
    assert got["max"] == pytest.approx(gaps.max().item()) and got["mean"] == pytest.approx(gaps.mean().item())
    assert exact <= got["p99"] <= exact * 10 ** 0.05 * (1 + 1e-6)
    assert behaviour_gap.summary(torch.zeros(3 + behaviour_gap.BINS + 2)) == {"mean": 0.0, "p99": 0.0, "max": 0.0}
