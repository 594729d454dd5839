"""Group filtering (``algorithm.filter_groups``): drop GRPO groups that teach nothing.

A group whose trajectories all succeed or all fail has zero group-relative advantage everywhere; it
only dilutes the loss normaliser. Groups are consecutive blocks of ``group_size`` rows; a group is
kept when its success rate lies strictly inside ``(min_success, max_success)`` - with the defaults
``(0, 1)`` exactly the all-fail and all-success groups are dropped (DAPO's dynamic sampling, Yu et
al. 2025, without the re-sampling).

Dropped rows are not removed from the batch: :func:`drop_filtered` marks their decisions invalid, so
shapes stay fixed (every actor shard keeps the same number of rows), the aggregation's global
denominators exclude them, and the actor skips their forward passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from embodirl import data as D

if TYPE_CHECKING:  # the batch carrier of the data contract; only named in annotations here
    from tensordict import TensorDict


def trajectory_success(success: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Whether each row succeeded at some valid decision: bool ``(N,)`` from ``(N, T)``."""
    return (success & valid).any(-1)


def group_keep_mask(success: torch.Tensor, valid: torch.Tensor, *, group_size: int, min_success: float,
                    max_success: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows to keep, bool ``(N,)``, and each group's success rate ``(N // G,)``."""
    N = success.shape[0]
    if N % group_size:
        raise ValueError(f"the batch has {N} trajectories, not a multiple of group_size={group_size}")
    rate = trajectory_success(success, valid).float().view(N // group_size, group_size).mean(-1)  # (N/G,)
    keep_group = (rate > min_success) & (rate < max_success)  # (N/G,)
    return keep_group.repeat_interleave(group_size), rate


def group_composition(success: torch.Tensor, valid: torch.Tensor, *, group_size: int) -> dict[str, torch.Tensor]:
    """What the batch's groups can teach a group-relative estimator: the fractions of groups whose trajectories
    all failed (``groups/all_fail``), split (``groups/mixed``) or all succeeded (``groups/all_success``). Only a
    mixed group separates success from failure; the others move the policy by the dense reward alone."""
    _, rate = group_keep_mask(success, valid, group_size=group_size, min_success=0.0, max_success=1.0)
    return {"groups/all_fail": (rate == 0).float().mean(), "groups/mixed": ((rate > 0) & (rate < 1)).float().mean(),
            "groups/all_success": (rate == 1).float().mean()}


def drop_filtered(batch: TensorDict, *, group_size: int, min_success: float, max_success: float
                  ) -> tuple[TensorDict, dict[str, torch.Tensor]]:
    """Mark the decisions of filtered groups invalid (shallow copy); return metrics
    ``filter/kept_fraction`` and ``filter/group_success_rate``."""
    if D.SUCCESS not in batch.keys():
        raise ValueError("group filtering needs the trajectory field 'success'")
    valid = batch.get(D.VALID)
    keep, rate = group_keep_mask(batch.get(D.SUCCESS), valid, group_size=group_size,
                                 min_success=min_success, max_success=max_success)
    out = batch.copy()
    out.set(D.VALID, valid & keep[:, None])
    metrics = {"filter/kept_fraction": keep.float().mean(), "filter/group_success_rate": rate.mean()}
    return out, metrics
