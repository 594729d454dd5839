"""How data moves between workers: the collector's inference clients, and trajectories going home.

Decisions (an env worker asking its inference worker):

* :class:`LocalClient` - the inference worker is an object in this process (zero remote workers). With
  ``background=True`` decisions run on one thread so pipeline stages still overlap.
* :class:`~embodirl.workers.stream.StreamClient` - the inference worker runs on Ray on the same
  node: observation batches and answers travel through shared-memory rings, no Ray message per
  decision (``rollout.channel.shm: true``, the default);
* :class:`RayClient` - the inference worker runs on Ray on another node (or shared memory is off):
  every decision is a Ray call carrying the batch through Ray's object store; the answer (a few KB)
  is the call's return value, which Ray sends inline with the reply.

Trajectories travel back to the driver once per rollout as the return value of the env worker's
call, packed as a dict of numpy arrays (:func:`pack_trajectory`): Ray stores numpy buffers in its
object store without pickling them and the driver maps them, about 10x faster than sending the
``TensorDict`` itself for a LIBERO-sized batch. Both choices are measured in
``scripts/bench/bench_workers.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from embodirl.rollout.inference import Done, FutureResult, Pending, PolicyOutput
from embodirl.workers.deadlines import CallTimes

log = logging.getLogger(__name__)


def pack_trajectory(traj) -> dict:
    """A trajectory ``TensorDict`` as ``{"batch_size": [N, T], "fields": {"key" or "extras.key": array}}``."""
    flat = traj.flatten_keys(".")
    return {"batch_size": list(traj.batch_size), "fields": {k: flat.get(k).numpy() for k in flat.keys()}}


def unpack_trajectory(packed: dict):
    """Inverse of :func:`pack_trajectory`; copies out of the (read-only) object-store buffers."""
    import torch
    from tensordict import TensorDict

    fields = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in packed["fields"].items()}
    return TensorDict(fields, batch_size=packed["batch_size"]).unflatten_keys(".")


class InferenceWorkerDied(RuntimeError):
    """The inference worker serving this env worker died during a decision."""


class InferenceWorkerHung(RuntimeError):
    """The inference worker serving this env worker is alive but did not answer a decision within its deadline
    (:mod:`embodirl.workers.deadlines`); the message says how long it was given, and why."""


class LocalClient:
    """In-process client over a :class:`~embodirl.workers.inference_worker.InferenceWorker` object."""

    def __init__(self, worker, *, mode: str = "train", background: bool = False):
        self.worker = worker
        self.mode = mode
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embodirl-rollout") if background else None

    def request(self, obs: Mapping[str, np.ndarray], *, return_value: bool = False) -> Pending:
        if self._pool is None:
            return Done(self.worker.infer(obs, return_value=return_value, mode=self.mode))
        snapshot = {k: np.array(v, copy=True) for k, v in obs.items()}
        return FutureResult(self._pool.submit(self.worker.infer, snapshot, return_value=return_value, mode=self.mode))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


DECISION = "decision"      # the kind of call (deadlines) of one answered batch


class _RayPending:
    def __init__(self, ref, times: CallTimes):
        self._ref, self._times, self._sent = ref, times, time.monotonic()

    def result(self) -> PolicyOutput:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        limit = self._times.limit(DECISION)
        left = None if limit is None else max(0.0, self._sent + limit - time.monotonic())
        try:
            out = ray.get(self._ref, timeout=left)
        except RayActorError as exc:
            raise InferenceWorkerDied(f"inference worker died: {exc}") from exc
        except GetTimeoutError:
            raise InferenceWorkerHung(f"did not answer a decision within {limit:.1f} s "
                                      f"({self._times.describe(DECISION)})") from None
        self._times.record(DECISION, time.monotonic() - self._sent)
        return out


class RayClient:
    """Client over a Ray inference worker's handle through Ray's object store: each decision is one
    Ray call whose argument is the batch (the path between nodes, or with
    ``rollout.channel.shm: false``). ``deadline``: the typed ``runner.worker_deadline`` section (None: wait)."""

    def __init__(self, worker, *, mode: str = "train", deadline=None):
        self.worker = worker
        self.mode = mode
        self.batches = 0
        self.times = CallTimes(deadline)

    def request(self, obs: Mapping[str, np.ndarray], *, return_value: bool = False) -> Pending:
        self.batches += 1
        return _RayPending(self.worker.infer.remote(dict(obs), return_value=return_value, mode=self.mode), self.times)

    def info(self) -> dict:
        return {"shm": False, "stream": False, "segment": None, "shm_batches": 0, "ray_batches": self.batches,
                "fallbacks": 0}

    def reconnect(self, worker) -> None:
        self.worker = worker

    def close(self) -> None:
        pass
