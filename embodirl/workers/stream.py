"""The shared-memory stream between an env worker and its inference worker on one node.

Per decision no Ray message is sent: the env worker (:class:`StreamClient`) writes the observation
batch into its request ring and queues it (:meth:`ShmChannel.send`); a thread of the inference worker
(:class:`StreamServer`) waits on every connected request ring at once, runs the engine on zero-copy
views, and writes the answer (action chunk, policy-space actions, log-probs, values, weight version)
into a response ring it owns for that env worker, which the env worker reads back. Ray carries only
the one call that opens the stream (it also answers the first decision) and, when an answer is slow,
a liveness check of the inference worker.

Answers are matched to requests by the request's sequence number, so a client may hold several
requests in flight (one per pipeline stage) and collect them in any order. Request metadata (an int
on the ready queue) says whether values are wanted and whether to sample for evaluation.

Faults: if the inference worker dies, the client notices at once (it waits on the worker's pidfd next to
the response queue; where pidfds do not exist, a Ray liveness check after ``LIVENESS_CHECK_S``) and
raises :class:`~embodirl.workers.transport.InferenceWorkerDied`; after the group restarts it, :meth:`reconnect`
frees the request slots the dead worker held and the next request opens a new stream. If an env
worker dies, the group tells the inference worker to :meth:`StreamServer.close_matching` its rings. An inference
worker that is alive but does not answer a batch within its deadline (``runner.worker_deadline``, from the recent
answers' times: :mod:`embodirl.workers.deadlines`) raises :class:`~embodirl.workers.transport.InferenceWorkerHung`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Mapping

import numpy as np

from embodirl.channel.readiness import wait_readable
from embodirl.channel.shm_channel import ChannelInfo, ShmChannel, ShmReader, ShmRef
from embodirl.rollout.inference import Done, Pending, PolicyOutput
from embodirl.workers.deadlines import CallTimes

log = logging.getLogger(__name__)

WANT_VALUE, EVAL_MODE = 1, 2        # request metadata bits
OPEN = "open_stream"                # the kind of call (deadlines) that opens a stream and answers its first batch
LIVENESS_CHECK_S = 5.0              # without a pidfd: an answer this slow triggers a Ray liveness check
SEND_TIMEOUT_S = 60.0               # a response ring that stays full this long: its client is gone
# bookkeeping entries of a response batch (policy fields are the rest)
_SEQ, _VERSION, _INFER_S, _ERROR = "_request_seq", "_weight_version", "_infer_s", "_error"


def request_meta(return_value: bool, mode: str) -> int:
    return (WANT_VALUE if return_value else 0) | (EVAL_MODE if mode == "eval" else 0)


def _response_batch(fields: Mapping[str, np.ndarray], seq: int, version: int, infer_s: float,
                    error: bool = False) -> dict[str, np.ndarray]:
    batch = {k: np.ascontiguousarray(v) for k, v in fields.items()}
    batch[_SEQ] = np.array([seq], np.int64)
    batch[_VERSION] = np.array([version], np.int64)
    batch[_INFER_S] = np.array([infer_s], np.float64)
    batch[_ERROR] = np.array([int(error)], np.int64)
    return batch


# --------------------------------------------------------------------------------------------------
# inference-worker side
# --------------------------------------------------------------------------------------------------
class _Stream:
    def __init__(self, request: ChannelInfo, response: ShmChannel, template: dict[str, np.ndarray]):
        self.request = request
        self.response = response
        self.template = template        # a response batch with every field (errors reuse its shapes)


class StreamServer:
    """Serves request rings on one thread.

    ``decide(obs, want_value, mode) -> PolicyOutput`` answers one batch; it is called with zero-copy
    views of the request slot. With a value head (``has_value``) values are always computed so that
    every answer has the same layout; the client drops them when they were not asked for.
    """

    def __init__(self, decide: Callable[[Mapping[str, np.ndarray], bool, str], PolicyOutput], has_value: bool):
        self._decide = decide
        self._has_value = has_value
        self._reader = ShmReader()
        self._streams: dict[str, _Stream] = {}      # request segment -> stream
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._running = False
        self.served = 0

    def open(self, request: ChannelInfo, first: ShmRef, meta: int) -> tuple[ChannelInfo, PolicyOutput, int]:
        """Answer the first request of a new stream and create its response ring; returns the ring's
        description (for the client), the answer and this process's pid (for the client's death watch)."""
        with self._lock:
            old = self._streams.pop(request.segment, None)
            if old is not None:
                old.response.close()
            try:
                out = self._decide(self._reader.read(first), self._has_value, "eval" if meta & EVAL_MODE else "train")
            finally:
                self._reader.release(first)
            template = _response_batch(out.fields, first.seq, out.weight_version, 0.0)
            response = ShmChannel(template, num_slots=request.num_slots, tag="resp")
            self._streams[request.segment] = _Stream(request, response, template)
        self._ensure_thread()
        return response.info, out, os.getpid()

    def close_matching(self, prefix: str) -> None:
        """Close the streams whose request ring's name starts with ``prefix`` (their client is gone)."""
        with self._lock:
            for name in [n for n in self._streams if n.startswith(prefix)]:
                self._streams.pop(name).response.close()
            self._reader.forget(prefix)
        self._wake()

    def close(self) -> None:
        self._running = False
        self._wake()
        if self._thread is not None:
            self._thread.join(10)
        with self._lock:
            for stream in self._streams.values():
                stream.response.close()
            self._streams.clear()
            self._reader.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # --- the serving thread ------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._running = True
            self._thread = threading.Thread(target=self._loop, name="embodirl-stream-server", daemon=True)
            self._thread.start()
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _loop(self) -> None:
        while self._running:
            with self._lock:
                waiting = {self._reader.ready_fd(s.request): name for name, s in self._streams.items()}
            try:
                readable = wait_readable([self._wake_r, *waiting], 1.0)
            except OSError:   # a ring was closed while we waited: look again
                continue
            if self._wake_r in readable:
                try:
                    os.read(self._wake_r, 4096)
                except OSError:   # closed by close() while this loop ends
                    continue
            for fd in readable:
                name = waiting.get(fd)
                if name is not None:
                    self._serve_one(name)

    def _serve_one(self, name: str) -> None:
        with self._lock:
            stream = self._streams.get(name)
            if stream is None:
                return
            msg = self._reader.recv(stream.request, timeout=0)
            if msg is None:
                return
            ref, meta = msg
            t0 = time.perf_counter()
            try:
                out = self._decide(self._reader.read(ref), self._has_value, "eval" if meta & EVAL_MODE else "train")
                answer = _response_batch(out.fields, ref.seq, out.weight_version, time.perf_counter() - t0)
            except Exception:
                log.error("inference worker failed on a streamed batch:\n%s", traceback.format_exc())
                answer = dict(stream.template, **{_SEQ: np.array([ref.seq], np.int64),
                                                  _ERROR: np.array([1], np.int64)})
            finally:
                self._reader.release(ref)
            try:
                stream.response.send(answer, timeout=SEND_TIMEOUT_S)
                self.served += 1
            except Exception as exc:
                log.warning("dropping the stream of %s: %s", name, exc)
                self._streams.pop(name, None)
                stream.response.close()


# --------------------------------------------------------------------------------------------------
# env-worker side
# --------------------------------------------------------------------------------------------------
class _StreamPending:
    def __init__(self, client: StreamClient, seq: int, return_value: bool):
        self._client, self._seq, self._return_value = client, seq, return_value

    def result(self) -> PolicyOutput:
        return self._client._result(self._seq, self._return_value)


class StreamClient:
    """An env worker's :class:`~embodirl.rollout.inference.InferenceClient` over a shared-memory
    stream to an inference worker on Ray, on the same node (see module docstring)."""

    def __init__(self, worker, *, queue_size: int, mode: str = "train", tag: str = "obs",
                 liveness_check_s: float = LIVENESS_CHECK_S, deadline=None):
        self.worker = worker
        self.times = CallTimes(deadline)    # deadline: the typed runner.worker_deadline section (None: wait)
        self._sent: dict[int, float] = {}   # request seq -> when it was queued
        self.queue_size = max(int(queue_size), 1)
        self.mode = mode
        self.tag = tag
        self.liveness_check_s = liveness_check_s
        self.request_ring: ShmChannel | None = None
        self.response: ChannelInfo | None = None
        self._server_pidfd: int | None = None
        self._reader = ShmReader()
        self._answers: dict[int, PolicyOutput] = {}
        self.batches = 0

    def request(self, obs: Mapping[str, np.ndarray], *, return_value: bool = False) -> Pending:
        if self.request_ring is None:
            self.request_ring = ShmChannel(obs, self.queue_size, tag=self.tag)
        meta = request_meta(return_value, self.mode)
        self.batches += 1
        if self.response is None:   # a new stream: the first batch goes by reference in the opening call
            import ray

            ref = self.request_ring.put(obs)
            limit, sent = self.times.limit(OPEN), time.monotonic()
            info, out, pid = self._call(lambda: ray.get(self.worker.open_stream.remote(self.request_ring.info, ref, meta),
                                                        timeout=limit), OPEN)
            self.times.record(OPEN, time.monotonic() - sent)
            self.response = info
            self._watch(pid)
            return Done(_strip(out, return_value))
        ref = self.request_ring.send(obs, meta=meta)
        self._sent[ref.seq] = time.monotonic()
        return _StreamPending(self, ref.seq, return_value)

    def _result(self, seq: int, return_value: bool) -> PolicyOutput:
        from embodirl.workers.transport import DECISION

        while seq not in self._answers:
            assert self.response is not None      # the stream's first request opened it
            try:
                msg = self._reader.recv(self.response, timeout=0)
            except FileNotFoundError as exc:
                # the response ring is gone before this side mapped it: its owner, the inference worker,
                # died and its segments were swept (a death like any other: the group restarts it)
                from embodirl.workers.transport import InferenceWorkerDied

                raise InferenceWorkerDied(f"inference worker died: its response ring {exc.filename} is gone") from exc
            if msg is None:
                self._wait(self._left(seq))
                continue
            ref, _ = msg
            views = self._reader.read(ref)
            answer_seq, failed = int(views[_SEQ][0]), bool(views[_ERROR][0])
            fields = {k: np.array(v, copy=True) for k, v in views.items() if not k.startswith("_")}
            out = PolicyOutput(fields, int(views[_VERSION][0]), {"infer_s": float(views[_INFER_S][0])})
            del views
            self._reader.release(ref)
            if failed:
                raise RuntimeError(f"the inference worker failed on batch {answer_seq}; see its log")
            sent = self._sent.pop(answer_seq, None)
            if sent is not None:
                self.times.record(DECISION, time.monotonic() - sent)
            self._answers[answer_seq] = out
        return _strip(self._answers.pop(seq), return_value)

    def _watch(self, pid: int) -> None:
        self._unwatch()
        try:
            self._server_pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):   # no pidfds here (or the worker is already gone): Ray checks
            self._server_pidfd = None

    def _unwatch(self) -> None:
        if self._server_pidfd is not None:
            os.close(self._server_pidfd)
            self._server_pidfd = None

    def _left(self, seq: int) -> float | None:
        """Seconds request ``seq`` may still wait for its answer (None: no deadline); raises
        :class:`~embodirl.workers.transport.InferenceWorkerHung` once it is past its deadline."""
        from embodirl.workers.transport import DECISION, InferenceWorkerHung

        limit, sent = self.times.limit(DECISION), self._sent.get(seq)
        if limit is None or sent is None:
            return None
        left = sent + limit - time.monotonic()
        if left <= 0:
            raise InferenceWorkerHung(f"did not answer a batch within {limit:.1f} s ({self.times.describe(DECISION)})")
        return left

    def _wait(self, left: float | None = None) -> None:
        """Wait until an answer is queued, the inference worker died (raises InferenceWorkerDied) or ``left``
        seconds have passed."""
        from embodirl.workers.transport import InferenceWorkerDied

        assert self.response is not None          # the stream's first request opened it
        fds = [self._reader.ready_fd(self.response)]
        if self._server_pidfd is not None:
            fds.append(self._server_pidfd)
        readable = wait_readable(fds, self.liveness_check_s if left is None else min(left, self.liveness_check_s))
        if self._server_pidfd is not None and self._server_pidfd in readable:
            raise InferenceWorkerDied("the inference worker process exited while serving this env worker")
        if not readable and self._server_pidfd is None:
            self._check_alive()

    def _check_alive(self) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            self._call(lambda: ray.get(self.worker.ready.remote(), timeout=self.liveness_check_s))
        except GetTimeoutError:   # alive but not answering yet (e.g. a long forward on CPU)
            pass

    def _call(self, fn, kind: str | None = None):
        from ray.exceptions import GetTimeoutError, RayActorError

        from embodirl.workers.transport import InferenceWorkerDied, InferenceWorkerHung

        try:
            return fn()
        except RayActorError as exc:
            raise InferenceWorkerDied(f"inference worker died: {exc}") from exc
        except GetTimeoutError:
            if kind is None:
                raise
            raise InferenceWorkerHung(f"did not answer {kind} within {self.times.limit(kind):.1f} s "
                                      f"({self.times.describe(kind)})") from None

    def info(self) -> dict:
        return {"shm": True, "stream": True, "segment": self.request_ring.info.segment if self.request_ring else None,
                "shm_batches": self.batches, "ray_batches": 0, "fallbacks": 0}

    def reconnect(self, worker) -> None:
        """Serve from a new inference worker: requests the old one held are dropped, a new stream opens."""
        self.worker = worker
        if self.request_ring is not None:
            self.request_ring.reclaim()
        if self.response is not None:
            self._reader.forget(self.response.segment)
        self.response = None
        self._unwatch()
        self._answers.clear()
        self._sent.clear()

    def close(self) -> None:
        self._unwatch()
        self._reader.close()
        if self.request_ring is not None:
            self.request_ring.close()
            self.request_ring = None


def _strip(out: PolicyOutput, return_value: bool) -> PolicyOutput:
    from embodirl import data as D

    if return_value or D.VALUE not in out.fields:
        return out
    return PolicyOutput({k: v for k, v in out.fields.items() if k != D.VALUE}, out.weight_version, out.timings)
