"""A set of workers of one class, in this process or on Ray: the one place that tells them apart.

The worker groups (:mod:`embodirl.workers.groups`) and the runner talk to env and inference workers only
through a :class:`WorkerSet`; whether worker ``k`` is an object in this process (the default job: no Ray)
or a Ray worker process changes nothing in their code::

    workers = WorkerSet(EnvWorker, remote=False)
    workers.start(0, env_cfg, num_stages=2, ...)          # or remote=True: ray.remote(EnvWorker) with options
    spec = workers.call(0, EnvWorker.spec)
    pending = {workers.submit(k, EnvWorker.collect, part): k for k, part in enumerate(parts)}
    ref, result, error = workers.wait_first(pending)      # remote: the first to answer; local: in order
    workers.close(wait_s=10)

A method is named by the worker class's own function (``EnvWorker.collect``), not by a string, so that an IDE
follows a call from the group to the worker. In this process a call runs at once and :meth:`submit` returns its
outcome already settled (an error is kept and raised by :meth:`get`, as Ray raises it), so the group code that waits
for the first answer and recovers from a failed one is the same on both sides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

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
    ``ray.remote`` options of a remote worker (placement); ignored in this process."""

    def __init__(self, cls: type, *, remote: bool, options_for: Callable[[int], Mapping] | None = None):
        self.cls = cls
        self.remote = bool(remote)
        self.options_for = options_for
        self.handles: list = []

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
            handle = ray.remote(self.cls).options(**options).remote(*args, **kwargs)
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
        if not callable(method) or getattr(self.cls, name or "", None) is not method:
            raise TypeError(f"{method!r} is not a method of {self.cls.__name__}; pass {self.cls.__name__}.<method>")
        return name

    def submit(self, rank: int, method: Callable, /, *args, **kwargs):
        """Start ``method`` (a function of the worker class, e.g. ``EnvWorker.collect``) on worker ``rank``: a Ray
        object ref, or (here) its settled outcome."""
        name = self._name(method)
        if self.remote:
            return getattr(self.handles[rank], name).remote(*args, **kwargs)
        return _Settled(getattr(self.handles[rank], name), *args, **kwargs)

    def get(self, pending, timeout: float | None = None):
        """The result of :meth:`submit` (or a list of them); a worker's error is raised here."""
        if self.remote:
            import ray

            return ray.get(pending, timeout=timeout)
        if isinstance(pending, list):
            return [self.get(p) for p in pending]
        if pending.error is not None:
            raise pending.error
        return pending.value

    def call(self, rank: int, method: Callable, /, *args, **kwargs):
        return self.get(self.submit(rank, method, *args, **kwargs))

    def call_all(self, method: Callable, *args, **kwargs) -> list:
        return self.get([self.submit(rank, method, *args, **kwargs) for rank in range(len(self.handles))])

    def call_each(self, method: Callable, args_per_rank: list) -> list:
        """``method(args_per_rank[k])`` on every worker ``k``, together."""
        return self.get([self.submit(rank, method, arg) for rank, arg in enumerate(args_per_rank)])

    def gather(self, pending: list, ranks: list[int] | None = None, *, probe: Callable | None = None) -> list:
        """The results of ``pending`` (one :meth:`submit` per worker; ``ranks[i]`` made ``pending[i]``, default
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
            ready, _ = ray.wait(list(waiting), num_returns=1)
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

        probes = [self.submit(r, probe) for r in range(len(self.handles))]
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
        """The key of ``pending`` (a dict keyed by :meth:`submit` results) that finished first."""
        if self.remote:
            import ray

            ready, _ = ray.wait(list(pending), num_returns=1)
            return ready[0]
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
