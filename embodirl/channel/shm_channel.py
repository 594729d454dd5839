"""A bounded ring of preallocated shared-memory slots carrying observation batches on one node.

The producer (an env worker) owns the ring: one segment holding ``num_slots`` slots, each laid out
for one observation batch (a dict of fixed-shape numpy arrays, e.g. ``images [B,V,C,h,w]``,
``state [B,S]``, ``task_id [B]``), plus two FIFOs: the free slots, and the batches ready to read.
:meth:`ShmChannel.put` waits for a free slot (back-pressure: at most ``num_slots`` batches are in
flight), copies the batch in and returns a small picklable :class:`ShmRef`. The reference reaches the
consumer either through whatever else connects the two (a Ray call argument: a few hundred bytes
instead of megabytes), or through the ring itself: :meth:`ShmChannel.send` also queues the reference
(with a small integer of metadata) on the ready FIFO, where :meth:`ShmReader.recv` picks it up - a
queue between two processes with no other messaging at all. The consumer (:class:`ShmReader`) maps
the segment once and returns numpy *views* into the slot - no copy - and hands the slot back with
:meth:`ShmReader.release` once it no longer reads them.

Segment layout::

    [ header: int64 seq[num_slots] | slot 0 | slot 1 | ... ]     slot k: field arrays, 64-byte aligned

``seq[k]`` is the sequence number of the batch in slot ``k`` (``-seq`` once released, 0 when free
after :meth:`ShmChannel.reclaim`), so a stale or repeated reference is detected instead of read.
Every name lives under ``/dev/shm`` with the run prefix of :mod:`embodirl.channel.segments`, which
guarantees cleanup.
"""

from __future__ import annotations

import errno
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from embodirl.channel import segments
from embodirl.channel.readiness import wait_readable

ALIGN = 64                      # bytes: cache-line alignment of every field in a slot
_SLOT_ID = struct.Struct("<i")      # a free-slot id as written to the free FIFO (atomic: < PIPE_BUF)
_READY = struct.Struct("<iiq")      # slot, metadata, seq of a sent batch on the ready FIFO (16 bytes)


class ChannelError(RuntimeError):
    """A reference does not match the slot's content (stale, released twice, wrong channel)."""


class ChannelFull(TimeoutError):
    """No slot became free within the timeout: the consumer is not releasing slots."""


@dataclass(frozen=True)
class FieldLayout:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int   # bytes from the slot's start

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class ChannelInfo:
    """Everything a consumer needs to map the ring (small and picklable)."""

    segment: str
    fifo: str          # free slots
    ready: str         # sent batches
    num_slots: int
    slot_bytes: int
    header_bytes: int
    fields: tuple[FieldLayout, ...]

    def slot_offset(self, slot: int) -> int:
        return self.header_bytes + slot * self.slot_bytes


@dataclass(frozen=True)
class ShmRef:
    """A batch in a slot: what travels from producer to consumer instead of the data."""

    info: ChannelInfo
    slot: int
    seq: int


def _round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def layout_of(example: Mapping[str, np.ndarray]) -> tuple[tuple[FieldLayout, ...], int]:
    """Field layouts of one slot for batches shaped like ``example``, and the slot size in bytes."""
    fields, offset = [], 0
    for name in sorted(example):
        arr = np.asarray(example[name])
        fields.append(FieldLayout(name, tuple(arr.shape), arr.dtype.str, offset))
        offset = _round_up(offset + arr.nbytes)
    return tuple(fields), max(offset, ALIGN)


def is_array_batch(batch: Mapping) -> bool:
    return all(isinstance(v, np.ndarray) and v.dtype != object for v in batch.values())


class ShmChannel:
    """Producer side: owns the ring (see module docstring).

    ``example`` fixes the layout: every later batch must have the same keys, shapes and dtypes
    (:meth:`fits`). ``tag`` is a readable part of the segment name.
    """

    def __init__(self, example: Mapping[str, np.ndarray], num_slots: int, tag: str = "obs"):
        if num_slots < 1:
            raise ValueError(f"a channel needs at least one slot, got {num_slots}")
        fields, slot_bytes = layout_of(example)
        header_bytes = _round_up(8 * num_slots)
        self._shm = segments.create(header_bytes + num_slots * slot_bytes, tag)
        free_path = segments.create_fifo(tag + "-free")
        ready_path = segments.create_fifo(tag + "-ready")
        # O_RDWR on a FIFO (Linux) opens without waiting for a peer and keeps it usable when a peer dies.
        self._fifo = os.open(free_path, os.O_RDWR | os.O_NONBLOCK)
        self._ready = os.open(ready_path, os.O_RDWR | os.O_NONBLOCK)
        self.info = ChannelInfo(self._shm.name, free_path.name, ready_path.name, num_slots, slot_bytes,
                                header_bytes, fields)
        # (num_slots,); None once closed (the view must go before the segment can be unmapped)
        self._seq_header: np.ndarray | None = np.ndarray((num_slots,), np.int64, buffer=self._shm.buf)
        self._views = [_slot_views(self._shm.buf, self.info, k) for k in range(num_slots)]
        self._next_seq = 1
        self._closed = False
        self.reclaim()

    @property
    def num_slots(self) -> int:
        return self.info.num_slots

    def fits(self, batch: Mapping) -> bool:
        """Whether ``batch`` has exactly this channel's keys, shapes and dtypes."""
        if len(batch) != len(self.info.fields) or not is_array_batch(batch):
            return False
        for f in self.info.fields:
            arr = batch.get(f.name)
            if arr is None or tuple(arr.shape) != f.shape or arr.dtype.str != f.dtype:
                return False
        return True

    def put(self, batch: Mapping[str, np.ndarray], timeout: float | None = None) -> ShmRef:
        """Copy ``batch`` into a free slot (waiting for one, at most ``timeout`` seconds) and return its
        reference. Raises :class:`ChannelFull` on timeout."""
        if not self.fits(batch):
            raise ChannelError(f"batch {_describe(batch)} does not fit channel layout {_describe_layout(self.info)}")
        slot = self._acquire(timeout)
        views = self._views[slot]
        for name, dst in views.items():
            np.copyto(dst, batch[name], casting="no")
        seq = self._next_seq
        self._next_seq += 1
        assert self._seq_header is not None, "the channel is closed"
        self._seq_header[slot] = seq
        return ShmRef(self.info, slot, seq)

    def send(self, batch: Mapping[str, np.ndarray], meta: int = 0, timeout: float | None = None) -> ShmRef:
        """:meth:`put` and queue the reference, with ``meta`` (an int32 the consumer gets back), for
        :meth:`ShmReader.recv`. The ready FIFO never blocks: it holds far more entries than slots."""
        ref = self.put(batch, timeout)
        os.write(self._ready, _READY.pack(ref.slot, int(meta), ref.seq))
        return ref

    def free_slots(self) -> int:
        """Slots not holding an unreleased batch (a snapshot)."""
        assert self._seq_header is not None, "the channel is closed"
        return int(np.count_nonzero(self._seq_header <= 0))

    def reclaim(self) -> None:
        """Mark every slot free again and forget queued batches. Only when no consumer is reading (e.g.
        it died mid-batch)."""
        _drain(self._fifo)
        _drain(self._ready)
        assert self._seq_header is not None, "the channel is closed"
        self._seq_header[:] = 0
        os.write(self._fifo, b"".join(_SLOT_ID.pack(k) for k in range(self.num_slots)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._views = []
        self._seq_header = None
        for fd in (self._fifo, self._ready):
            try:
                os.close(fd)
            except OSError:
                pass
        for name in (self.info.segment, self.info.fifo, self.info.ready):
            segments.release(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # --- free list -------------------------------------------------------------------------------
    def _acquire(self, timeout: float | None) -> int:
        data = _read_record(self._fifo, _SLOT_ID.size, timeout)
        if data is None:
            raise ChannelFull(f"no free slot in channel {self.info.segment} after {timeout:.3g}s: "
                              f"all {self.num_slots} slots are held by the consumer")
        (slot,) = _SLOT_ID.unpack(data)
        return slot


def _read_record(fd: int, size: int, timeout: float | None) -> bytes | None:
    """One ``size``-byte record from the non-blocking FIFO ``fd`` (a free slot's id, a ready batch's entry), waiting
    at most ``timeout`` seconds (None: for ever) for one to arrive; None on timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            data = os.read(fd, size)
        except BlockingIOError:
            data = b""
        if data:
            return data
        wait = None if deadline is None else deadline - time.monotonic()
        if wait is not None and wait <= 0:
            return None
        wait_readable([fd], wait)


def _drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 4096):
                return
        except BlockingIOError:
            return
        except OSError as exc:  # pragma: no cover
            if exc.errno == errno.EAGAIN:
                return
            raise


class _Mapped:
    """A consumer's mapping of one ring."""

    def __init__(self, info: ChannelInfo):
        self.shm = segments.attach(info.segment)
        self.fifo = os.open(segments.SHM_DIR / info.fifo, os.O_RDWR | os.O_NONBLOCK)
        self.ready = os.open(segments.SHM_DIR / info.ready, os.O_RDWR | os.O_NONBLOCK)
        self.views = [_slot_views(self.shm.buf, info, k, readonly=True) for k in range(info.num_slots)]
        # (num_slots,); None once closed (a closed mapping has left ShmReader._maps)
        self.seq_header: np.ndarray | None = np.ndarray((info.num_slots,), np.int64, buffer=self.shm.buf)

    def close(self) -> None:
        # drop our own views first, or the segment cannot be unmapped
        self.views, self.seq_header = [], None
        for fd in (self.fifo, self.ready):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            self.shm.close()
        except BufferError:  # a caller still holds a view; the mapping goes with the process
            pass


class ShmReader:
    """Consumer side: maps rings by name on first use and returns zero-copy views."""

    def __init__(self) -> None:
        self._maps: dict[str, _Mapped] = {}

    def read(self, ref: ShmRef) -> dict[str, np.ndarray]:
        """Views into the slot (valid until :meth:`release`; do not write to them)."""
        mapped = self._map(ref.info)
        assert mapped.seq_header is not None, "mapped rings are open"
        held = int(mapped.seq_header[ref.slot])
        if held != ref.seq:
            raise ChannelError(f"slot {ref.slot} of {ref.info.segment} holds batch {held}, not {ref.seq}: "
                               "the reference is stale or was released")
        return mapped.views[ref.slot]

    def release(self, ref: ShmRef) -> None:
        """Hand the slot back to the producer (a second release of the same reference is ignored)."""
        mapped = self._map(ref.info)
        assert mapped.seq_header is not None, "mapped rings are open"
        if mapped.seq_header[ref.slot] != ref.seq:
            return
        mapped.seq_header[ref.slot] = -ref.seq
        os.write(mapped.fifo, _SLOT_ID.pack(ref.slot))

    def recv(self, info: ChannelInfo, timeout: float | None = None) -> tuple[ShmRef, int] | None:
        """The next batch :meth:`ShmChannel.send` queued on ``info``'s ring and its metadata, waiting at
        most ``timeout`` seconds (None: forever); None on timeout."""
        data = _read_record(self._map(info).ready, _READY.size, timeout)
        if data is None:
            return None
        slot, meta, seq = _READY.unpack(data)
        return ShmRef(info, slot, seq), meta

    def ready_fd(self, info: ChannelInfo) -> int:
        """A file descriptor that is readable while ``info``'s ring has queued batches (for select)."""
        return self._map(info).ready

    def forget(self, prefix: str) -> None:
        """Unmap every ring whose segment name starts with ``prefix`` (its producer is gone)."""
        for name in [n for n in self._maps if n.startswith(prefix)]:
            self._maps.pop(name).close()

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        for mapped in maps.values():
            mapped.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _map(self, info: ChannelInfo) -> _Mapped:
        mapped = self._maps.get(info.segment)
        if mapped is None:
            mapped = self._maps[info.segment] = _Mapped(info)
        return mapped


def _slot_views(buf, info: ChannelInfo, slot: int, readonly: bool = False) -> dict[str, np.ndarray]:
    base = info.slot_offset(slot)
    views = {}
    for f in info.fields:
        arr = np.ndarray(f.shape, np.dtype(f.dtype), buffer=buf, offset=base + f.offset)
        if readonly:
            arr.flags.writeable = False
        views[f.name] = arr
    return views


def _describe(batch: Mapping) -> str:
    return "{" + ", ".join(f"{k}: {getattr(v, 'dtype', type(v).__name__)}{list(getattr(v, 'shape', []))}"
                           for k, v in sorted(batch.items())) + "}"


def _describe_layout(info: ChannelInfo) -> str:
    return "{" + ", ".join(f"{f.name}: {np.dtype(f.dtype)}{list(f.shape)}" for f in info.fields) + "}"
