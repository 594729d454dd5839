"""One actor rank: the trainable policy under FSDP2, its optimizer, and weight publication.

A plain class (driven in-process by the CPU default job and tests) that
:class:`~embodirl.workers.actor_group.ActorGroup` wraps with ``ray.remote`` for every rank of a
distributed actor. Ranks join one torch.distributed group (gloo on CPU, NCCL on GPU) through
:meth:`rendezvous` / :meth:`setup`; each builds the policy from the ``model`` config with the same
seed (so a randomly initialised frozen base is identical on every rank and inference worker), wraps it
with FSDP2 (:class:`~embodirl.actor.actor.Actor`) and then, each step, trains on its shard of the
prepared batch. Rank 0 turns what an update changed into one packed publication for the inference
workers (:mod:`embodirl.workers.weight_transfer`), keeping the snapshot that brings a new or
restarted inference worker up to date.

Checkpoints: :meth:`save` writes the actor state with ``torch.distributed.checkpoint`` (every rank
its shards, :mod:`embodirl.actor.sharded_state`) and rank 0 the policy export in the public
peft/OpenVLA-OFT layout. Collocated placement: :meth:`offload` moves parameters, gradients and
optimizer state to host memory while the rollout phase runs; :meth:`onload` brings them back.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from embodirl.actor import fsdp
from embodirl.actor.actor import Actor
from embodirl.schema import Config
from embodirl.schema.sections import RolloutSection
from embodirl.workers import process_env
from embodirl.workers.parking import HostParking
from embodirl.workers.weight_sync import WeightPublisher
from embodirl.workers.weight_transfer import WeightOutbox

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger(__name__)


def build_policy(model_cfg: Mapping, env_spec, seed: int, device: torch.device | str | None = None):
    """The policy from ``model`` with a seeded initialisation: every process that builds it (actor ranks,
    inference workers) gets identical weights, so a random frozen base needs no transfer. ``device``: the worker's
    own device, where the weights are created (and a checkpoint loaded) directly, never on the host first; a
    ``model.device`` the config sets wins."""
    import dataclasses

    from embodirl.models.registry import make_policy, model_config

    model = model_config(model_cfg)
    if device is not None and model.device is None:
        model = dataclasses.replace(model, device=str(device))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make_policy(model, env_spec)


class ActorWorker:
    """Args:
        cfg: the typed config (:func:`embodirl.schema.run_config`; its ``algorithm``, ``actor``, ``model``,
            ``rollout`` and ``runner`` sections), pickled as it is to a Ray worker.
        env_spec: the training env's spec (task table, action bounds).
        rank / world_size: this rank and the group's size.
        process_vars: the driver's environment variables (Ray workers; see :mod:`.process_env`).
        policy: an existing policy object (in-process: the one the driver's inference also uses).
    """

    def __init__(self, cfg: Config, env_spec, *, rank: int = 0, world_size: int = 1,
                 process_vars: Mapping[str, str] | None = None, policy=None):
        if process_vars is not None:
            process_env.adopt(process_vars)
            from embodirl import runtime

            runtime.set_torch_threads(cfg.runner.torch_threads)
        self.cfg = cfg
        self.spec = env_spec
        self.rank, self.world_size = int(rank), int(world_size)
        self._policy = policy
        self.actor: Actor | None = None
        self.publisher: WeightPublisher | None = None
        self.outbox: WeightOutbox | None = None
        self.offloaded = False
        self._parking = HostParking()   # collocated placement: the actor's host buffers, reused every step
        self._store: TCPStore | None = None   # rank 0: the process group's rendezvous store (rendezvous())

    # --- start --------------------------------------------------------------------------------------
    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address and port the group's process group meets at: the rendezvous store this rank opens
        and keeps, on a port the kernel picks on the node rank 0 runs on (nothing is set by hand, and no port is
        looked up free and bound again later)."""
        try:
            import ray

            address = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        except Exception:
            address = "127.0.0.1"
        self._store = fsdp.tcp_store(address, 0, self.world_size, is_master=True)
        return address, int(self._store.port)

    def setup(self, master_addr: str | None = None, master_port: int | None = None) -> dict:
        """Join the process group (when given rank 0's rendezvous address), build the policy and the actor."""
        device = fsdp.default_device()
        if master_addr is not None:
            store = self._store
            if store is None:
                assert master_port is not None      # given with the address: rank 0's rendezvous()
                store = fsdp.tcp_store(master_addr, int(master_port), self.world_size, is_master=False)
            fsdp.init_process_group(rank=self.rank, world_size=self.world_size, store=store, device=device)
        cfg = self.cfg
        policy = self._policy
        if policy is None:
            policy = build_policy(cfg.model, self.spec, cfg.runner.seed, device=device)
        self.actor = Actor(policy, cfg,     # the actor reads the typed algorithm and actor sections
                           task_table=self.spec.task_descriptions,
                           temperature=_temperature(cfg.rollout), device=device)
        if self.rank == 0:
            self.outbox = WeightOutbox(process_env.describe()["node_id"], device=device)
        return self.info()

    @property
    def _ready_actor(self) -> Actor:
        """The actor :meth:`setup` built (every call after it uses it)."""
        assert self.actor is not None, "setup() first"
        return self.actor

    @property
    def policy(self):
        return self._ready_actor.policy

    def info(self) -> dict:
        info = process_env.describe()
        info.update(rank=self.rank, world_size=self.world_size,
                    device=str(self.actor.device) if self.actor is not None else None,
                    fsdp=bool(self.actor.use_fsdp) if self.actor is not None else None)
        return info

    def ready(self) -> bool:
        return True

    # --- a training step ----------------------------------------------------------------------------
    def ref_logprob(self, shard):
        """``logprob_ref`` ``(n, T, L)`` of this rank's rows under the reference policy (collective)."""
        from embodirl import data as D

        shard = _unpacked(shard)
        self.onload()
        return self._ready_actor.compute_ref_logprob(shard).get(D.LOGPROB_REF).numpy()

    def train(self, shard) -> dict[str, float]:
        """Replay buffer + update epochs on this rank's prepared rows; metrics are global over ranks."""
        shard = _unpacked(shard)
        was_offloaded = self.offloaded
        self.onload()
        metrics = {k: float(v) for k, v in self._ready_actor.train(shard).items()}
        metrics["actor/onloaded"] = float(was_offloaded)   # collocated: the state came back for this update
        return metrics

    def publish_weights(self, *, full: bool = False, gather: bool = True, consumer_nodes=(), consumer_gpus=(),
                        inline: bool = False):
        """Gather what the last update changed (every tensor with ``full``; collective) and, on rank 0,
        post it for the inference workers: returns the :class:`~.weight_transfer.WeightHandle` (other
        ranks: None). ``full`` without ``gather`` (rank 0 only, no collective): every trainable tensor at the
        last published version, posted again (a new or restarted inference worker)."""
        if not gather:
            if not full:
                raise TypeError("publish_weights(gather=False) posts the last publication in full: pass full=True")
            assert self.outbox is not None and self.publisher is not None, "rank 0, after a first publication"
            return self.outbox.post(self.publisher.publish_weights(full=True), set(consumer_nodes), inline=inline,
                                    consumer_gpus=set(consumer_gpus))
        version, tensors = self._ready_actor.publish_weights(full=full)
        if self.rank != 0:
            return None
        if self.publisher is None or full:
            self.publisher = WeightPublisher()
            update = self.publisher.reset(tensors, version)
        else:
            update = self.publisher.publish_weights(tensors, version)
        assert self.outbox is not None                # rank 0's, made by setup()
        return self.outbox.post(update, set(consumer_nodes), inline=inline, consumer_gpus=set(consumer_gpus))

    def set_lr_scale(self, scale: float) -> None:
        """The configured learning rates times ``scale`` from now on (every rank)."""
        self._ready_actor.set_lr_scale(scale)

    def swap_ema(self) -> bool:
        """Exchange the trainable weights with their moving average (``actor.ema_decay``; every rank): before an
        evaluation and after it. Returns whether the module now holds the average."""
        self.onload()
        return self._ready_actor.swap_ema()

    # --- checkpoints --------------------------------------------------------------------------------
    def save(self, actor_dir: str, policy_dir: str | None = None) -> None:
        """Actor state, sharded (every rank); the policy export in its public layout (rank 0)."""
        from embodirl.actor.sharded_state import save_actor

        self.onload()
        save_actor(self._ready_actor, actor_dir)
        if policy_dir is not None:
            tensors = self._ready_actor.gather_trainable(evaluated=True)     # collective; the weights evaluation acts with
            if self.rank == 0:
                self.policy.save_trainable(Path(policy_dir), tensors)

    def load(self, checkpoint_dir: str) -> int:
        """Restore from a run checkpoint ``step_<n>``; returns the restored weight version."""
        from embodirl import checkpoint_layout as layout
        from embodirl.actor.sharded_state import is_sharded_state, load_actor

        source = Path(checkpoint_dir)
        actor_dir = layout.actor_state_dir(source)
        if is_sharded_state(actor_dir):
            load_actor(self._ready_actor, actor_dir)
        else:   # a checkpoint written before the actor state was sharded
            self.policy.load_trainable(source / layout.POLICY)
            state = layout.load_train_state(actor_dir)
            self._ready_actor.load_state_dict({**state, "trainable": self.policy.trainable_state_dict()})
        return self._ready_actor.version

    # --- supervised fine-tuning (embodirl sft) -------------------------------------------------------
    def set_statistics(self, statistics: Mapping) -> None:
        """The dataset statistics the policy (un-)normalises actions and proprio with (every rank)."""
        self.policy.set_statistics(statistics)

    def sft_train(self, shard: Mapping, options: Mapping) -> dict[str, float]:
        """One supervised optimizer step on this rank's samples (:meth:`Actor.sft_update`); global metrics."""
        self.onload()
        return {k: float(v) for k, v in self._ready_actor.sft_update(shard, **options).items()}

    def export(self, directory: str, step: int, marker: Mapping | None = None) -> None:
        """The trained policy in the public OpenVLA-OFT/peft layout (collective gather; rank 0 writes). Under
        FSDP2 rank 0 writes it from a seeded copy of the policy (the same frozen base) with the gathered
        trainable tensors."""
        tensors = self._ready_actor.gather_trainable()
        if self.rank != 0:
            return
        policy = self.policy
        if self._ready_actor.use_fsdp:
            live = policy
            policy = build_policy(self.cfg.model, self.spec, self.cfg.runner.seed)
            policy.load_trainable_state_dict(tensors)
            if live.statistics is not None:
                policy.set_statistics(live.statistics)
        policy.save_pretrained(directory, step=step, marker=marker)

    # --- collocated placement -----------------------------------------------------------------------
    def offload(self) -> None:
        """Parameters, gradients and optimizer state to reused page-locked host buffers (GPU ranks; a no-op on
        the CPU)."""
        if self.offloaded or self.actor is None:
            return
        if self._ready_actor.device.type != "cpu":
            self._parking.offload(self._ready_actor.policy, self._ready_actor.optimizer)
        self.offloaded = True

    def onload(self) -> None:
        if not self.offloaded:
            return
        if self._ready_actor.device.type != "cpu":
            self._parking.onload(self._ready_actor.policy, self._ready_actor.device, self._ready_actor.optimizer)
        self.offloaded = False

    def memory(self) -> dict[str, float]:
        """Peak memory of this rank: the process's peak resident set, and peak GPU bytes on CUDA."""
        import resource

        out = {"peak_rss_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0}
        if torch.cuda.is_available():
            out["gpu_peak_bytes"] = float(torch.cuda.max_memory_allocated())
        return out

    def close(self) -> None:
        if self.outbox is not None:
            self.outbox.close()
        if fsdp.is_distributed():
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception as exc:
                log.debug("destroying the process group: %s", exc)


def _temperature(rollout: RolloutSection) -> float:
    return 1.0 if rollout.temperature is None else float(rollout.temperature)


def _unpacked(shard):
    if isinstance(shard, dict) and "fields" in shard:
        from embodirl.workers.transport import unpack_trajectory

        return unpack_trajectory(shard)
    return shard
