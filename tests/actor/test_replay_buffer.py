"""Replay buffer: on-policy hand-off, reuse of the last K rollouts within the staleness bound, the
memory bound, and the actor's stale-data path through it."""

from __future__ import annotations

import pytest
import torch

from embodirl import data as D
from embodirl.actor.actor import Actor
from embodirl.actor.replay_buffer import ReplayBuffer, batch_nbytes, row_versions

from .helpers import TASKS, TinyTokenPolicy, actor_cfg, grpo, token_batch


def versioned(seed: int, version: int, N: int = 8):
    batch = token_batch(N=N, seed=seed)
    batch.set(D.WEIGHT_VERSION, torch.full((N, 4), version, dtype=torch.int64))
    return batch


def test_on_policy_hand_off_trains_each_rollout_once():
    buffer = ReplayBuffer(reuse_last_k=0, max_staleness=0, max_bytes=None)
    first = versioned(0, 0)
    buffer.add(first)
    assert torch.equal(buffer.sample(0).get(D.STATE), first.get(D.STATE))
    assert len(buffer) == 0 and buffer.nbytes == 0
    with pytest.raises(RuntimeError, match="empty"):
        buffer.sample(1)


def test_reuse_last_k_with_staleness_bound():
    buffer = ReplayBuffer(reuse_last_k=2, max_staleness=1, max_bytes=None)
    for version in range(4):
        buffer.add(versioned(version, version))
    assert len(buffer) == 3  # K + 1 rollouts kept: versions 1, 2, 3
    sample = buffer.sample(current_version=3)
    # version 1 is 2 versions old (> max_staleness): dropped; 2 and 3 are used, newest last
    assert sample.batch_size[0] == 16
    assert row_versions(sample, 3).tolist() == [2] * 8 + [3] * 8
    assert buffer.dropped_rows == 8
    assert len(buffer) == 3  # reuse keeps the rollouts for the next update


def test_row_versions_take_the_oldest_valid_decision():
    batch = versioned(0, 5)
    versions = batch.get(D.WEIGHT_VERSION)
    versions[0, 1] = 3
    batch.get(D.VALID)[1, :] = False
    versions[1, :] = 7
    assert row_versions(batch, 9)[:2].tolist() == [3, 7]
    assert row_versions(token_batch(N=4), 9).tolist() == [9] * 4  # no weight_version: current


def test_memory_bound_evicts_oldest_and_is_reported():
    one = batch_nbytes(versioned(0, 0))
    buffer = ReplayBuffer(reuse_last_k=5, max_staleness=10, max_bytes=2.5 * one)
    for version in range(4):
        buffer.add(versioned(version, version))
    assert len(buffer) == 2 and buffer.nbytes == 2 * one <= buffer.max_bytes
    stats = buffer.stats()
    assert stats["replay/bytes"].item() == 2 * one and stats["replay/rollouts"].item() == 2
    tiny = ReplayBuffer(reuse_last_k=1, max_staleness=1, max_bytes=10)
    tiny.add(versioned(0, 0))  # the newest rollout is always kept, even over the bound
    assert len(tiny) == 1


def test_learner_reuses_rollouts_with_importance_weights():
    policy = TinyTokenPolicy()
    cfg = actor_cfg(grpo(), {"replay_buffer.reuse_last_k": 1, "replay_buffer.max_staleness": 1,
                               "global_batch_size": 8, "micro_batch_size": 4})
    actor = Actor(policy, cfg, task_table=TASKS)
    first = actor.step(token_batch(policy=policy, seed=1))  # no weight_version: stamped 0
    assert first["actor/trajectories"].item() == 8
    second_batch = token_batch(policy=policy, seed=2)
    second_batch.set(D.WEIGHT_VERSION, torch.full((8, 4), actor.version, dtype=torch.int64))
    second = actor.step(second_batch)
    # the first rollout (version 0, now 1 version old) is reused next to the new one
    assert second["actor/trajectories"].item() == 16
    assert second["replay/rollouts"].item() == 2
    assert actor.version == 2


def test_held_rollouts_survive_a_checkpoint(tmp_path):
    """An actor restored from its saved state (weights_only file) trains on the same reused rows."""
    cfg = actor_cfg(grpo(), {"replay_buffer.reuse_last_k": 1, "replay_buffer.max_staleness": 1,
                               "global_batch_size": 8, "micro_batch_size": 8})
    actor = Actor(TinyTokenPolicy(), cfg, task_table=TASKS)
    actor.step(token_batch(seed=1))
    torch.save(actor.state_dict(), tmp_path / "state.pt")
    restored = Actor(TinyTokenPolicy(), cfg, task_table=TASKS)   # same frozen base, fresh trainable state
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert len(restored.replay) == 1 and restored.replay.nbytes == actor.replay.nbytes
    metrics = [x.step(token_batch(seed=2)) for x in (actor, restored)]
    assert metrics[1]["actor/trajectories"].item() == 16    # the held rollout is reused after the restore
    a, b = (x.publish_weights(full=True)[1] for x in (actor, restored))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
