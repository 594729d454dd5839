"""Splitting a prepared batch ``[N, T]`` over the actor's data-parallel ranks.

Each rank gets a contiguous run of whole groups (rows that share a ``group_id``: a GRPO group never
straddles two ranks), and every rank the same number of rows: shards that come out shorter (group
filtering can leave a number of groups that does not divide evenly) are padded with rows whose
``valid`` mask is all False. Padding rows take part in the collectives but add nothing to any loss,
normaliser or metric (:mod:`embodirl.algorithms.aggregation` counts valid units only), so the summed
gradient equals the one a single rank computes on the whole batch.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from embodirl import data as D

PAD = -1


def shard_indices(group_ids: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Row indices per rank (``PAD`` for padding rows), all of one length. ``group_ids`` ``(N,)``:
    rows of a group must be contiguous (as collection and group filtering leave them)."""
    N = int(group_ids.numel())
    ids = group_ids.tolist()
    starts = [0] + [i for i in range(1, N) if ids[i] != ids[i - 1]]
    bounds = starts + [N]
    groups = [(bounds[k], bounds[k + 1]) for k in range(len(starts))]
    K = len(groups)
    per_rank = []
    for r in range(world_size):
        mine = groups[r * K // world_size:(r + 1) * K // world_size]
        per_rank.append(torch.tensor([i for a, b in mine for i in range(a, b)], dtype=torch.long))
    rows = max(max((len(ix) for ix in per_rank), default=0), 1)
    return [torch.cat([ix, torch.full((rows - len(ix),), PAD, dtype=torch.long)]) for ix in per_rank]


def take(batch: TensorDict, index: torch.Tensor) -> TensorDict:
    """The rows ``index`` of ``batch``; ``PAD`` entries become copies of row 0 with no valid decision."""
    pad = index == PAD
    shard = batch[index.clamp(min=0)].clone()
    if pad.any():
        valid = shard.get(D.VALID).clone()
        valid[pad] = False
        shard.set(D.VALID, valid)
    return shard


def group_ids(batch: TensorDict) -> torch.Tensor:
    """``group_id`` of every row (each row its own group when the batch has none)."""
    if D.GROUP_ID in batch.keys():
        ids = batch.get(D.GROUP_ID)
        return ids.reshape(ids.shape[0], -1)[:, 0]      # (N,): stored per decision, constant along T
    return torch.arange(batch.batch_size[0])


def shard(batch: TensorDict, world_size: int) -> tuple[list[TensorDict], list[torch.Tensor]]:
    """(one shard per rank, the row indices each came from)."""
    if world_size == 1:
        return [batch], [torch.arange(batch.batch_size[0])]
    indices = shard_indices(group_ids(batch), world_size)
    return [take(batch, ix) for ix in indices], indices


def unshard(parts: list[torch.Tensor], indices: list[torch.Tensor], N: int) -> torch.Tensor:
    """Per-rank row results back into batch order ``(N, ...)`` (padding rows dropped)."""
    first = parts[0]
    out = first.new_zeros((N, *first.shape[1:]))
    for part, ix in zip(parts, indices):
        keep = ix != PAD
        out[ix[keep]] = part[keep]
    return out
