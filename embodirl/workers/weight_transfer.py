"""Moving a published :class:`~embodirl.workers.weight_sync.WeightUpdate` from the actor group's rank 0
to every inference worker, without the driver touching the tensors.

Rank 0 packs the update's tensors into one flat byte buffer once and describes it in a small
:class:`WeightHandle` (names, dtypes, shapes, offsets, version) that the driver forwards:

* inference workers on rank 0's Ray node map a shared-memory segment rank 0 wrote
  (:mod:`embodirl.channel.segments`; it lives until the next publication, and the run's janitor
  removes it however the run ends);
* inference workers on other nodes ``ray.get`` one object-store copy rank 0 put (Ray moves it between
  nodes once per node);
* an inference worker on the same GPU as rank 0 (collocated placement on GPUs) opens a CUDA IPC handle
  of rank 0's packed device buffer instead: no copy through host memory. (Written for GPUs, exercised
  on CPU machines only through the other two paths.)

bf16 tensors travel as raw bytes (numpy has no bf16). :func:`receive` turns a handle back into a
``WeightUpdate`` on the receiving side and says which path it took.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from embodirl.channel import segments
from embodirl.workers.weight_sync import WeightUpdate

log = logging.getLogger(__name__)

SHM, OBJECT_STORE, CUDA_IPC, INLINE = "shm", "object_store", "cuda_ipc", "inline"
_ALIGN = 64


@dataclass
class WeightHandle:
    """Where a packed update lies, plus what is needed to unpack it (no tensor data)."""

    version: int
    base_version: int
    full: bool
    layout: list[tuple[str, str, tuple[int, ...], int, int]]     # name, dtype, shape, offset, nbytes
    nbytes: int
    node_id: str | None = None          # rank 0's Ray node
    segment: str | None = None          # shared-memory segment on node_id
    refs: list = field(default_factory=list)   # [ObjectRef] of the packed buffer (other nodes)
    cuda_ipc: tuple | None = None       # (device uuid, torch's rebuild function and arguments)
    inline: np.ndarray | None = None    # the buffer itself (in-process delivery)


def pack(tensors: dict[str, torch.Tensor]) -> tuple[list, torch.Tensor]:
    """``(layout, uint8 buffer)``: every tensor's bytes at a 64-byte aligned offset."""
    layout, offset = [], 0
    parts = []
    for name, tensor in tensors.items():
        t = tensor.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        layout.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        parts.append((offset, t))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    device = parts[0][1].device if parts else torch.device("cpu")
    buffer = torch.empty(max(offset, 1), dtype=torch.uint8, device=device)
    for start, t in parts:
        buffer[start:start + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
    return layout, buffer


def unpack(layout: list, buffer) -> dict[str, torch.Tensor]:
    """Tensors (copies, on the buffer's device) from :func:`pack`'s layout and a byte buffer."""
    flat = buffer if isinstance(buffer, torch.Tensor) else torch.frombuffer(memoryview(buffer), dtype=torch.uint8)
    out = {}
    for name, dtype, shape, offset, nbytes in layout:
        out[name] = flat[offset:offset + nbytes].view(getattr(torch, dtype)).reshape(shape).clone()
    return out


class WeightOutbox:
    """Rank 0's side: packs each update once and makes it reachable by the consumers' nodes."""

    def __init__(self, node_id: str | None, device: torch.device | None = None):
        self.node_id = node_id
        self.device = device          # rank 0's device: a consumer on the same GPU reads it there
        self._segment: str | None = None      # the latest publication's segment (released at the next one)
        self._device_buffer: torch.Tensor | None = None

    def post(self, update: WeightUpdate, consumer_nodes: set[str | None], *, inline: bool = False,
             consumer_gpus: set[str] | None = None) -> WeightHandle:
        layout, buffer = pack(update.tensors)
        handle = WeightHandle(update.version, update.base_version, update.full, layout, int(buffer.numel()),
                              node_id=self.node_id)
        device = self.device
        if device is not None and device.type == "cuda" and consumer_gpus and _gpu_uuid(device) in consumer_gpus:
            from torch.multiprocessing.reductions import reduce_tensor

            self._device_buffer = buffer.to(device)     # must outlive the consumers' reads
            handle.cuda_ipc = (_gpu_uuid(device), reduce_tensor(self._device_buffer))
        host = buffer.cpu().numpy()
        if inline:
            handle.inline = host
            return handle
        if self._segment is not None:
            segments.release(self._segment)
            self._segment = None
        if self.node_id in consumer_nodes:
            segment = segments.create(host.nbytes, tag="weights")
            np.frombuffer(segment.buf, dtype=np.uint8, count=host.nbytes)[:] = host
            handle.segment = self._segment = segment.name
        if any(node != self.node_id for node in consumer_nodes):
            import ray

            handle.refs = [ray.put(host)]
        return handle

    def close(self) -> None:
        if self._segment is not None:
            segments.release(self._segment)
            self._segment = None
        self._device_buffer = None


def receive(handle: WeightHandle, *, node_id: str | None, device: torch.device | None = None
            ) -> tuple[WeightUpdate, str]:
    """The update a handle describes, read the cheapest way from this process, and the path taken."""
    if handle.cuda_ipc is not None and device is not None and device.type == "cuda" \
            and handle.cuda_ipc[0] == _gpu_uuid(device):
        rebuild, args = handle.cuda_ipc[1]
        tensors, path = unpack(handle.layout, rebuild(*args)), CUDA_IPC
    elif handle.inline is not None:
        tensors, path = unpack(handle.layout, handle.inline), INLINE
    elif handle.segment is not None and node_id == handle.node_id:
        segment = segments.attach(handle.segment)
        try:
            view = np.frombuffer(segment.buf, dtype=np.uint8, count=handle.nbytes)
            tensors = unpack(handle.layout, torch.from_numpy(view))
            del view
        finally:
            segment.close()
        path = SHM
    elif handle.refs:
        import ray

        tensors, path = unpack(handle.layout, torch.from_numpy(np.asarray(ray.get(handle.refs[0])))), OBJECT_STORE
    else:
        raise RuntimeError(f"weights v{handle.version} were published for other nodes than {node_id}")
    return WeightUpdate(version=handle.version, base_version=handle.base_version, tensors=tensors,
                        full=handle.full), path


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)
