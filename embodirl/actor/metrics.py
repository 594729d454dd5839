"""The whole-update metrics :meth:`Actor.update <embodirl.actor.actor.Actor.update>` reports beside its optimizer steps'
averages, each reduced over all actor ranks (``host``: the device the ranks reduce the small tensors on,
:func:`embodirl.actor.fsdp.host_device`): the batch's decisions, the critic's explained variance and the behaviour
policy's KL to the reference (:func:`batch_metrics`), the behaviour/learner log-prob gap and the importance weights
(:func:`gap_metrics`), and the KL the adaptive controller tracks (:func:`measured_kl`)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from tensordict import TensorDict

from embodirl import data as D
from embodirl.actor import fsdp
from embodirl.algorithms import behaviour_gap, losses
from embodirl.algorithms import kl as kl_mod
from embodirl.algorithms.section import AlgorithmSection


def batch_metrics(batch: TensorDict, algorithm: AlgorithmSection, *, L: int, epochs: float, host: torch.device
                  ) -> dict[str, torch.Tensor]:
    """Whole-batch metrics over all ranks: valid decisions (times the ``epochs`` trained on them), rows, explained
    variance of the critic, KL(behaviour || reference) when reference log-probs are present (``L`` log-prob entries
    per decision)."""
    valid = batch.get(D.VALID)
    decisions = fsdp.all_reduce_(valid.sum().float().to(host)).cpu()
    # rows with a valid decision (padding rows that even out the ranks' shards have none)
    rows = fsdp.all_reduce_(valid.any(-1).sum().float().to(host)).cpu()
    metrics = {"actor/decisions": decisions * epochs, "actor/trajectories": rows}
    if algorithm.uses_critic:
        sums = fsdp.all_reduce_(losses.explained_variance_sums(
            batch.get(D.VALUE), batch.get(D.RETURNS), valid).to(host)).cpu()
        metrics["critic/explained_variance"] = losses.explained_variance(sums)
    if D.LOGPROB_REF in batch.keys():
        token_kl = kl_mod.kl_divergence(batch.get(D.LOGPROB_BEHAVIOR), batch.get(D.LOGPROB_REF),
                                        algorithm.kl_penalty) * valid[:, :, None]
        sums = fsdp.all_reduce_(torch.stack([token_kl.sum(), valid.sum().float() * L]).to(host)).cpu()
        metrics["kl/behaviour_ref_kl"] = sums[0] / sums[1].clamp(min=1)
    return metrics


def gap_metrics(gap_stats: torch.Tensor | None, is_weight: torch.Tensor | None, is_cap: float | None,
                batch: TensorDict, *, host: torch.device) -> dict[str, torch.Tensor]:
    """The behaviour/learner log-prob gap of the first optimizer step (mean, p99, max over all ranks'
    tokens, :mod:`embodirl.algorithms.behaviour_gap`; ``gap_stats``: this rank's statistics, None when it scored
    none), and the importance weights' mean and truncated fraction (at ``is_cap``) over the valid units when the
    update applies them."""
    size = 3 + behaviour_gap.BINS + 2
    stats = gap_stats.to(host) if gap_stats is not None else torch.zeros(size, device=host)
    head = fsdp.all_reduce_(stats[behaviour_gap.MAX].clone(), "max")
    stats = fsdp.all_reduce_(stats)
    stats[behaviour_gap.MAX] = head
    metrics = {f"actor/behaviour_gap_{k}": torch.tensor(v) for k, v in behaviour_gap.summary(stats).items()}
    if is_weight is not None:
        assert is_cap is not None       # weights come with the cap they were truncated at (Actor._old_logprob)
        valid = batch.get(D.VALID)[:, :, None].expand_as(is_weight).to(is_weight.device)
        truncated = valid & (is_weight >= is_cap * (1 - 1e-6))
        sums = torch.stack([torch.where(valid, is_weight, 0.0).sum(), valid.sum().float(),
                            truncated.sum().float()]).to(host)
        sums = fsdp.all_reduce_(sums)
        count = sums[1].clamp(min=1)
        metrics["actor/is_weight_mean"] = (sums[0] / count).cpu()
        metrics["actor/is_weight_truncated_fraction"] = (sums[2] / count).cpu()
    return metrics


def measured_kl(metrics: Mapping[str, torch.Tensor], algorithm: AlgorithmSection) -> float:
    """The KL the adaptive controller tracks: of the trained policy (loss mode) or of the behaviour
    policy (reward-penalty mode); 0 when it is missing or not finite."""
    key = "actor/kl" if algorithm.use_kl_loss else "kl/behaviour_ref_kl"
    value = metrics.get(key)
    return 0.0 if value is None or not math.isfinite(float(value)) else float(value)
