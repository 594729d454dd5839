"""The shared-memory ring: round trip, zero-copy reads, back-pressure, stale references, processes."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import numpy as np
import pytest

from embodirl.channel import segments
from embodirl.channel.shm_channel import ChannelError, ChannelFull, ShmChannel, ShmReader


def _batch(B=4, fill=0):
    rng = np.random.default_rng(fill)
    return {
        "images": rng.integers(0, 256, size=(B, 2, 3, 16, 16), dtype=np.uint8),   # (B, V, C, h, w)
        "state": rng.standard_normal((B, 5)).astype(np.float32),                  # (B, S)
        "task_id": np.arange(B, dtype=np.int64) + fill,                           # (B,)
    }


def test_round_trip_returns_equal_read_only_views():
    batch = _batch(fill=3)
    with ShmChannel(batch, num_slots=2) as channel:
        reader = ShmReader()
        ref = channel.put(batch)
        out = reader.read(ref)
        assert set(out) == set(batch)
        for key in batch:
            np.testing.assert_array_equal(out[key], batch[key])
            assert out[key].dtype == batch[key].dtype
            assert not out[key].flags.writeable
        # the reference is small whatever the batch size: that is what crosses process boundaries
        assert len(pickle.dumps(ref)) < 2048
        reader.release(ref)
        reader.close()


def test_reads_are_views_into_the_slot_not_copies():
    batch = _batch()
    with ShmChannel(batch, num_slots=2) as channel:
        reader = ShmReader()
        ref = channel.put(batch)
        first, second = reader.read(ref), reader.read(ref)
        assert np.shares_memory(first["images"], second["images"])
        assert not np.shares_memory(first["images"], batch["images"])
        # the producer overwriting the slot is visible through the same view: no private copy
        channel._views[ref.slot]["images"][0, 0, 0, 0, 0] = 77
        assert first["images"][0, 0, 0, 0, 0] == 77
        del first, second
        reader.release(ref)
        reader.close()


def test_back_pressure_blocks_until_a_slot_is_released():
    batch = _batch()
    with ShmChannel(batch, num_slots=2) as channel:
        reader = ShmReader()
        refs = [channel.put(batch), channel.put(batch)]
        assert channel.free_slots() == 0
        with pytest.raises(ChannelFull):
            channel.put(batch, timeout=0.05)
        reader.release(refs[0])
        ref = channel.put(batch, timeout=1.0)
        assert ref.slot == refs[0].slot
        reader.release(refs[1])
        reader.release(ref)
        assert channel.free_slots() == 2
        reader.close()


def test_stale_and_double_released_references_are_detected():
    batch = _batch()
    with ShmChannel(batch, num_slots=1) as channel:
        reader = ShmReader()
        old = channel.put(batch)
        reader.release(old)
        reader.release(old)                      # ignored: the slot is not freed twice
        new = channel.put(_batch(fill=9))
        assert new.slot == old.slot and new.seq > old.seq
        with pytest.raises(ChannelError, match="stale"):
            reader.read(old)
        np.testing.assert_array_equal(reader.read(new)["task_id"], _batch(fill=9)["task_id"])
        with pytest.raises(ChannelFull):         # only one slot, and it is held
            channel.put(batch, timeout=0.01)
        reader.release(new)
        reader.close()


def test_layout_mismatch_is_rejected():
    batch = _batch(B=4)
    with ShmChannel(batch, num_slots=1) as channel:
        assert channel.fits(batch)
        assert not channel.fits(_batch(B=3))
        assert not channel.fits({**batch, "state": batch["state"].astype(np.float64)})
        assert not channel.fits({k: v for k, v in batch.items() if k != "state"})
        with pytest.raises(ChannelError, match="does not fit"):
            channel.put(_batch(B=3))


def test_reclaim_frees_slots_a_dead_consumer_held():
    batch = _batch()
    with ShmChannel(batch, num_slots=3) as channel:
        for _ in range(3):
            channel.put(batch)
        assert channel.free_slots() == 0
        channel.reclaim()
        assert channel.free_slots() == 3
        refs = [channel.put(batch, timeout=0.5) for _ in range(3)]
        assert sorted(r.slot for r in refs) == [0, 1, 2]


def _consumer(conn):
    reader = ShmReader()
    while True:
        ref = conn.recv()
        if ref is None:
            break
        views = reader.read(ref)
        conn.send((int(views["task_id"].sum()), int(views["images"].astype(np.int64).sum())))
        del views
        reader.release(ref)
    reader.close()


def test_consumer_in_another_process_reads_and_releases():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child,))
    proc.start()
    try:
        example = _batch()
        with ShmChannel(example, num_slots=2) as channel:
            for i in range(6):   # 3x more batches than slots: only works if the consumer releases them
                batch = _batch(fill=i)
                parent.send(channel.put(batch, timeout=30))
                assert parent.recv() == (int(batch["task_id"].sum()), int(batch["images"].astype(np.int64).sum()))
            parent.send(None)
            proc.join(30)
            assert proc.exitcode == 0
            # the consumer's exit did not unlink the producer's segment (resource-tracker pitfall)
            assert channel.info.segment in segments.listing()
            ref = channel.put(example, timeout=1.0)
            assert ref.seq == 7
    finally:
        if proc.is_alive():
            proc.kill()


def test_a_ring_larger_than_dev_shm_fails_cleanly():
    # a terabyte-sized layout (a broadcast view: no memory behind it); tmpfs cannot back it, so creation
    # fails with ENOSPC at once instead of SIGBUS at the first write, and leaves nothing behind
    before = segments.owned()
    huge = {"images": np.broadcast_to(np.zeros(1, np.uint8), (10**12,))}
    with pytest.raises(OSError):
        ShmChannel(huge, num_slots=1)
    assert segments.owned() == before


def test_send_and_recv_make_a_queue_with_metadata():
    batch = _batch()
    with ShmChannel(batch, num_slots=3) as channel:
        reader = ShmReader()
        assert reader.recv(channel.info, timeout=0.01) is None          # nothing queued yet
        sent = [channel.send(_batch(fill=i), meta=i + 10) for i in range(3)]
        for i, ref in enumerate(sent):
            got, meta = reader.recv(channel.info, timeout=1.0)
            assert (got.slot, got.seq, meta) == (ref.slot, ref.seq, i + 10)   # in order
            np.testing.assert_array_equal(reader.read(got)["task_id"], _batch(fill=i)["task_id"])
            reader.release(got)
        channel.send(batch)
        channel.reclaim()                                               # a dead consumer's queue is dropped
        assert reader.recv(channel.info, timeout=0.01) is None
        reader.close()


def _stream_consumer(info, n, conn):
    reader = ShmReader()
    sums = []
    for _ in range(n):
        ref, meta = reader.recv(info, timeout=30)
        sums.append((meta, int(reader.read(ref)["task_id"].sum())))
        reader.release(ref)
    conn.send(sums)
    reader.close()


def test_streaming_to_another_process_without_any_other_messages():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    example = _batch()
    with ShmChannel(example, num_slots=2) as channel:
        proc = ctx.Process(target=_stream_consumer, args=(channel.info, 8, child))
        proc.start()
        try:
            for i in range(8):   # 4x more batches than slots: the consumer's releases pace the producer
                channel.send(_batch(fill=i), meta=i, timeout=30)
            assert parent.recv() == [(i, int(_batch(fill=i)["task_id"].sum())) for i in range(8)]
            proc.join(30)
            assert proc.exitcode == 0
        finally:
            if proc.is_alive():
                proc.kill()
