"""The actor as a group of N ranks: one :class:`~embodirl.workers.actor_worker.ActorWorker` each.

::

    actors = ActorGroup.from_config(cfg, spec, remote=True, placement=(plan, groups), process_vars=...)
    version = actors.load(checkpoint)                         # resume (any number of ranks wrote it)
    handle = actors.publish_weights(full=True, consumers=...)  # rank 0 posts; the driver forwards the handle
    prepared = prepare_batch(actors.with_ref_logprob(batch))  # driver side: pure math on the whole batch
    metrics = actors.train(prepared)                          # each rank its shard of whole groups
    actors.save(actor_dir, policy_dir)                      # sharded actor state + public export

``remote=False`` holds one rank in this process (the default CPU job: no Ray, and the driver's
inference shares the rank's module). ``remote=True`` starts N Ray workers - N = the accelerators
``cluster.component_placement`` gives ``actor``, or ``actor.cpu_world_size`` on a machine without
GPUs - pinned to their placement-group bundles; rank 0 finds an address and a free port on its node
and every rank joins the process group there (gloo on CPU, NCCL on GPU).

Faults: every call waits on all ranks; a rank that dies ends the call with :class:`ActorRankDied`
(one sentence naming the rank, its process and node) after the surviving ranks, which would wait in a
collective for the dead one, are killed. A call past its deadline (``runner.worker_deadline``: a rank stuck in a
kernel or a collective, or stopped) ends the same way with :class:`~embodirl.workers.deadlines.WorkerHung`, naming
the stopped rank when one is.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import NoReturn

import torch

from embodirl import data as D
from embodirl.actor import sharding
from embodirl.placement import data_parallel_size, placement_from_config
from embodirl.schema import Config, run_config
from embodirl.workers.actor_worker import ActorWorker
from embodirl.workers.deadlines import CallTimes, WorkerHung
from embodirl.workers.transport import pack_trajectory
from embodirl.workers.worker_set import WorkerDied, WorkerSet

log = logging.getLogger(__name__)


class ActorRankDied(RuntimeError):
    """An actor rank's process died during a call (the message is one sentence)."""


class ActorGroup:
    """The actor's ranks as one :class:`~embodirl.workers.worker_set.WorkerSet` of :class:`ActorWorker`
    (objects in this process or Ray workers, told apart there only)."""

    def __init__(self, workers: WorkerSet, *, infos: list[dict]):
        self.workers = workers
        self.remote = workers.remote
        self.infos = infos
        self.world_size = len(workers)
        workers.label = "actor rank"
        workers.info_of = lambda r: self.infos[r] if r < len(self.infos) else None

    # --- construction -------------------------------------------------------------------------------
    @classmethod
    def local(cls, cfg: Config, spec, *, policy=None) -> ActorGroup:
        """One rank in this process (no process group); ``policy``: a module shared with inference. ``cfg``: the
        typed config (a composed one is converted here)."""
        workers = WorkerSet(ActorWorker, remote=False)
        workers.start(0, run_config(cfg), spec, policy=policy)
        return cls(workers, infos=[workers.call(0, ActorWorker.setup)])

    @classmethod
    def remote_group(cls, cfg: Config, spec, *, placement=None, process_vars: Mapping[str, str] | None = None
                     ) -> ActorGroup:
        """N ranks as Ray workers (see module docstring); each receives the typed config (dataclasses pickle)."""
        cfg = run_config(cfg)
        N = data_parallel_size(cfg, placement_from_config(cfg.cluster))

        def options_for(rank: int) -> dict:
            options = {"max_concurrency": 1}
            if placement is not None:
                from embodirl.workers.placement_groups import worker_options

                plan, groups = placement
                options.update(worker_options(plan, groups, "actor", rank))
            return options

        workers = WorkerSet(ActorWorker, remote=True, options_for=options_for,
                            times=CallTimes(cfg.runner.worker_deadline))
        for r in range(N):
            workers.start(r, cfg, spec, rank=r, world_size=N, process_vars=dict(process_vars or {}))
        group = cls(workers, infos=[{} for _ in range(N)])
        try:
            address, port = group._gather([workers.call_async(0, ActorWorker.rendezvous)], "rendezvous")[0]
            group.infos = group._gather([workers.call_async(r, ActorWorker.setup, address, port) for r in range(N)], "setup")
        except BaseException:
            group.close()
            raise
        log.info("actor group: %d rank(s), process group at %s:%d, fsdp=%s", N, address, port, group.infos[0]["fsdp"])
        return group

    # --- calls ---------------------------------------------------------------------------------------
    def _call_all(self, method, per_rank_args: Sequence[tuple] | None = None, **kwargs) -> list:
        args = per_rank_args or [()] * self.world_size
        return self._gather([self.workers.call_async(r, method, *a, **kwargs) for r, a in enumerate(args)], method.__name__)

    def _gather(self, refs: list, what: str, ranks: list[int] | None = None) -> list:
        """Results of one call per rank; a dead rank (a Ray worker's process) ends it with :class:`ActorRankDied`."""
        try:
            return self.workers.gather(refs, ranks, probe=ActorWorker.ready)
        except WorkerDied as died:
            self._rank_died(died.rank, what)
        except WorkerHung as hung:
            hung.kill_local()               # the other ranks wait in a collective for it: all go
            self.close(kill=True)
            raise

    def _rank_died(self, r: int, what: str) -> NoReturn:
        info = self.infos[r] if r < len(self.infos) else {}
        where = f" (pid {info['pid']}, node {str(info.get('node_id'))[:12]})" if info.get("pid") else ""
        self.close(kill=True)
        raise ActorRankDied(f"actor rank {r}{where} died during {what}") from None

    def _shards(self, batch) -> tuple[list, list[torch.Tensor]]:
        shards, indices = sharding.shard(batch, self.world_size)
        if self.remote:   # packed for Ray's object store, one object per rank (in this process: the batch itself)
            shards = [self.workers.share(pack_trajectory(s)) for s in shards]
        return shards, indices

    # --- a training step -----------------------------------------------------------------------------
    def with_ref_logprob(self, batch):
        """``batch`` with ``logprob_ref`` computed by the ranks (reference policy: adapter disabled)."""
        shards, indices = self._shards(batch)
        parts = self._call_all(ActorWorker.ref_logprob, [(s,) for s in shards])
        out = batch.copy()
        out.set(D.LOGPROB_REF, sharding.unshard([torch.as_tensor(p) for p in parts], indices, batch.batch_size[0]))
        return out

    def train(self, prepared) -> dict[str, float]:
        """Update on the prepared batch, each rank on its shard; the metrics (already reduced over
        ranks inside the actor) of rank 0."""
        shards, _ = self._shards(prepared)
        return self._call_all(ActorWorker.train, [(s,) for s in shards])[0]

    def publish_weights(self, *, full: bool = False, gather: bool = True, consumer_nodes=(), consumer_gpus=()):
        """Gather the changed trainable tensors and post them from rank 0: its handle. In-process the
        inference side shares the module, so only the version moves (an int). ``full`` without ``gather``: every
        trainable tensor at the last published version, posted again by rank 0 (restarted inference workers)."""
        if not gather:
            return self._call_one(0, ActorWorker.publish_weights, full=full, gather=False,
                                  consumer_nodes=list(consumer_nodes), consumer_gpus=list(consumer_gpus))
        if not self.remote:
            version, _ = self.workers[0].actor.publish_weights(full=full)
            return version
        return self._call_all(ActorWorker.publish_weights, full=full, consumer_nodes=list(consumer_nodes),
                              consumer_gpus=list(consumer_gpus))[0]

    def _call_one(self, rank: int, method, *args, **kwargs):
        return self._gather([self.workers.call_async(rank, method, *args, **kwargs)], method.__name__, [rank])[0]

    # --- supervised fine-tuning (embodirl sft) --------------------------------------------------------
    def set_statistics(self, statistics: Mapping) -> None:
        self._call_all(ActorWorker.set_statistics, [(dict(statistics),)] * self.world_size)

    def sft_train(self, batch: Mapping, options: Mapping) -> dict[str, float]:
        """One supervised step: ``batch`` (a dict of per-sample fields) cut into equal contiguous shards, one
        per rank; rank 0's metrics (global over ranks)."""
        n = len(batch["actions"])
        if n % self.world_size:
            raise ValueError(f"{n} samples cannot be split evenly over {self.world_size} actor ranks")
        size = n // self.world_size
        shards = [{k: (v[r * size:(r + 1) * size] if v is not None else None) for k, v in batch.items()}
                  for r in range(self.world_size)]
        return self._call_all(ActorWorker.sft_train, [(s, dict(options)) for s in shards])[0]

    def export(self, directory, step: int, marker: Mapping | None = None) -> None:
        self._call_all(ActorWorker.export, [(str(directory), int(step), dict(marker or {}))] * self.world_size)

    # --- state --------------------------------------------------------------------------------------
    def save(self, actor_dir, policy_dir) -> None:
        self._call_all(ActorWorker.save, [(str(actor_dir), str(policy_dir))] * self.world_size)

    def load(self, checkpoint_dir) -> int:
        return self._call_all(ActorWorker.load, [(str(checkpoint_dir),)] * self.world_size)[0]

    def set_lr_scale(self, scale: float) -> None:
        self._call_all(ActorWorker.set_lr_scale, [(float(scale),)] * self.world_size)

    def swap_ema(self) -> bool:
        """Every rank exchanges its weights with their moving average (``actor.ema_decay``); whether the ranks now
        hold the average (False when there is none)."""
        return bool(self._call_all(ActorWorker.swap_ema)[0])

    def offload(self) -> None:
        self._call_all(ActorWorker.offload)

    def onload(self) -> None:
        self._call_all(ActorWorker.onload)

    def memory(self) -> list[dict]:
        return self._call_all(ActorWorker.memory)

    @property
    def policy(self):
        """The in-process rank's policy (``remote=False`` only)."""
        if self.remote:
            raise RuntimeError("the policy of a remote actor group lives in its ranks")
        return self.workers[0].policy

    def close(self, *, kill: bool = False) -> None:
        # killed at once when a peer died: the survivors wait in a collective and cannot close
        self.workers.close(wait_s=0.0 if kill else 30.0)

