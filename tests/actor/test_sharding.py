"""Splitting a prepared batch over actor ranks: whole groups, equal row counts, padding that adds
nothing, and results put back in batch order."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from embodirl import data as D
from embodirl.actor import sharding


def _batch(group_ids: list[int], T: int = 3) -> TensorDict:
    N = len(group_ids)
    return TensorDict({D.VALID: torch.ones(N, T, dtype=torch.bool),
                       D.GROUP_ID: torch.tensor(group_ids)[:, None].expand(N, T).clone(),
                       "x": torch.arange(N * T, dtype=torch.float32).reshape(N, T)}, batch_size=[N, T])


def test_groups_stay_whole_and_shards_are_padded_to_one_length():
    # 5 groups of 2 rows (as group filtering can leave them) over 2 ranks: 3 + 2 groups, one padded pair
    batch = _batch([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    shards, indices = sharding.shard(batch, 2)
    assert [len(ix) for ix in indices] == [6, 6]
    assert indices[0].tolist() == [0, 1, 2, 3, sharding.PAD, sharding.PAD]
    assert indices[1].tolist() == [4, 5, 6, 7, 8, 9]
    for shard, ix in zip(shards, indices):
        real = ix != sharding.PAD
        ids = shard.get(D.GROUP_ID)[:, 0][real]
        # every group present in a shard is present with all its rows
        for g in ids.unique():
            assert int((ids == g).sum()) == 2
        assert not shard.get(D.VALID)[~real].any()              # padding rows hold no decision
        assert torch.equal(shard.get("x")[real], batch.get("x")[ix[real]])
    # results come back in batch order; padding is dropped
    back = sharding.unshard([s.get("x") for s in shards], indices, 10)
    assert torch.equal(back, batch.get("x"))


def test_one_rank_keeps_the_batch_and_rows_without_groups_split_evenly():
    batch = _batch([7, 8, 9, 10])
    shards, indices = sharding.shard(batch, 1)
    assert shards[0] is batch and indices[0].tolist() == [0, 1, 2, 3]
    rows = TensorDict({D.VALID: torch.ones(4, 2, dtype=torch.bool)}, batch_size=[4, 2])
    assert [ix.tolist() for ix in sharding.shard(rows, 2)[1]] == [[0, 1], [2, 3]]


def test_rollouts_concatenated_per_step_keep_their_groups_apart():
    # two rollouts of a step, each numbering its groups from 0: a change of id is a new group
    batch = _batch([0, 0, 1, 1, 0, 0, 1, 1])
    _, indices = sharding.shard(batch, 2)
    assert [ix.tolist() for ix in indices] == [[0, 1, 2, 3], [4, 5, 6, 7]]
