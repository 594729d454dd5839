"""Worker faults during a collection: a dead env worker is replaced, a dead inference worker restarted, and
the slots they held are collected again from the same episode starts (GRPO groups stay intact).

:func:`settle` takes the answers of one collection (one ``EnvWorker.collect`` per env worker of an
:class:`~embodirl.workers.env_group.EnvWorkerGroup`) as they come. A Ray worker that dies raises ``RayActorError``
(an env worker) or :class:`~embodirl.workers.transport.InferenceWorkerDied` (its inference worker); either is
recovered and that worker's part asked for again, up to ``max_faults`` times per collection. Workers in
this process do not die apart from the driver: their errors are the run's. A worker that is alive but stuck is not
recovered here: an inference worker that did not answer an env worker's batch in time
(:class:`~embodirl.workers.transport.InferenceWorkerHung`), or an env worker's collection past its deadline, raises
:class:`~embodirl.workers.deadlines.WorkerHung` for the runner (:mod:`embodirl.workers.deadlines`).
"""

from __future__ import annotations

import logging
import time

from embodirl.channel import segments
from embodirl.workers.env_worker import EnvWorker
from embodirl.workers.transport import InferenceWorkerDied, InferenceWorkerHung

log = logging.getLogger(__name__)

DEFAULT_MAX_FAULTS = 8   # worker replacements tolerated within one collect() before giving up


class TooManyFaults(RuntimeError):
    """Workers kept dying during one collection."""


def _worker_died() -> tuple[type[BaseException], ...]:
    try:
        from ray.exceptions import RayActorError
    except ImportError:
        return ()
    return (RayActorError,)


def settle(group, pending: dict, parts: list, kwargs: dict) -> list:
    """Every env worker's trajectory, in worker order, from ``pending`` (``EnvWorker.collect`` of each worker's
    part, keyed to its index): a worker that died is replaced (or its inference worker restarted) and its part
    collected again (see module docstring)."""
    workers = group.workers
    results: list = [None] * len(workers)
    env_died = _worker_died() if workers.remote else ()
    inference_died = (InferenceWorkerDied,) if workers.remote else ()
    inference_hung = (InferenceWorkerHung,) if workers.remote else ()
    faults = 0
    while pending:
        ref = workers.wait_first(pending)
        k = pending.pop(ref)
        try:
            results[k] = workers.get(ref)
            continue
        except inference_hung as exc:
            raise group.inference.hung_answer(group.layout.inference_worker_of(k), exc) from None
        except inference_died as exc:
            restart_inference_worker(group, k, exc)
        except env_died as exc:
            replace_env_worker(group, k, exc)
        faults += 1
        if faults > group.max_faults:
            raise TooManyFaults(f"workers died {faults} times during one collection; giving up")
        pending[workers.call_async(k, EnvWorker.collect, parts[k], **kwargs)] = k
    return results


def replace_env_worker(group, k: int, cause: BaseException) -> None:
    """Env worker ``k`` died: sweep the shared memory it left, start a new one with the same slots and
    placement, and connect it to its inference worker."""
    pid = group.infos[k]["pid"]
    group.workers.kill(k)
    prefix = segments.process_prefix(pid)
    swept = segments.sweep(prefix)
    try:
        group.inference.forget_channels(prefix)
    except Exception as exc:
        log.debug("inference workers could not unmap %s: %s", prefix, exc)
    per = group.layout.slots_per_worker
    log.warning("env worker %d (pid %d) died; replacing it and collecting its %d episodes (slots %d..%d) again%s",
                k, pid, per, k * per, (k + 1) * per - 1,
                f"; removed {len(swept)} shared-memory entries it left" if swept else "")
    group.events.append({"event": "env_worker_replaced", "worker": k, "pid": pid, "time": time.time(),
                         "cause": type(cause).__name__})
    group.start(k)
    group.workers.call(k, EnvWorker.ready)
    group.infos[k] = group.workers.call(k, EnvWorker.info)
    group.connect(k)


def restart_inference_worker(group, k: int, cause: BaseException) -> None:
    """Env worker ``k``'s inference worker died: restart it (once, whichever env worker noticed first) and
    reconnect ``k``."""
    r = group.layout.inference_worker_of(k)
    if group._connected_gen[k] == group.inference.generation[r]:   # nobody restarted it yet
        group.inference.restart(r, cause=str(cause).splitlines()[0])
        group.events.append({"event": "inference_worker_restarted", "worker": r, "time": time.time(),
                             "version": group.inference.version})
    group.connect(k)
