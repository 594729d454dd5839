"""Env and rollout worker groups: creation, collection, weight sync, evaluation.

:class:`WorkerGroups` is what the runner talks to::

    groups = WorkerGroups.from_config(cfg)                  # Ray workers (or remote=False: in this process)
    groups.load_weights(learner_all_tensors, version)       # start (or resume) from the learner's weights
    traj = groups.collect()                                 # Trajectory [N, T], N = env.train.num_envs
    groups.sync_weights(learner_changed_tensors, version)   # after each update
    groups.close()

The same :class:`~embodirl.workers.env_worker.EnvWorker` and
:class:`~embodirl.workers.rollout_worker.RolloutWorker` classes run in both cases; each group holds its
workers in a :class:`~embodirl.workers.worker_set.WorkerSet`, the one place that tells an object in this
process from a Ray worker. The slot layout is :mod:`embodirl.workers.layout`'s: each env worker runs the
whole rollout loop itself, so the driver issues one call per env worker and concatenates the returned
trajectories in slot order.

Faults (Ray workers; :mod:`embodirl.workers.recovery`):

* an env worker that dies (its process killed) is replaced by a new one with the same arguments and
  placement; its shared memory is swept, and its slots are collected again from the same episode
  starts (GRPO groups stay intact); the event is logged and kept in :attr:`WorkerGroups.events`;
* a rollout worker that dies is restarted with the last published weights, the env workers it served
  reconnect, and their slots are collected again.

Collocated placement (a component sharing devices with another): with ``rollout.enable_offload`` the
rollout workers offload their weights after collection and load them back before the next one;
``env_workers.enable_offload`` does the same for env workers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
from omegaconf import DictConfig, OmegaConf

from embodirl import data as D
from embodirl.algorithms.advantages import CRITIC_ESTIMATORS
from embodirl.channel import segments
from embodirl.plain import to_plain
from embodirl.rollout.starts import EpisodeStarts, plan_starts
from embodirl.workers import process_env, recovery
from embodirl.workers.env_worker import EnvWorker
from embodirl.workers.layout import RolloutLayout, layout_from_config, plan_from_config
from embodirl.workers.rollout_worker import EVAL, TRAIN, RolloutWorker, sampling_from_config
from embodirl.workers.transport import unpack_trajectory
from embodirl.workers.weight_sync import WeightPublisher
from embodirl.workers.worker_set import WorkerSet

__all__ = ["EnvWorkerGroup", "RolloutLayout", "RolloutWorkerGroup", "WorkerGroups", "layout_from_config",
           "plan_from_config"]

log = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 10_000  # evaluation simulators are seeded apart from training ones


def _placement_options(placement, component: str, offset: int = 0):
    """``WorkerSet`` options for worker ``k`` of ``component`` under ``placement`` ((plan, groups) or None)."""
    if placement is None:
        return None
    from embodirl.workers.placement_groups import worker_options

    plan, groups = placement
    return lambda k: worker_options(plan, groups, component, offset + k)


class RolloutWorkerGroup:
    """R rollout workers. In this process a worker given the driver's ``policy`` acts with that very
    object (no copy, no weight transfer: the learner's updates are its weights) on its device, and samples
    with the driver's generators; a Ray worker gets a copy and seeds its own (``seed + r + R*restarts``)."""

    def __init__(self, model_cfg: Mapping, env_spec, *, num_workers: int, backend: str, sampling: Mapping,
                 remote: bool, placement=None, process_vars: Mapping[str, str] | None = None, policy=None,
                 seed: int | None = None, init_seed: int | None = None, weight_source=None):
        self.model_cfg = to_plain(model_cfg)
        self.env_spec = env_spec
        self.backend = backend
        self.sampling = dict(sampling)
        self.process_vars = dict(process_vars or {})
        self._policy = policy            # an existing policy object instead of building one
        self.seed = seed
        self.init_seed = init_seed       # seeded policy initialisation (the actor ranks use the same)
        self.publisher: WeightPublisher | None = None
        #: where a restarted worker's weights come from when an actor group publishes: a callable
        #: returning a full WeightHandle (None: the driver-side publisher below)
        self.weight_source = weight_source
        self._version = 0                # the last version received from the actor group
        self.sync_paths: dict[str, int] = {}   # how the last publication reached the workers
        self.generation = [0] * num_workers   # bumped at every restart of worker r
        self.workers = WorkerSet(RolloutWorker, remote=remote, options_for=_placement_options(placement, "rollout"))
        self.shares_policy = policy is not None and not remote
        try:
            for r in range(num_workers):
                self._start(r, weights=None)
            self.infos = self.workers.call_all("info")    # remote: also waits until every worker is built
            if weight_source is None and not self.shares_policy:
                self._driver_publisher()
        except BaseException:
            self.close()
            raise

    @property
    def remote(self) -> bool:
        return self.workers.remote

    def __len__(self) -> int:
        return len(self.workers)

    def _driver_publisher(self) -> WeightPublisher:
        if self.publisher is None:
            # what a restarted worker loads when nothing was published yet: worker 0's start weights
            self.publisher = WeightPublisher(self.workers.call(0, "trainable_state_dict"))
        return self.publisher

    def _start(self, r: int, weights) -> None:
        kwargs = dict(backend=self.backend, sampling=self.sampling, weights=weights, process_vars=self.process_vars,
                      policy=self._policy, init_seed=self.init_seed)
        if self.shares_policy:           # the driver's policy acts where it is
            param = next(self._policy.parameters(), None)
            kwargs["device"] = str(param.device) if param is not None else "cpu"
        elif self.seed is not None and self.remote:
            kwargs["seed"] = self.seed + r + len(self.generation) * self.generation[r]
        self.workers.start(r, self.model_cfg, self.env_spec, **kwargs)

    # --- weights -----------------------------------------------------------------------------------
    def sync_weights(self, tensors: Mapping, version: int | None = None) -> int:
        """Publish the learner's changed trainable tensors; every worker holds them on return."""
        return self._send(self._driver_publisher().publish(tensors, version))

    def load_weights(self, tensors: Mapping, version: int) -> int:
        """Replace every trainable tensor by ``tensors`` at ``version`` (a full update): the learner's
        start or resumed weights, or a checkpoint's for evaluation."""
        return self._send(self._driver_publisher().reset(tensors, version))

    def receive_weights(self, handle) -> int:
        """Every worker applies the actor group's publication ``handle`` (it reads the tensors itself:
        shared memory on rank 0's node, the object store elsewhere; a worker sharing the learner's module
        gets the version only, an int); returns the version."""
        answers = self.workers.call_all("receive_weights", handle)
        version = int(handle) if isinstance(handle, int) else handle.version
        versions = [v for v, _ in answers]
        if any(v != version for v in versions):
            raise RuntimeError(f"rollout workers hold weight versions {versions} after publishing v{version}")
        self.sync_paths = {}
        for _, path in answers:
            self.sync_paths[path] = self.sync_paths.get(path, 0) + 1
        self._version = version
        return version

    def consumer_nodes(self) -> list:
        return sorted({info.get("node_id") for info in self.infos}, key=str)

    def _send(self, update) -> int:
        shared = self.workers.share(update)    # one copy in the object store for all workers
        versions = self.workers.call_all("update_weights", shared)
        if any(v != update.version for v in versions):
            raise RuntimeError(f"rollout workers hold weight versions {versions} after publishing v{update.version}")
        return update.version

    @property
    def version(self) -> int:
        if self.weight_source is not None or self.publisher is None:
            return self._version
        return self.publisher.version

    def weight_versions(self) -> list[int]:
        return self.workers.call_all("weight_version")

    def rng_states(self) -> list[dict] | None:
        """Each Ray worker's generator states (it samples actions in its own process); None when the
        workers sample with the driver's generators (saved with the driver's state)."""
        return self.workers.call_all("rng_state") if self.remote else None

    def set_rng_states(self, states: list[dict] | None) -> None:
        """Restore :meth:`rng_states` (a resumed run); skipped with a warning when the number of
        workers changed since they were saved."""
        if not self.remote or states is None:
            return
        if len(states) != len(self.workers):
            log.warning("the checkpoint holds RNG states of %d rollout workers, this run has %d: their action "
                        "sampling is reseeded", len(states), len(self.workers))
            return
        self.workers.call_each("set_rng_state", states)

    # --- faults and lifecycle ------------------------------------------------------------------------
    def restart(self, r: int, cause: str = "") -> None:
        """Replace worker ``r`` by a new one holding the last published weights."""
        self.workers.kill(r)
        log.warning("rollout worker %d died%s; restarting it with weights v%d", r, f" ({cause})" if cause else "",
                    self.version)
        self.generation[r] += 1
        from_actors = self.weight_source is not None
        self._start(r, weights=None if from_actors else self._driver_publisher().full_update())
        self.infos[r] = self.workers.call(r, "info")
        if from_actors:
            self.workers.call(r, "receive_weights", self.weight_source())

    def forget_channels(self, prefix: str) -> None:
        self.workers.call_all("forget_channels", prefix)

    def offload(self) -> None:
        self.workers.call_all("offload")

    def onload(self) -> None:
        self.workers.call_all("onload")

    def close(self) -> None:
        self.workers.close()


def _close_workers(workers: list, remote: bool, wait_s: float = 10.0) -> None:
    """Close ``workers`` (objects in this process, or Ray workers) as :meth:`WorkerSet.close` does."""
    closing = WorkerSet(object, remote=remote)
    closing.handles = list(workers)
    closing.close(wait_s)


class EnvWorkerGroup:
    """K env workers, each connected to its rollout worker (see module docstring)."""

    def __init__(self, env_cfg: Mapping, layout: RolloutLayout, *, remote: bool, return_value: bool, seed: int = 0,
                 use_shm: bool = True, queue_size: int = 4, placement=None,
                 process_vars: Mapping[str, str] | None = None, mode: str = TRAIN,
                 max_faults: int = recovery.DEFAULT_MAX_FAULTS, env_placement_offset: int = 0, env_builder=None):
        self.env_cfg = to_plain(env_cfg)
        self.layout = layout
        self.rollout: RolloutWorkerGroup | None = None
        self.mode = mode
        self.max_faults = max_faults
        self.events: list[dict] = []
        self.videos: list[str] = []
        self._rng = np.random.default_rng(seed)
        self._kwargs = dict(num_stages=layout.num_stages, envs_per_stage=layout.envs_per_stage,
                            num_decisions=layout.num_decisions, group_size=layout.group_size,
                            return_value=return_value, seed=seed, use_shm=use_shm, queue_size=queue_size,
                            process_vars=dict(process_vars or {}), env_builder=env_builder)
        self.workers = WorkerSet(EnvWorker, remote=remote,
                                 options_for=_placement_options(placement, "env", env_placement_offset))
        try:
            for k in range(layout.num_env_workers):
                self.start(k)
            self.infos = self.workers.call_all("info")       # remote: also waits until every worker is built
            self.spec = self.workers.call(0, "spec")
        except BaseException:
            self.close()
            raise
        self._connected_gen = [None] * layout.num_env_workers

    @property
    def remote(self) -> bool:
        return self.workers.remote

    def start(self, k: int) -> None:
        """Create (or replace) env worker ``k`` with its slots."""
        self.workers.start(k, self.env_cfg, **self._kwargs, slot_offset=k * self.layout.slots_per_worker)

    def attach(self, rollout_group: RolloutWorkerGroup) -> None:
        """Connect every env worker to its rollout worker (``k % R``)."""
        self.rollout = rollout_group
        for k in range(len(self.workers)):
            self.connect(k)

    def connect(self, k: int) -> None:
        r = self.layout.rollout_worker_of(k)
        same_node = self.infos[k]["node_id"] == self.rollout.infos[r]["node_id"]
        self.workers.call(k, "connect", self.rollout.workers[r], same_node=same_node, mode=self.mode)
        self._connected_gen[k] = self.rollout.generation[r]

    # --- collection --------------------------------------------------------------------------------
    def plan_starts(self) -> EpisodeStarts:
        return plan_starts(self.env_cfg, self.spec, self.layout.num_slots, self.layout.group_size, self._rng)

    def collect(self, starts: EpisodeStarts | None = None, seed: int | None = None, video_dir: str | None = None,
                step: int = 0, mode: str | None = None):
        """One rollout of all N slots: the trajectory ``[N, T]``, slots in order. ``video_dir``: record
        the envs the config's ``video`` section selects (paths in :attr:`videos`). ``mode``: the rollout
        workers' sampling mode for this rollout only (default: the group's). Workers that die meanwhile
        are replaced and their slots collected again (:func:`~embodirl.workers.recovery.collect_all`)."""
        starts = starts if starts is not None else self.plan_starts()
        if len(starts) != self.layout.num_slots:
            raise ValueError(f"starts cover {len(starts)} slots, the group has {self.layout.num_slots}")
        per = self.layout.slots_per_worker
        parts = [starts.slice(k * per, (k + 1) * per) for k in range(len(self.workers))]
        kwargs = dict(seed=seed, video_dir=None if video_dir is None else str(video_dir), step=step,
                      packed=self.remote)        # through Ray: the cheap form to send
        if mode is not None:
            kwargs["mode"] = mode
        results = recovery.collect_all(self, parts, kwargs)
        self.videos = [v for vs in self.workers.call_all("videos_written") for v in vs] if video_dir else []
        return D.concat([unpack_trajectory(r) if self.remote else r for r in results])

    def transport_infos(self) -> list[dict]:
        """How each env worker's observations reach its rollout worker (shared memory or Ray)."""
        return self.workers.call_all("transport_info")

    def last_stats(self) -> list:
        """Every env worker's :class:`~embodirl.rollout.collector.RolloutStats` of the last collection."""
        return self.workers.call_all("last_stats")

    def env_worker_pids(self) -> list[int]:
        return [info["pid"] for info in self.infos]

    def offload(self) -> None:
        self.workers.call_all("offload")

    def onload(self) -> None:
        self.workers.call_all("onload")

    def close(self, wait_s: float = 60.0) -> None:
        self.workers.close(wait_s)


class WorkerGroups:
    """The runner's handle on rollout collection (see module docstring). Build it with
    :meth:`from_config`; :meth:`evaluate` creates the evaluation env workers (``env.eval``) on first use
    and serves them from the same rollout workers with evaluation sampling."""

    def __init__(self, cfg: DictConfig, env_group: EnvWorkerGroup | None, rollout_group: RolloutWorkerGroup, *,
                 remote: bool, placement=None, process_vars: Mapping[str, str] | None = None,
                 eval_env_group: EnvWorkerGroup | None = None):
        self.cfg = cfg
        self.env = env_group              # None: built for evaluation only
        self.rollout = rollout_group
        self.remote = remote
        self.rollout_offload = bool(cfg.rollout.get("enable_offload", False))
        self.env_offload = bool(cfg.env_workers.get("enable_offload", False))
        self.eval_env = eval_env_group
        self._placement = placement
        self._process_vars = process_vars

    @classmethod
    def from_config(cls, cfg: DictConfig, *, remote: bool = True, policy=None, policy_for=None,
                    use_placement_groups: bool = True, train: bool = True, weight_source=None) -> WorkerGroups:
        """Build the training env workers and the rollout workers from a composed config (placement:
        ``cluster.component_placement``; Ray: :func:`~embodirl.workers.ray_cluster.init_ray`).
        ``remote=False`` runs every worker in this process. The rollout workers build their policy from
        ``model`` unless given one: ``policy`` (an existing policy object), or ``policy_for(env_spec)``
        called once the env spec is known (returning a policy object, or None to build from ``model``).
        ``train=False`` builds the evaluation env workers instead of the training ones (evaluation only).
        ``weight_source``: a callable giving the actor group's full publication (a
        :class:`~embodirl.workers.weight_transfer.WeightHandle`) for restarted rollout workers; the
        driver then keeps no copy of the weights."""
        layout = layout_from_config(cfg, "env.train")
        eval_layout = layout_from_config(cfg, "env.eval")
        placement = process_vars = None
        if remote:
            from embodirl.workers.ray_cluster import init_ray

            init_ray(cfg.cluster)
            process_vars = process_env.forwarded()
            if use_placement_groups:
                from embodirl.workers.placement_groups import create_placement_groups

                plan = plan_from_config(cfg, layout, eval_layout)
                placement = (plan, create_placement_groups(plan))
        # env workers first: the env spec (task table, action bounds) comes from worker 0's simulators
        env_group = eval_group = None
        try:
            if train:
                env_group = _env_group(cfg, "env.train", layout, remote=remote, placement=placement,
                                       process_vars=process_vars)
            else:
                eval_group = _env_group(cfg, "env.eval", eval_layout, remote=remote, placement=placement,
                                        process_vars=process_vars, placement_offset=layout.num_env_workers)
            spec = (env_group or eval_group).spec
            if policy_for is not None:
                policy = policy_for(spec)
            rollout_cfg = to_plain(cfg.rollout)
            rollout_group = RolloutWorkerGroup(cfg.model, spec, num_workers=layout.num_rollout_workers,
                                               backend=rollout_cfg["backend"],
                                               sampling=sampling_from_config(rollout_cfg, cfg.runner.eval_greedy),
                                               remote=remote,
                                               placement=placement, process_vars=process_vars, policy=policy,
                                               seed=int(cfg.runner.seed), init_seed=int(cfg.runner.seed),
                                               weight_source=weight_source)
            for group in (env_group, eval_group):
                if group is not None:
                    group.attach(rollout_group)
        except BaseException:
            for group in (env_group, eval_group):
                if group is not None:
                    group.close()
            if placement is not None:
                from embodirl.workers.placement_groups import remove_placement_groups

                remove_placement_groups(placement[1])
            raise
        return cls(cfg, env_group, rollout_group, remote=remote, placement=placement, process_vars=process_vars,
                   eval_env_group=eval_group)

    # --- phases ------------------------------------------------------------------------------------
    def collect(self, starts: EpisodeStarts | None = None, seed: int | None = None, video_dir: str | None = None,
                step: int = 0, mode: str | None = None):
        """One training rollout: the trajectory ``[N, T]`` (``N = env.train.num_envs``); ``mode=EVAL``
        samples as evaluation does (ReMax's greedy baseline rollout)."""
        if self.env is None:
            raise RuntimeError("these worker groups were built for evaluation only (train=False)")
        return self._phase(self.env, starts, seed, video_dir, step, mode)

    def evaluate(self, starts: EpisodeStarts | None = None, seed: int | None = None, video_dir: str | None = None,
                 step: int = 0):
        """One evaluation rollout on ``env.eval`` with evaluation sampling (greedy by default)."""
        return self._phase(self._eval_group(), starts, seed, video_dir, step)

    def eval_spec(self):
        """The evaluation env's spec (builds the evaluation env workers if needed)."""
        return self._eval_group().spec

    def _eval_group(self) -> EnvWorkerGroup:
        if self.eval_env is None:
            layout = layout_from_config(self.cfg, "env.eval")
            self.eval_env = _env_group(self.cfg, "env.eval", layout, remote=self.remote, placement=self._placement,
                                       process_vars=self._process_vars,
                                       placement_offset=self.env.layout.num_env_workers)
            self.eval_env.attach(self.rollout)
        return self.eval_env

    def _phase(self, group: EnvWorkerGroup, starts, seed, video_dir, step, mode=None):
        # collocated placement: what the rollout phase needs comes back first, and goes after
        if self.rollout_offload:
            self.rollout.onload()
        if self.env_offload:
            group.onload()
        try:
            return group.collect(starts, seed=seed, video_dir=video_dir, step=step, mode=mode)
        finally:
            if self.rollout_offload:
                self.rollout.offload()
            if self.env_offload:
                group.offload()

    def sync_weights(self, tensors: Mapping, version: int | None = None) -> int:
        """Publish the learner's changed trainable tensors to every rollout worker; returns the version."""
        return self.rollout.sync_weights(tensors, version)

    def receive_weights(self, handle) -> int:
        """Every rollout worker applies the actor group's publication ``handle``."""
        return self.rollout.receive_weights(handle)

    def load_weights(self, tensors: Mapping, version: int) -> int:
        """Give every rollout worker all trainable tensors at ``version`` (start, resume, evaluation of
        a checkpoint); later :meth:`sync_weights` deltas build on them."""
        return self.rollout.load_weights(tensors, version)

    @property
    def events(self) -> list[dict]:
        """Worker deaths and replacements so far (for the run's log)."""
        return [e for g in (self.env, self.eval_env) if g is not None for e in g.events]

    @property
    def videos(self) -> list[str]:
        return [v for g in (self.env, self.eval_env) if g is not None for v in g.videos]

    def close(self, wait_s: float = 60.0) -> None:
        """Stop every worker (``wait_s``: how long env workers may take to close their simulators before
        they are killed) and release the placement groups."""
        pids = [info.get("pid") for group in (self.eval_env, self.env, self.rollout) if group is not None
                for info in (getattr(group, "infos", None) or [])]
        try:
            for group in (self.eval_env, self.env):
                if group is not None:
                    group.close(wait_s)
            self.rollout.close()
        finally:
            self.eval_env = self.env = None
            if self.remote:
                # these workers are gone and can create no more entries: remove what one killed mid-way
                # left behind (e.g. a response ring it opened while the run was interrupted)
                for pid in pids:
                    if pid:
                        segments.sweep(segments.process_prefix(pid))
            if self._placement is not None:
                from embodirl.workers.placement_groups import remove_placement_groups

                remove_placement_groups(self._placement[1])
                self._placement = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _env_group(cfg: DictConfig, env_key: str, layout: RolloutLayout, *, remote: bool, placement, process_vars,
               placement_offset: int = 0) -> EnvWorkerGroup:
    train = env_key == "env.train"
    channel = cfg.rollout.get("channel") or {}
    return_value = train and cfg.model.get("value_type") is not None and cfg.algorithm.adv_type in CRITIC_ESTIMATORS
    return EnvWorkerGroup(OmegaConf.select(cfg, env_key), layout, remote=remote, return_value=return_value,
                          seed=int(cfg.runner.seed) + (0 if train else EVAL_SEED_OFFSET),
                          use_shm=bool(channel.get("shm", True)), queue_size=int(channel.get("queue_size", 4)),
                          placement=placement, process_vars=process_vars, mode=TRAIN if train else EVAL,
                          env_placement_offset=placement_offset)
