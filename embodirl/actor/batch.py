"""A rollout batch on its way into the actor: the driver-side preparation of the whole batch
(:func:`prepare_batch`: KL reward penalty, group filtering, advantages) and the check that a shard
holds the fields an update reads (:func:`check_batch`)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from embodirl import data as D
from embodirl.algorithms import kl as kl_mod
from embodirl.algorithms.advantages import compute_advantages
from embodirl.algorithms.filtering import drop_filtered, group_composition
from embodirl.algorithms.section import AlgorithmSection, algorithm_of


def prepare_batch(batch: TensorDict, algorithm: AlgorithmSection, *, kl_coef: float = 0.0
                  ) -> tuple[TensorDict, dict[str, torch.Tensor]]:
    """Driver-side preparation of a whole rollout batch (before it is cut into actor shards):
    the KL reward penalty (``use_kl_loss: false``; needs ``logprob_ref``), group filtering
    (``filter_groups.enable``) and advantages/returns (:func:`compute_advantages`). For a group-relative
    estimator it reports the groups' composition (:func:`group_composition`), before any filtering."""
    algorithm = algorithm_of(algorithm)
    metrics: dict[str, torch.Tensor] = {}
    if kl_coef > 0 and not algorithm.use_kl_loss:
        if D.LOGPROB_REF not in batch.keys():
            raise ValueError("the KL reward penalty needs 'logprob_ref': call Actor.compute_ref_logprob first")
        reward, mean_kl = kl_mod.apply_kl_reward_penalty(
            batch.get(D.REWARD), batch.get(D.LOGPROB_BEHAVIOR), batch.get(D.LOGPROB_REF), batch.get(D.VALID),
            coef=kl_coef, kind=algorithm.kl_penalty,
            executed=batch.get(D.EXECUTED) if D.EXECUTED in batch.keys() else None)
        batch = batch.copy()
        batch.set(D.REWARD, reward.float())
        metrics["kl/reward_penalty_kl"] = mean_kl
    group_size, kept = algorithm.group_size, algorithm.filter_groups
    if algorithm.estimator.groups and D.SUCCESS in batch.keys() and group_size > 1:
        metrics.update(group_composition(batch.get(D.SUCCESS), batch.get(D.VALID), group_size=group_size))
    if kept.enable:
        batch, filter_metrics = drop_filtered(batch, group_size=group_size, min_success=kept.min_success,
                                              max_success=kept.max_success)
        metrics.update(filter_metrics)
    return compute_advantages(batch, algorithm), metrics


def check_batch(batch: TensorDict, algorithm: AlgorithmSection, *, action_field: str, kl_coef: float) -> None:
    """Validate an actor shard (:func:`embodirl.data.validate`) and check it holds what the update reads: advantages,
    behaviour log-probs, the policy's ``action_field``, values and returns for a critic, reference log-probs for a
    KL loss term."""
    D.validate(batch)
    need = [D.ADVANTAGE, D.LOGPROB_BEHAVIOR, action_field]
    if algorithm.uses_critic:
        need += [D.VALUE, D.RETURNS]
    if algorithm.use_kl_loss and kl_coef > 0:
        need.append(D.LOGPROB_REF)
    missing = [k for k in need if k not in batch.keys()]
    if missing:
        raise ValueError(f"the actor's batch lacks {missing}; prepare it with prepare_batch/compute_ref_logprob")
