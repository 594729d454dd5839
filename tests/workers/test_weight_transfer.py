"""Weight publication from the actor group's rank 0: the packed buffer round-trips every dtype (bf16
included) exactly, through shared memory on rank 0's node and through Ray's object store elsewhere, and
a real inference worker applies it."""

from __future__ import annotations

import pytest
import torch

from embodirl.channel import segments
from embodirl.workers.weight_sync import WeightPublisher
from embodirl.workers.weight_transfer import OBJECT_STORE, SHM, WeightOutbox, pack, receive, unpack


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"lora_A": torch.randn(3, 5, generator=g), "head.bias": torch.randn(7, generator=g).to(torch.bfloat16),
            "scale": torch.tensor(2.5, dtype=torch.float64), "ids": torch.arange(5, dtype=torch.int64)}


def test_pack_round_trips_every_dtype_exactly():
    tensors = _tensors()
    layout, buffer = pack(tensors)
    assert all(offset % 64 == 0 for _, _, _, offset, _ in layout)
    out = unpack(layout, buffer.numpy().tobytes())
    assert out.keys() == tensors.keys()
    for name, value in tensors.items():
        assert out[name].dtype == value.dtype and torch.equal(out[name], value), name


def test_shared_memory_on_rank0s_node_and_object_store_elsewhere(ray_local):
    update = WeightPublisher().reset(_tensors(), version=4)
    outbox = WeightOutbox(node_id="node-a")
    handle = outbox.post(update, {"node-a", "node-b"})
    assert handle.segment is not None and handle.refs
    here, path = receive(handle, node_id="node-a")
    there, path_there = receive(handle, node_id="node-b")
    assert (path, path_there) == (SHM, OBJECT_STORE)
    for got in (here, there):
        assert got.version == 4 and got.full
        assert all(torch.equal(got.tensors[k], v) for k, v in _tensors().items())
    # a publication for this node only needs no object-store copy; the previous segment is released
    old = handle.segment
    second = outbox.post(WeightPublisher().reset(_tensors(), version=5), {"node-a"})
    assert second.refs == [] and second.segment != old and old not in segments.listing()
    outbox.close()
    assert second.segment not in segments.listing()
    with pytest.raises(RuntimeError, match="other nodes"):
        receive(second, node_id="node-b")
