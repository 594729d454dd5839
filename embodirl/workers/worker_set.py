"""A set of workers of one class, in this process or on Ray: the one place that tells them apart.

The worker groups (:mod:`embodirl.workers.groups`) and the runner talk to env and inference workers only
through a :class:`WorkerSet`; whether worker ``k`` is an object in this process (the default job: no Ray)
or a Ray worker process changes nothing in their code::

    workers = WorkerSet(EnvWorker, remote=False)
    workers.start(0, env_cfg, num_stages=2, ...)          # or remote=True: ray.remote(EnvWorker) with options
    spec = workers.call(0, EnvWorker.spec)
    pending = {workers.call_async(k, EnvWorker.collect, part): k for k, part in enumerate(parts)}
    ref, result, error = workers.wait_first(pending)      # remote: the first to answer; local: in order
    workers.close(wait_s=10)

A method is named by the worker class's own function (``EnvWorker.collect``), not by a string, so that an IDE
follows a call from the group to the worker. In this process a call runs at once and :meth:`call_async` returns its
outcome already settled (an error is kept and raised by :meth:`get`, as Ray raises it), so the group code that waits
for the first answer and recovers from a failed one is the same on both sides.

Every wait on a Ray worker has a deadline (:mod:`embodirl.workers.deadlines`): a call that takes far longer than the
recent calls of its kind raises :class:`~embodirl.workers.deadlines.WorkerHung` naming the worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from embodirl.workers.deadlines import CallTimes, WorkerHung, is_stopped, where

log = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """A Ray worker's process is gone (:meth:`WorkerSet.gather`)."""

    def __init__(self, rank: int):
        super().__init__(f"worker {rank} died")
        self.rank = rank


class _Settled:
    """The outcome of a call already made in this process (the local side of a Ray object ref)."""

    def __init__(self, fn: Callable, *args, **kwargs):
        self.value, self.error = None, None
        try:
            self.value = fn(*args, **kwargs)
        except Exception as exc:       # raised again by WorkerSet.get, where Ray raises a remote error
            self.error = exc


class WorkerSet:
    """Workers of class ``cls`` by rank (see module docstring). ``options_for(rank)``: extra
    ``ray.remote`` options of a remote worker (placement); ignored in this process. ``times``: the group's
    call times, which set the deadlines of its Ray calls (None: none); ``label`` names a worker in a sentence
    (``inference worker``) and ``info_of(rank)`` gives its process (``pid``, ``host``, ``node_id``)."""

    def __init__(self, cls: type, *, remote: bool, options_for: Callable[[int], Mapping] | None = None,
                 times: CallTimes | None = None, label: str | None = None,
                 info_of: Callable[[int], dict | None] | None = None):
        self.cls = cls
        self.remote = bool(remote)
        self.options_for = options_for
        self.handles: list = []
        self.times = times if times is not None else CallTimes()
        self.label = label or cls.__name__
        self.info_of = info_of
        self._calls: dict = {}          # a Ray call in flight -> (method name, rank, when it was started)

    def __len__(self) -> int:
        return len(self.handles)

    def __iter__(self):
        return iter(list(self.handles))

    def __getitem__(self, rank: int):
        """Worker ``rank``'s handle: the object, or its Ray handle (what another worker is given)."""
        return self.handles[rank]

    # --- creation ----------------------------------------------------------------------------------
    def start(self, rank: int, /, *args, **kwargs):
        """Create worker ``rank`` (appended, or replacing the one at ``rank``) with ``cls(*args, **kwargs)``."""
        if self.remote:
            import ray

            options = {"max_restarts": 0, **(self.options_for(rank) if self.options_for is not None else {})}
            handle: Any = ray.remote(self.cls).options(**options).remote(*args, **kwargs)
        else:
            handle = self.cls(*args, **kwargs)
        if rank == len(self.handles):
            self.handles.append(handle)
        else:
            self.handles[rank] = handle
        return handle

    # --- calls -------------------------------------------------------------------------------------
    def _name(self, method: Callable) -> str:
        name = getattr(method, "__name__", None)
        if name is None or not callable(method) or getattr(self.cls, name, None) is not method:
            raise TypeError(f"{method!r} is not a method of {self.cls.__name__}; pass {self.cls.__name__}.<method>")
        return name

    def call_async(self, rank: int, method: Callable, /, *args, **kwargs):
        """Start ``method`` (a function of the worker class, e.g. ``EnvWorker.collect``) on worker ``rank``: a Ray
        object ref, or (here) its settled outcome."""
        name = self._name(method)
        if self.remote:
            ref = getattr(self.handles[rank], name).remote(*args, **kwargs)
            self._calls[ref] = (name, rank, time.monotonic())
            return ref
        return _Settled(getattr(self.handles[rank], name), *args, **kwargs)

    # --- deadlines ---------------------------------------------------------------------------------
    def _due_in(self, refs) -> float | None:
        """Seconds until the first of ``refs`` passes its deadline (0 when one has; None: no deadline)."""
        due = None
        now = time.monotonic()
        for ref in refs:
            call = self._calls.get(ref)
            if call is None:
                continue
            limit = self.times.limit(call[0])
            if limit is not None:
                left = max(0.0, call[2] + limit - now)
                due = left if due is None else min(due, left)
        return due

    def _done(self, ref) -> None:
        call = self._calls.pop(ref, None)
        if call is not None:
            self.times.record(call[0], time.monotonic() - call[2])

    def _wait(self, refs: list, num_returns: int = 1) -> list:
        """``ray.wait`` for ``num_returns`` of ``refs``, up to the first deadline among them: the ready ones (timed),
        or :class:`WorkerHung` naming the workers whose call is past its deadline."""
        import ray

        while True:
            due = self._due_in(refs)
            ready, _ = ray.wait(list(refs), num_returns=min(num_returns, len(refs)), timeout=due)
            for ref in ready:
                self._done(ref)
            if ready or due is None:
                return ready
            if self._due_in(refs) == 0:
                raise self.hung(refs)

    def hung(self, refs: list) -> WorkerHung:
        """The sentence for calls past their deadline (``refs``: the unfinished calls of one wait, of which one at
        least is past it): the workers (those stopped among them, else all), the call and why its deadline was that
        long."""
        calls = [self._calls[ref] for ref in refs if ref in self._calls]
        now = time.monotonic()
        late = [c for c in calls if self.times.limit(c[0]) is not None and now - c[2] >= self.times.limit(c[0])]
        name = (late or calls)[0][0]
        ranks = sorted({rank for _, rank, _ in calls})
        infos = {r: (self.info_of(r) if self.info_of is not None else None) for r in ranks}
        stopped = [r for r in ranks if is_stopped(infos[r])]
        named = stopped or ranks     # a stopped process is the cause; the others wait on it (a collective)
        workers = ", ".join(f"{self.label} {r}{where(infos[r], r in stopped)}" for r in named)
        limit = self.times.limit(name)
        return WorkerHung(f"{workers} did not finish {name} within {limit:.1f} s ({self.times.describe(name)})",
                          [(info.get("host"), info.get("pid")) for info in (infos[r] for r in named) if info], self.label)

    def silent(self, probe: Callable, timeout_s: float) -> list[int]:
        """The ranks whose Ray worker does not answer ``probe`` (a cheap method) within ``timeout_s`` (stopped or
        hung; a dead one raises and is not counted here)."""
        import ray

        probes = [getattr(h, self._name(probe)).remote() for h in self.handles]
        answered, _ = ray.wait(probes, num_returns=len(probes), timeout=timeout_s)
        ready = set(answered)
        return [r for r, ref in enumerate(probes) if ref not in ready]

    def get(self, pending, timeout: float | None = None):
        """The result of :meth:`call_async` (or a list of them); a worker's error is raised here, and
        :class:`WorkerHung` for a call past its deadline."""
        if self.remote:
            import ray

            if timeout is None:
                refs = pending if isinstance(pending, list) else [pending]
                waiting = [ref for ref in refs if ref in self._calls]
                while waiting:
                    ready = set(self._wait(waiting, num_returns=len(waiting)))
                    waiting = [ref for ref in waiting if ref not in ready]
            try:
                return ray.get(pending, timeout=timeout)
            finally:
                for ref in pending if isinstance(pending, list) else [pending]:
                    self._calls.pop(ref, None)
        if isinstance(pending, list):
            return [self.get(p) for p in pending]
        if pending.error is not None:
            raise pending.error
        return pending.value

    def call(self, rank: int, method: Callable, /, *args, **kwargs):
        return self.get(self.call_async(rank, method, *args, **kwargs))

    def call_all(self, method: Callable, *args, **kwargs) -> list:
        return self.get([self.call_async(rank, method, *args, **kwargs) for rank in range(len(self.handles))])

    def call_each(self, method: Callable, args_per_rank: list) -> list:
        """``method(args_per_rank[k])`` on every worker ``k``, together."""
        return self.get([self.call_async(rank, method, arg) for rank, arg in enumerate(args_per_rank)])

    def gather(self, pending: list, ranks: list[int] | None = None, *, probe: Callable | None = None) -> list:
        """The results of ``pending`` (one :meth:`call_async` per worker; ``ranks[i]`` made ``pending[i]``, default
        ``i``), in that order. A Ray worker that died raises :class:`WorkerDied` naming its rank; so does a call that
        failed because a peer died (a collective), found by calling ``probe`` (a cheap method) on every worker."""
        if not self.remote:
            return self.get(pending)      # in this process an error is the call's own
        import ray
        from ray.exceptions import RayActorError

        ranks = list(range(len(pending))) if ranks is None else list(ranks)
        waiting = {ref: i for i, ref in enumerate(pending)}
        results: list = [None] * len(pending)
        while waiting:
            ready = self._wait(list(waiting))
            i = waiting.pop(ready[0])
            try:
                results[i] = ray.get(ready[0])
            except RayActorError:
                raise WorkerDied(ranks[i]) from None
            except Exception:
                dead = self.dead_ranks(probe) if probe is not None else []
                if dead:
                    raise WorkerDied(dead[0]) from None
                raise
        return results

    def dead_ranks(self, probe: Callable, timeout_s: float = 10.0) -> list[int]:
        """The ranks whose Ray worker no longer answers ``probe``."""
        import ray
        from ray.exceptions import RayActorError

        probes = [getattr(h, self._name(probe)).remote() for h in self.handles]
        ray.wait(probes, num_returns=len(probes), timeout=timeout_s)
        dead = []
        for r, ref in enumerate(probes):
            try:
                ray.get(ref, timeout=0.1)
            except RayActorError:
                dead.append(r)
            except Exception:
                pass
        return dead

    def wait_first(self, pending: Mapping) -> object:
        """The key of ``pending`` (a dict keyed by :meth:`call_async` results) that finished first (:class:`WorkerHung`
        when one is past its deadline first)."""
        if self.remote:
            return self._wait(list(pending))[0]
        return next(iter(pending))

    def share(self, obj):
        """``obj`` as every worker should receive it: one copy in Ray's object store, or itself."""
        if self.remote:
            import ray

            return ray.put(obj)
        return obj

    # --- lifecycle ---------------------------------------------------------------------------------
    def kill(self, rank: int) -> None:
        """Stop worker ``rank`` at once (a dead or hung Ray worker); an object here is closed."""
        handle = self.handles[rank]
        self._calls = {ref: call for ref, call in self._calls.items() if call[1] != rank}
        try:
            if self.remote:
                import ray

                ray.kill(handle, no_restart=True)
            else:
                handle.close()
        except Exception as exc:
            log.debug("killing worker %d: %s", rank, exc)

    def close(self, wait_s: float = 10.0) -> None:
        """Close every worker: Ray workers get ``wait_s`` to close (simulators, shared-memory rings they
        created) and are then killed (a dead one is already gone); objects here just close."""
        handles, self.handles = self.handles, []
        self._calls.clear()
        if not self.remote:
            for handle in handles:
                handle.close()
            return
        import ray

        try:
            ray.get([h.close.remote() for h in handles], timeout=wait_s)
        except Exception as exc:
            log.debug("closing workers: %s", exc)
        for handle in handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:
                log.debug("killing worker: %s", exc)
