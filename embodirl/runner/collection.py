"""What a training step's collection adds around the workers' rollouts: ReMax's greedy baseline,
re-sampled group filtering, and the step's collection metrics (:func:`collection_metrics`).

* :func:`remax_baseline` - ReMax (Li et al. 2024) as verl runs it (``verl/trainer/ppo/ray_trainer.py``,
  the ``AdvantageEstimator.REMAX`` branch of ``fit``, commit b178a3cd): next to the sampled rollout,
  one greedy rollout (``do_sample=False``) from the same prompts, whose reward is each trajectory's
  baseline (``reward_baselines``; ``core_algos.compute_remax_outcome_advantage`` subtracts it). Here a
  prompt is an episode start: the greedy rollout resets every slot to the task and init state its
  sampled episode started from (and the same simulator seeds), and its return becomes
  ``extras.reward_baseline``.
* :class:`InformativeGroups` - dynamic sampling as SimpleVLA-RL runs it
  (``verl/trainer/ppo/ray_trainer.py`` ``fit``, commit 7c51662d: ``while len(valid_batch) <
  batch_size * n_samples`` generate, filter by group accuracy, append; then trim the surplus): rollouts
  are drawn until the step holds its full batch of informative groups (success rate strictly inside
  ``filter_groups``' bounds), at most ``max_resample_rounds`` rollouts beyond ``rollout.rollout_epoch``.
  A step that reaches the cap short of a full batch fills it with uninformative groups, which group
  filtering then masks out (shapes stay fixed; SimpleVLA-RL instead ends its epoch there).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from embodirl import data as D
from embodirl.algorithms.advantages import REWARD_BASELINE
from embodirl.algorithms.filtering import group_keep_mask
from embodirl.algorithms.section import AlgorithmSection
from embodirl.rollout.collector import RolloutStats
from embodirl.rollout.starts import EpisodeStarts


def episode_starts(batch) -> EpisodeStarts:
    """Where each row's (first) episode started: ``task_id`` and ``init_state_id`` at decision 0."""
    return EpisodeStarts(batch.get(D.TASK_ID)[:, 0].numpy().astype(np.int64).copy(),
                         batch.get(D.INIT_STATE_ID)[:, 0].numpy().astype(np.int64).copy())


def episode_returns(batch) -> torch.Tensor:
    """Each row's total valid reward, float32 ``(N,)``."""
    reward = batch.get(D.REWARD)
    reward = reward.sum(-1) if reward.dim() == 3 else reward            # (N, T)
    return (reward * batch.get(D.VALID)).sum(-1).float()


def remax_baseline(groups, batch, *, seed: int):
    """``batch`` with ``extras.reward_baseline``: the return of a greedy rollout from each row's start
    (same simulator seed). Returns ``(batch, seconds)``."""
    t0 = time.perf_counter()
    greedy = groups.collect(episode_starts(batch), seed=seed, greedy=True)
    return D.set_extra(batch, REWARD_BASELINE, episode_returns(greedy)), time.perf_counter() - t0


class InformativeGroups:
    """Keeps the informative groups of successive rollouts until ``target_rows`` rows (see module
    docstring). :meth:`add` returns True when no more rollouts are needed."""

    def __init__(self, *, target_rows: int, group_size: int, min_success: float, max_success: float,
                 max_extra_rollouts: int, base_rollouts: int):
        self.target_rows, self.G = int(target_rows), int(group_size)
        self.min_success, self.max_success = float(min_success), float(max_success)
        self.max_rollouts = int(base_rollouts) + int(max_extra_rollouts)
        self.kept: list = []
        self.spare: list = []          # uninformative groups, to fill a batch the cap left short
        self.rollouts = 0
        self.drawn = 0

    @classmethod
    def from_config(cls, algorithm: AlgorithmSection, *, num_slots: int, rollout_epoch: int) -> InformativeGroups | None:
        """None unless ``algorithm.filter_groups.resample``."""
        fg = algorithm.filter_groups
        if not (fg.enable and fg.resample):
            return None
        return cls(target_rows=num_slots * rollout_epoch, group_size=algorithm.group_size,
                   min_success=fg.min_success, max_success=fg.max_success,
                   max_extra_rollouts=fg.max_resample_rounds, base_rollouts=rollout_epoch)

    @property
    def kept_rows(self) -> int:
        return sum(b.batch_size[0] for b in self.kept)

    def add(self, batch) -> bool:
        self.rollouts += 1
        self.drawn += batch.batch_size[0]
        keep, _ = group_keep_mask(batch.get(D.SUCCESS), batch.get(D.VALID), group_size=self.G,
                                  min_success=self.min_success, max_success=self.max_success)   # (N,)
        if keep.any():
            self.kept.append(batch[keep])
        if (~keep).any():
            self.spare.append(batch[~keep])
        return self.kept_rows >= self.target_rows or self.rollouts >= self.max_rollouts

    def batch(self):
        """The step's batch: ``target_rows`` rows, informative groups first, groups renumbered."""
        parts = self.kept + self.spare
        out = D.concat(parts)[: self.target_rows] if len(parts) > 1 else parts[0][: self.target_rows]
        N, T = out.batch_size
        out.set(D.GROUP_ID, (torch.arange(N) // self.G)[:, None].expand(N, T).contiguous())
        return out


def rollout_metrics(batch, H: int, collect_s: float) -> dict[str, float]:
    """Success rate, return and length of the episodes in a rollout batch ``[N, T]``, and the oldest
    weight version that acted in it."""
    valid = batch.get(D.VALID)
    done = (batch.get(D.TERMINATED) | batch.get(D.TRUNCATED)) & valid
    reward = batch.get(D.REWARD)
    reward = reward.sum(-1) if reward.dim() == 3 else reward                     # (N, T)
    success = batch.get(D.SUCCESS) if D.SUCCESS in batch.keys() else torch.zeros_like(valid)
    # An episode is a finished one (done) or the unfinished tail of a row.
    unfinished_tail = valid[:, -1] & ~done[:, -1]
    episodes = float(done.sum() + unfinished_tail.sum())
    succeeded = float((success & done).sum() + (success[:, -1] & unfinished_tail).sum())
    decisions = float(valid.sum())
    metrics = {
        "train/success_rate": succeeded / max(episodes, 1.0),
        "train/return": float((reward * valid).sum()) / max(episodes, 1.0),
        "train/episode_length": decisions * H / max(episodes, 1.0),
        "train/episodes": episodes,
        "env/steps_per_s": decisions * H / max(collect_s, 1e-9),
    }
    if D.WEIGHT_VERSION in batch.keys():
        # the oldest weights that acted: the version the last sync published when rollouts are on-policy
        metrics["rollout/weight_version"] = float(batch.get(D.WEIGHT_VERSION)[valid].min())
    return metrics


def collection_metrics(batch, stats: RolloutStats, H: int, collect_s: float) -> tuple[dict[str, float], dict[str, float]]:
    """A step's collection timings (``time/*``: collection without ReMax's greedy rollouts, which count
    apart, and its env / inference / channel-wait split) and metrics (:func:`rollout_metrics`, episodes
    collected again, observation batches per transport, re-sampled group filtering's rollouts)."""
    timings = {"time/collect": collect_s}
    if stats.baseline_s:
        timings["time/baseline_rollout"] = stats.baseline_s   # ReMax's greedy rollouts
    timings.update({"time/env": stats.env_s, "time/inference": stats.infer_s, "time/channel_wait": stats.wait_s})
    metrics = rollout_metrics(batch, H, collect_s)
    metrics["train/dropped_episodes"] = float(stats.recollected_rows)
    metrics["transport/shm_batches"] = float(stats.shm_batches)
    metrics["transport/object_store_batches"] = float(stats.object_store_batches)
    if stats.rollouts_drawn:
        metrics["train/rollouts_drawn"] = float(stats.rollouts_drawn)
        metrics["train/rollouts_kept"] = float(stats.rollouts_kept)
    return timings, metrics
