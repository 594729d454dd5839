"""Env and rollout worker groups: creation, placement, collection, weight sync and fault recovery.

:class:`WorkerGroups` is what the runner talks to::

    groups = WorkerGroups.from_config(cfg)                  # Ray actors (or remote=False: in-process)
    groups.load_weights(learner_all_tensors, version)       # start (or resume) from the learner's weights
    traj = groups.collect()                                 # Trajectory [N, T], N = env.train.num_envs
    groups.sync_weights(learner_changed_tensors, version)   # after each update
    groups.close()

Layout (``K = env_workers.num_workers``, ``S = rollout.pipeline_stage_num``, ``R =
rollout.num_workers``): env worker ``k`` holds S stages of ``B = N / (K*S)`` simulators, i.e. slots
``k*S*B .. (k+1)*S*B - 1``, and is served by rollout worker ``k % R``. Each env worker runs the whole
rollout loop itself (:class:`~embodirl.workers.env_worker.EnvWorker`), so the driver issues one call
per env worker and concatenates the returned trajectories in slot order.

Faults (remote mode):

* an env worker that dies (its process killed) is replaced by a new actor with the same arguments and
  placement; its shared memory is swept, and its slots are collected again from the same episode
  starts (GRPO groups stay intact); the event is logged and kept in :attr:`WorkerGroups.events`;
* a rollout worker that dies is restarted with the last published weights (a full update from the
  :class:`~embodirl.workers.weight_sync.WeightPublisher`), the env workers it served reconnect, and
  their slots are collected again.

Collocated placement (a component sharing devices with another): with ``rollout.enable_offload`` the
rollout workers offload their weights after collection and load them back before the next one;
``env_workers.enable_offload`` does the same for env workers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from omegaconf import DictConfig, OmegaConf

from embodirl import data as D
from embodirl.algorithms.advantages import CRITIC_ESTIMATORS
from embodirl.channel import segments
from embodirl.errors import ConfigError
from embodirl.plain import to_plain
from embodirl.rollout.records import decisions_per_episode
from embodirl.rollout.starts import EpisodeStarts, plan_starts
from embodirl.workers import process_env
from embodirl.workers.env_worker import EnvWorker
from embodirl.workers.rollout_worker import EVAL, TRAIN, RolloutWorker, sampling_from_config
from embodirl.workers.transport import RolloutWorkerDied, unpack_trajectory
from embodirl.workers.weight_sync import WeightPublisher

log = logging.getLogger(__name__)

DEFAULT_MAX_FAULTS = 8   # worker replacements tolerated within one collect() before giving up
EVAL_SEED_OFFSET = 10_000  # evaluation simulators are seeded apart from training ones


class TooManyFaults(RuntimeError):
    """Workers kept dying during one collection."""


@dataclass(frozen=True)
class RolloutLayout:
    """How N env slots split over K env workers x S stages x B simulators, served by R rollout
    workers, for T decisions."""

    num_env_workers: int      # K
    num_stages: int           # S
    envs_per_stage: int       # B
    num_rollout_workers: int  # R
    num_decisions: int        # T
    group_size: int = 1       # G

    @property
    def num_slots(self) -> int:
        return self.num_env_workers * self.num_stages * self.envs_per_stage

    @property
    def slots_per_worker(self) -> int:
        return self.num_stages * self.envs_per_stage

    def rollout_worker_of(self, k: int) -> int:
        return k % self.num_rollout_workers


def layout_from_config(cfg: DictConfig, env_key: str = "env.train") -> RolloutLayout:
    """The layout a composed config asks for (``env_key``: ``env.train`` or ``env.eval``).

    Evaluation gets its own env workers: as many as training has when they divide ``env.eval.num_envs``
    (else one), without pipelining, each episode run to its time limit (``rollout.max_decisions`` is a
    training horizon)."""
    env_cfg = OmegaConf.select(cfg, env_key)
    N = int(env_cfg.num_envs)
    K, S = int(cfg.env_workers.num_workers), int(cfg.rollout.pipeline_stage_num)
    if env_key != "env.train":
        S = 1
        K = K if N % K == 0 else 1
    if N % (K * S):
        raise ConfigError(f"{env_key}.num_envs", f"{N} envs cannot be split over env_workers.num_workers x "
                                                 f"rollout.pipeline_stage_num = {K} x {S}")
    if env_key == "env.train":
        T = decisions_per_episode(cfg, env_key)
    else:
        T = math.ceil(int(env_cfg.max_episode_steps) / int(cfg.model.action_chunk))
    G = int(cfg.algorithm.group_size) if env_key == "env.train" else 1
    return RolloutLayout(K, S, N // (K * S), int(cfg.rollout.num_workers), T, G)


class RolloutWorkerGroup:
    """R rollout workers (objects in-process, or Ray actors)."""

    def __init__(self, model_cfg: Mapping, env_spec, *, num_workers: int, backend: str, sampling: Mapping,
                 remote: bool, placement=None, process_vars: Mapping[str, str] | None = None, policy=None,
                 seed: int | None = None, init_seed: int | None = None, weight_source=None):
        self.model_cfg = to_plain(model_cfg)
        self.env_spec = env_spec
        self.backend = backend
        self.sampling = dict(sampling)
        self.remote = remote
        self.placement = placement       # (plan, groups) or None
        self.process_vars = dict(process_vars or {})
        self._policy = policy            # an existing policy object instead of building one (pickled to actors)
        self.seed = seed                 # remote workers: worker r (restart g) samples from seed + r + R*g
        self.init_seed = init_seed       # seeded policy initialisation (the actor ranks use the same)
        self.publisher: WeightPublisher | None = None
        #: where a restarted worker's weights come from when an actor group publishes: a callable
        #: returning a full WeightHandle (None: the driver-side publisher below)
        self.weight_source = weight_source
        self._version = 0                # the last version received from the actor group
        self.sync_paths: dict[str, int] = {}   # how the last publication reached the workers
        self.generation = [0] * num_workers   # bumped at every restart of worker r
        self.workers = []
        try:
            for r in range(num_workers):
                self.workers.append(self._create(r, weights=None))
            self.infos = self._call_all("info")       # remote: also waits until every worker is built
            if weight_source is None and (remote or policy is None):
                # (in-process workers acting with the driver's own policy object need no copy of it)
                self._driver_publisher()
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.workers)

    def _driver_publisher(self) -> WeightPublisher:
        if self.publisher is None:
            # what a restarted worker loads when nothing was published yet: worker 0's start weights
            self.publisher = WeightPublisher(self._call(0, "trainable_state_dict"))
        return self.publisher

    def _create(self, r: int, weights):
        kwargs = dict(backend=self.backend, sampling=self.sampling, weights=weights, process_vars=self.process_vars,
                      policy=self._policy, init_seed=self.init_seed)
        if not self.remote:
            if self._policy is not None:          # the driver's policy acts where it is
                param = next(self._policy.parameters(), None)
                kwargs["device"] = str(param.device) if param is not None else "cpu"
            return RolloutWorker(self.model_cfg, self.env_spec, **kwargs)
        if self.seed is not None:
            kwargs["seed"] = self.seed + r + len(self.generation) * self.generation[r]
        import ray

        options = {"max_restarts": 0}
        if self.placement is not None:
            from embodirl.workers.placement_groups import actor_options

            plan, groups = self.placement
            options.update(actor_options(plan, groups, "rollout", r))
        return ray.remote(RolloutWorker).options(**options).remote(self.model_cfg, self.env_spec, **kwargs)

    def _call(self, r: int, method: str, *args, **kwargs):
        worker = self.workers[r]
        if not self.remote:
            return getattr(worker, method)(*args, **kwargs)
        import ray

        return ray.get(getattr(worker, method).remote(*args, **kwargs))

    def _call_all(self, method: str, *args, **kwargs) -> list:
        if not self.remote:
            return [getattr(w, method)(*args, **kwargs) for w in self.workers]
        import ray

        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

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
        shared memory on rank 0's node, the object store elsewhere); returns the version."""
        answers = self._call_all("receive_weights", handle)
        versions = [v for v, _ in answers]
        if any(v != handle.version for v in versions):
            raise RuntimeError(f"rollout workers hold weight versions {versions} after publishing v{handle.version}")
        self.sync_paths = {}
        for _, path in answers:
            self.sync_paths[path] = self.sync_paths.get(path, 0) + 1
        self._version = handle.version
        return handle.version

    def consumer_nodes(self) -> list:
        return sorted({info.get("node_id") for info in self.infos}, key=str)

    def _send(self, update) -> int:
        if self.remote:
            import ray

            ref = ray.put(update)   # one copy in the object store for all workers
            versions = ray.get([w.update_weights.remote(ref) for w in self.workers])
        else:
            versions = [w.update_weights(update) for w in self.workers]
        if any(v != update.version for v in versions):
            raise RuntimeError(f"rollout workers hold weight versions {versions} after publishing v{update.version}")
        return update.version

    @property
    def version(self) -> int:
        if self.weight_source is not None:
            return self._version
        return self._driver_publisher().version

    def weight_versions(self) -> list[int]:
        return self._call_all("weight_version")

    def rng_states(self) -> list[dict] | None:
        """Each remote worker's generator states (it samples actions in its own process); None
        in-process, where the workers use the driver's generators."""
        return self._call_all("rng_state") if self.remote else None

    def set_rng_states(self, states: list[dict] | None) -> None:
        """Restore :meth:`rng_states` (a resumed run); skipped with a warning when the number of
        workers changed since they were saved."""
        if not self.remote or states is None:
            return
        if len(states) != len(self.workers):
            log.warning("the checkpoint holds RNG states of %d rollout workers, this run has %d: their action "
                        "sampling is reseeded", len(states), len(self.workers))
            return
        import ray

        ray.get([w.set_rng_state.remote(state) for w, state in zip(self.workers, states)])

    # --- faults and lifecycle ------------------------------------------------------------------------
    def restart(self, r: int, cause: str = "") -> None:
        """Replace worker ``r`` by a new one holding the last published weights."""
        old = self.workers[r]
        if self.remote:
            import ray

            try:
                ray.kill(old, no_restart=True)
            except Exception:
                pass
        log.warning("rollout worker %d died%s; restarting it with weights v%d", r, f" ({cause})" if cause else "",
                    self.version)
        self.generation[r] += 1
        from_actors = self.weight_source is not None
        self.workers[r] = self._create(r, weights=None if from_actors else self._driver_publisher().full_update())
        if self.remote:
            import ray

            ray.get(self.workers[r].ready.remote())
        self.infos[r] = self._call(r, "info")
        if from_actors:
            self._call(r, "receive_weights", self.weight_source())

    def forget_channels(self, prefix: str) -> None:
        self._call_all("forget_channels", prefix)

    def offload(self) -> None:
        self._call_all("offload")

    def onload(self) -> None:
        self._call_all("onload")

    def close(self) -> None:
        _close_workers(self.workers, self.remote)
        self.workers = []


def _close_workers(workers: list, remote: bool, wait_s: float = 10.0) -> None:
    """Close workers: remote actors get ``wait_s`` to close (simulators, shared-memory rings they
    created) and are then killed (a dead one is already gone); in-process workers just close."""
    if not remote:
        for w in workers:
            w.close()
        return
    import ray

    try:
        ray.get([w.close.remote() for w in workers], timeout=wait_s)
    except Exception as exc:
        log.debug("closing workers: %s", exc)
    for w in workers:
        try:
            ray.kill(w, no_restart=True)
        except Exception as exc:
            log.debug("killing worker: %s", exc)


class EnvWorkerGroup:
    """K env workers, each connected to its rollout worker (see module docstring)."""

    def __init__(self, env_cfg: Mapping, layout: RolloutLayout, *, remote: bool, return_value: bool, seed: int = 0,
                 use_shm: bool = True, queue_size: int = 4, placement=None,
                 process_vars: Mapping[str, str] | None = None, mode: str = TRAIN,
                 max_faults: int = DEFAULT_MAX_FAULTS, env_placement_offset: int = 0, env_builder=None):
        self.env_cfg = to_plain(env_cfg)
        self.layout = layout
        self.rollout: RolloutWorkerGroup | None = None
        self.remote = remote
        self.mode = mode
        self.placement = placement
        self.max_faults = max_faults
        self.events: list[dict] = []
        self.videos: list[str] = []
        self._rng = np.random.default_rng(seed)
        self._placement_offset = env_placement_offset
        self._kwargs = dict(num_stages=layout.num_stages, envs_per_stage=layout.envs_per_stage,
                            num_decisions=layout.num_decisions, group_size=layout.group_size,
                            return_value=return_value, seed=seed, use_shm=use_shm, queue_size=queue_size,
                            process_vars=dict(process_vars or {}), env_builder=env_builder)
        self.workers = []
        try:
            for k in range(layout.num_env_workers):
                self.workers.append(self._create(k))
            self.infos = self._call_all("info")       # remote: also waits until every worker is built
            self.spec = self._call_all("spec")[0]
        except BaseException:
            self.close()
            raise
        self._connected_gen = [None] * layout.num_env_workers

    def attach(self, rollout_group: RolloutWorkerGroup) -> None:
        """Connect every env worker to its rollout worker (``k % R``)."""
        self.rollout = rollout_group
        for k in range(len(self.workers)):
            self._connect(k)

    def _create(self, k: int):
        kwargs = dict(self._kwargs, slot_offset=k * self.layout.slots_per_worker)
        if not self.remote:
            return EnvWorker(self.env_cfg, **kwargs)
        import ray

        options = {"max_restarts": 0}
        if self.placement is not None:
            from embodirl.workers.placement_groups import actor_options

            plan, groups = self.placement
            options.update(actor_options(plan, groups, "env", self._placement_offset + k))
        return ray.remote(EnvWorker).options(**options).remote(self.env_cfg, **kwargs)

    def _call_all(self, method: str, *args, **kwargs) -> list:
        if not self.remote:
            return [getattr(w, method)(*args, **kwargs) for w in self.workers]
        import ray

        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def _connect(self, k: int) -> None:
        r = self.layout.rollout_worker_of(k)
        rollout = self.rollout.workers[r]
        if not self.remote:
            self.workers[k].connect_local(rollout, mode=self.mode)
        else:
            import ray

            same_node = self.infos[k]["node_id"] == self.rollout.infos[r]["node_id"]
            ray.get(self.workers[k].connect_remote.remote(rollout, same_node=same_node, mode=self.mode))
        self._connected_gen[k] = self.rollout.generation[r]

    # --- collection --------------------------------------------------------------------------------
    def plan_starts(self) -> EpisodeStarts:
        return plan_starts(self.env_cfg, self.spec, self.layout.num_slots, self.layout.group_size, self._rng)

    def collect(self, starts: EpisodeStarts | None = None, seed: int | None = None, video_dir: str | None = None,
                step: int = 0, mode: str | None = None):
        """One rollout of all N slots: the trajectory ``[N, T]``, slots in order. ``video_dir``: record
        the envs the config's ``video`` section selects (paths in :attr:`videos`). ``mode``: the rollout
        workers' sampling mode for this rollout only (default: the group's)."""
        starts = starts if starts is not None else self.plan_starts()
        if len(starts) != self.layout.num_slots:
            raise ValueError(f"starts cover {len(starts)} slots, the group has {self.layout.num_slots}")
        per = self.layout.slots_per_worker
        parts = [starts.slice(k * per, (k + 1) * per) for k in range(len(self.workers))]
        kwargs = dict(seed=seed, video_dir=None if video_dir is None else str(video_dir), step=step)
        if mode is not None:
            kwargs["mode"] = mode
        if not self.remote:
            results = [w.collect(p, **kwargs) for w, p in zip(self.workers, parts)]
            self.videos = [v for w in self.workers for v in w.videos_written()] if video_dir else []
            return D.concat(results)
        results = [unpack_trajectory(r) for r in self._collect_remote(parts, dict(kwargs, packed=True))]
        self.videos = []
        if video_dir:
            import ray

            self.videos = [v for vs in ray.get([w.videos_written.remote() for w in self.workers]) for v in vs]
        return D.concat(results)

    def _collect_remote(self, parts: list[EpisodeStarts], kwargs: dict) -> list:
        import ray
        from ray.exceptions import RayActorError

        results: list = [None] * len(self.workers)
        pending = {self.workers[k].collect.remote(parts[k], **kwargs): k for k in range(len(self.workers))}
        faults = 0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            ref = ready[0]
            k = pending.pop(ref)
            try:
                results[k] = ray.get(ref)
                continue
            except RolloutWorkerDied as exc:
                self._recover_rollout(k, exc)
            except RayActorError as exc:
                self._replace_env_worker(k, exc)
            faults += 1
            if faults > self.max_faults:
                raise TooManyFaults(f"workers died {faults} times during one collection; giving up")
            pending[self.workers[k].collect.remote(parts[k], **kwargs)] = k
        return results

    def _replace_env_worker(self, k: int, cause: BaseException) -> None:
        import ray

        pid = self.infos[k]["pid"]
        try:
            ray.kill(self.workers[k], no_restart=True)
        except Exception:
            pass
        prefix = segments.process_prefix(pid)
        swept = segments.sweep(prefix)
        try:
            self.rollout.forget_channels(prefix)
        except Exception as exc:
            log.debug("rollout workers could not unmap %s: %s", prefix, exc)
        first = k * self.layout.slots_per_worker
        log.warning("env worker %d (pid %d) died; replacing it and collecting its %d episodes (slots %d..%d) again%s",
                    k, pid, self.layout.slots_per_worker, first, first + self.layout.slots_per_worker - 1,
                    f"; removed {len(swept)} shared-memory entries it left" if swept else "")
        self.events.append({"event": "env_worker_replaced", "worker": k, "pid": pid, "time": time.time(),
                            "cause": type(cause).__name__})
        self.workers[k] = self._create(k)
        ray.get(self.workers[k].ready.remote())
        self.infos[k] = ray.get(self.workers[k].info.remote())
        self._connect(k)

    def _recover_rollout(self, k: int, cause: BaseException) -> None:
        r = self.layout.rollout_worker_of(k)
        if self._connected_gen[k] == self.rollout.generation[r]:   # nobody restarted it yet
            self.rollout.restart(r, cause=str(cause).splitlines()[0])
            self.events.append({"event": "rollout_worker_restarted", "worker": r, "time": time.time(),
                                "version": self.rollout.version})
        self._connect(k)

    def transport_infos(self) -> list[dict]:
        """How each env worker's observations reach its rollout worker (shared memory or Ray)."""
        return self._call_all("transport_info")

    def last_stats(self) -> list:
        """Every env worker's :class:`~embodirl.rollout.collector.RolloutStats` of the last collection."""
        return self._call_all("last_stats")

    def env_worker_pids(self) -> list[int]:
        return [info["pid"] for info in self.infos]

    def offload(self) -> None:
        self._call_all("offload")

    def onload(self) -> None:
        self._call_all("onload")

    def close(self, wait_s: float = 60.0) -> None:
        _close_workers(self.workers, self.remote, wait_s)
        self.workers = []


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


def plan_from_config(cfg: DictConfig, layout: RolloutLayout, eval_layout: RolloutLayout | None = None):
    """The placement plan for this layout (and the evaluation env workers, placed after the training
    ones) plus the learner's ranks (``actor``)."""
    from embodirl.placement import data_parallel_size, placement_from_config
    from embodirl.workers.placement_groups import plan_placement

    num_nodes = int(cfg.cluster.num_nodes)
    placement = placement_from_config(cfg.cluster)
    num_env = layout.num_env_workers + (eval_layout.num_env_workers if eval_layout is not None else 0)
    workers = {"env": num_env, "rollout": layout.num_rollout_workers,
               "actor": data_parallel_size(cfg, placement)}
    return plan_placement(placement, workers, num_nodes=num_nodes)
