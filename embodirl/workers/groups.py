"""The run's workers: env, inference and actor groups and Ray's lifetime, owned by one object.

:class:`WorkerGroups` is what the runner talks to::

    groups = WorkerGroups.from_config(cfg)              # env + inference workers (Ray started here if needed)
    actors = groups.make_actors()                       # the actor ranks (an ActorGroup)
    groups.publish_weights(full=True)                   # the ranks' publication -> every inference worker
    traj = groups.collect(starts, seed=s)               # Trajectory [N, T], N = env.train.num_envs
    info = run_sweep(groups, cfg, ...)                  # evaluation (runner/evaluation.py) on env.eval workers
    groups.close()                                      # every worker, simulator and (if started here) Ray

The same :class:`~embodirl.workers.env_worker.EnvWorker`, :class:`~embodirl.workers.inference_worker.InferenceWorker`
and :class:`~embodirl.workers.actor_worker.ActorWorker` classes run in this process or on Ray (``cluster.use_ray``);
each group holds its workers in a :class:`~embodirl.workers.worker_set.WorkerSet`, the one place that tells the two
apart. In this process (the default job): one env worker whose simulators run in sub-processes, pipeline stages
overlapping through a background inference thread, and one inference worker acting with the actor rank's own policy
object (a publication moves only the version). On Ray: env workers stream observations through shared memory to
inference workers holding inference copies; actor ranks run on the placement's devices; a local Ray is started
unless one runs or ``cluster.ray_address`` / ``RAY_ADDRESS`` names a cluster, and shut down at :meth:`close`.

A collection is one call per env worker (:meth:`WorkerGroups.collect` -> ``EnvWorker.collect`` -> its
:class:`~embodirl.rollout.collector.RolloutCollector`); the driver concatenates the trajectories in slot order.

Faults (Ray workers; :mod:`embodirl.workers.recovery`):

* an env worker that dies (its process killed) is replaced by a new one with the same arguments and
  placement; its shared memory is swept, and its slots are collected again from the same episode
  starts (GRPO groups stay intact); the event is logged and kept in :attr:`WorkerGroups.events`;
* an inference worker that dies is restarted with the last published weights, the env workers it served
  reconnect, and their slots are collected again;
* a worker that is alive but stuck (a call past its deadline, :mod:`embodirl.workers.deadlines`) raises
  :class:`~embodirl.workers.deadlines.WorkerHung` naming it: an env worker's collection that waits on an inference
  worker which does not answer a liveness probe either names the inference worker. The runner restarts every group
  from the last checkpoint or stops (``runner.worker_deadline.action``); closing the groups kills the named workers
  first (SIGKILL, which a stopped process cannot ignore).

Collocated placement (a component sharing devices with another): with ``rollout.enable_offload`` the
inference workers offload their weights after collection and load them back before the next one;
``env_workers.enable_offload`` does the same for env workers.
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embodirl.algorithms.estimators import uses_critic
from embodirl.channel import segments
from embodirl.models.registry import check_policy_spec
from embodirl.placement import use_ray
from embodirl.rollout.collector import RolloutStats
from embodirl.rollout.starts import EpisodeStarts
from embodirl.schema import Config, run_config
from embodirl.workers import process_env, recovery
from embodirl.workers.deadlines import WorkerHung
from embodirl.workers.env_group import EnvWorkerGroup
from embodirl.workers.env_worker import EnvWorker
from embodirl.workers.inference_group import InferenceGroup
from embodirl.workers.inference_worker import EVAL, TRAIN, sampling_from_config
from embodirl.workers.layout import SlotLayout, layout_from_config, plan_from_config

if TYPE_CHECKING:
    from embodirl.workers.actor_group import ActorGroup
    from embodirl.workers.placement_groups import PlacementPlan

log = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 10_000  # evaluation simulators are seeded apart from training ones
CLOSE_WAIT_S = 60.0          # a normal close: env workers shut their simulators down
CLOSE_WAIT_ON_ERROR_S = 5.0  # after an exception or Ctrl-C the workers may be busy: kill them soon
#: how a publication reached the inference workers (``InferenceWorker.receive_weights`` paths) -> metric
SYNC_PATHS = {"shm": "sync/shm_workers", "object_store": "sync/object_store_workers", "cuda_ipc": "sync/cuda_ipc_workers"}


def trainable_dtype(cfg: Config, train: bool) -> str | None:
    """The dtype a inference copy holds its trainable tensors in: the one the actor ranks compute them in
    (training), so that the rollout's log-probs are the actor's; evaluation only: the policy's own."""
    from embodirl.actor.fsdp import actor_compute_dtype

    return actor_compute_dtype(cfg.actor.fsdp, cfg.model.dtype or "float32") if train else None


class WorkerGroups:
    """The run's workers (see module docstring). Build it with :meth:`from_config`; the evaluation env workers
    (``env.eval``) are made on first use and served by the same inference workers with evaluation sampling."""

    def __init__(self, cfg: Config, *, remote: bool, train: bool):
        self.cfg = cfg
        self.remote = remote
        self.train = train
        self.env: EnvWorkerGroup | None = None        # None: built for evaluation only
        self.eval_env: EnvWorkerGroup | None = None
        self.inference: InferenceGroup | None = None  # None: closed (set by the build, see :attr:`serving`)
        self.actors: ActorGroup | None = None         # the actor ranks, from make_actors()
        self.policy: Any = None                       # the driver's policy object, if it holds one
        self.stats = RolloutStats()                   # the last training collection's timings
        self.rollout_offload = cfg.rollout.enable_offload
        self.env_offload = cfg.env_workers.enable_offload
        self.placement: tuple[PlacementPlan, dict] | None = None    # the plan and its placement groups (Ray)
        self.process_vars: dict[str, str] | None = None
        self._owns_ray = False
        self._transport_logged = False

    @classmethod
    def from_config(cls, cfg: Config, *, remote: bool | None = None, policy=None, policy_for=None,
                    use_placement_groups: bool = True, train: bool = True) -> WorkerGroups:
        """Build the training env workers and the inference workers from a composed config (placement:
        ``cluster.component_placement``). ``remote``: Ray workers (default: ``cluster.use_ray``); Ray is started
        here unless one runs or the config names a cluster. The inference workers build their policy from ``model``
        unless given one: ``policy`` (an existing policy object), or ``policy_for(env_spec)`` called once the env
        spec is known (the driver's policy, kept as :attr:`policy`; in this process the inference workers act with it,
        on Ray they get a copy unless ``model.path`` names a checkpoint each loads itself). ``train=False``
        builds the evaluation env workers instead of the training ones (evaluation only). ``cfg``: the typed config (a
        composed one is converted here)."""
        cfg = run_config(cfg)
        groups = cls(cfg, remote=use_ray(cfg) if remote is None else bool(remote), train=train)
        try:
            groups._build(policy, policy_for, use_placement_groups)
        except BaseException:
            groups.close(CLOSE_WAIT_ON_ERROR_S)
            raise
        return groups

    def _build(self, policy, policy_for, use_placement_groups: bool) -> None:
        cfg = self.cfg
        layout = layout_from_config(cfg, "env.train")
        eval_layout = layout_from_config(cfg, "env.eval")
        if self.remote:
            import ray

            from embodirl.workers.ray_cluster import init_ray, ray_address

            self._owns_ray = not ray.is_initialized() and ray_address(cfg.cluster.ray_address) is None
            init_ray(cfg.cluster.ray_address)
            self.process_vars = process_env.forwarded()
            if use_placement_groups:
                from embodirl.workers.placement_groups import create_placement_groups

                plan = plan_from_config(cfg, layout, eval_layout)
                self.placement = (plan, create_placement_groups(plan))
        # env workers first: the env spec (task table, action bounds) comes from worker 0's simulators
        if self.train:
            self.env = self._env_group("env.train", layout)
        else:
            self.eval_env = self._env_group("env.eval", eval_layout, placement_offset=layout.num_env_workers)
        built = self.env or self.eval_env
        assert built is not None                # one of them was just built
        spec = built.spec
        check_policy_spec(cfg.model, spec)   # a mismatch is one sentence here, not a dead Ray worker's traceback
        if policy_for is not None:
            self.policy = policy = policy_for(spec)
            if self.remote and cfg.model.path:
                policy = None          # each Ray worker loads the checkpoint itself
        elif policy is not None:
            self.policy = policy
        rollout_cfg = cfg.rollout
        self.inference = InferenceGroup(
            cfg.model, spec, num_workers=layout.num_inference_workers, engine=rollout_cfg.backend,
            sampling=sampling_from_config(rollout_cfg, cfg.runner.eval_greedy), remote=self.remote,
            placement=self.placement, process_vars=self.process_vars, policy=policy, seed=cfg.runner.seed,
            init_seed=cfg.runner.seed, weight_source=self._full_weights if self.remote else None,
            trainable_dtype=trainable_dtype(cfg, self.train), merge_lora=rollout_cfg.merge_lora,
            compile_blocks=rollout_cfg.compile, deadline=cfg.runner.worker_deadline)
        for group in (self.env, self.eval_env):
            if group is not None:
                group.attach(self.inference)

    @property
    def serving(self) -> InferenceGroup:
        """The inference workers: built with the groups (:meth:`from_config`), gone only once they are closed."""
        assert self.inference is not None, "the worker groups are closed"
        return self.inference

    def _train_group(self) -> EnvWorkerGroup:
        """The training env workers (groups built for evaluation only have their evaluation ones from the start)."""
        assert self.env is not None, "built for evaluation only (train=False)"
        return self.env

    def _ranks(self) -> ActorGroup:
        assert self.actors is not None, "make_actors() first"
        return self.actors

    def _env_group(self, env_key: str, layout: SlotLayout, placement_offset: int = 0) -> EnvWorkerGroup:
        return _env_group(self.cfg, env_key, layout, remote=self.remote, placement=self.placement,
                          process_vars=self.process_vars, placement_offset=placement_offset)

    @property
    def spec(self):
        """The training env's spec (evaluation only: the evaluation env's)."""
        return (self.env or self._eval_group()).spec

    @property
    def num_slots(self) -> int:
        return self._train_group().layout.num_slots

    # --- the actor ranks and their weights ---------------------------------------------------------
    def make_actors(self):
        """The actor's ranks: one in this process whose module the inference worker acts with, or Ray workers
        on the placement's ``actor`` devices."""
        from embodirl.workers.actor_group import ActorGroup

        if self.remote:
            self.actors = ActorGroup.remote_group(self.cfg, self.spec, placement=self.placement,
                                                  process_vars=self.process_vars)
        else:
            self.actors = ActorGroup.local(self.cfg, self.spec, policy=self.policy)
        return self.actors

    def consumer_gpus(self) -> list:
        """The GPUs inference workers run on (a publication shares rank 0's GPU buffer with them)."""
        return sorted({info["gpu_uuid"] for info in self.serving.infos if info.get("gpu_uuid")})

    def _full_weights(self):
        """A restarted inference worker's weights: the ranks' full publication (None before there are ranks)."""
        if self.actors is None:
            return None
        return self.actors.publish_weights(full=True, gather=False, consumer_nodes=self.serving.consumer_nodes(),
                                           consumer_gpus=self.consumer_gpus())

    def publish_weights(self, *, full: bool = False) -> dict[str, float]:
        """The ranks publish their changed trainable tensors (``full``: all of them) and every inference worker
        applies that publication - the one way weights travel; metrics say how (none when the inference worker shares
        the rank's module: only the version moves)."""
        handle = self._ranks().publish_weights(full=full, consumer_nodes=self.serving.consumer_nodes(),
                                             consumer_gpus=self.consumer_gpus())
        self.serving.receive_weights(handle)
        if isinstance(handle, int):
            return {}
        paths = self.serving.sync_paths
        return {**{metric: float(paths.get(path, 0)) for path, metric in SYNC_PATHS.items()},
                "sync/bytes": float(handle.nbytes)}

    # --- collection ------------------------------------------------------------------------------------
    def collect(self, starts: EpisodeStarts | None = None, *, seed: int | None = None, video_dir=None,
                step: int | None = 0, greedy: bool = False, evaluation: bool = False):
        """One rollout of every slot of the training env (``evaluation``: of ``env.eval``, with evaluation
        sampling): the trajectory ``[N, T]``. ``starts``: each slot's episode start (default: planned from the
        env's task table); ``video_dir``: record the envs the env's ``video`` section selects (paths in
        :attr:`videos`); ``greedy``: sample as evaluation does (ReMax's baseline rollouts). A training collection's
        timings are in :attr:`stats`. Workers that die meanwhile are replaced and their slots collected again."""
        group = self._eval_group() if evaluation else self.env
        if group is None:
            raise RuntimeError("these worker groups were built for evaluation only (train=False)")
        if self.policy is not None:
            self.policy.eval()           # the actor's module acts here: out of its training mode
        video_dir = None if video_dir is None else str(Path(video_dir).resolve())   # workers' cwd may differ
        parts = group.split(starts)
        kwargs = dict(seed=seed, video_dir=video_dir, step=step, packed=self.remote,   # Ray: the cheap form to send
                      mode=EVAL if greedy else None)
        with self._loaded(group):
            pending = {group.workers.call_async(k, EnvWorker.collect, part, **kwargs): k for k, part in enumerate(parts)}
            try:
                results = recovery.settle(group, pending, parts, kwargs)
            except WorkerHung as hung:
                raise self.serving.explain(hung) from None
        batch = group.join(results, video_dir)
        if not evaluation:
            self._record_stats(group)
        return batch

    def evaluate(self, starts: EpisodeStarts | None = None, seed: int | None = None, video_dir=None,
                 step: int | None = 0):
        """One evaluation rollout on ``env.eval`` with evaluation sampling (greedy by default)."""
        return self.collect(starts, seed=seed, video_dir=video_dir, step=step, evaluation=True)

    @contextmanager
    def _loaded(self, group: EnvWorkerGroup):
        """Collocated placement: what a collection needs comes back first, and goes after."""
        if self.rollout_offload:
            self.serving.onload()
        if self.env_offload:
            group.onload()
        try:
            yield
        finally:
            if self.rollout_offload:
                self.serving.offload()
            if self.env_offload:
                group.offload()

    def _record_stats(self, group: EnvWorkerGroup) -> None:
        # env workers run in parallel: the slowest one's split is the rollout's
        per_worker = group.last_stats()
        stats = copy.copy(max(per_worker, key=lambda s: s.total_s))
        for key in ("decisions", "restarts", "recollected_rows", "shm_batches", "object_store_batches"):
            setattr(stats, key, sum(getattr(s, key) for s in per_worker))
        self.stats = stats
        if self.remote and not self._transport_logged:        # in this process there is no transport to tell of
            self._transport_logged = True
            shm = sum(bool(info.get("shm")) for info in group.transport_infos())
            log.info("rollout transport: %d of %d env workers stream observations through shared memory",
                     shm, len(group.workers))

    def eval_spec(self):
        """The evaluation env's spec (builds the evaluation env workers if needed)."""
        return self._eval_group().spec

    def _eval_group(self) -> EnvWorkerGroup:
        if self.eval_env is None:
            self.eval_env = self._env_group("env.eval", layout_from_config(self.cfg, "env.eval"),
                                            placement_offset=self._train_group().layout.num_env_workers)
            self.eval_env.attach(self.serving)
        return self.eval_env

    # --- state -------------------------------------------------------------------------------------------
    def rng_states(self) -> list[dict] | None:
        """The Ray inference workers' generator states (None: they sample with the driver's generators)."""
        return self.serving.rng_states()

    def set_rng_states(self, states: list[dict] | None) -> None:
        self.serving.set_rng_states(states)

    @property
    def events(self) -> list[dict]:
        """Worker deaths and replacements so far (for the run's log)."""
        return [e for g in (self.env, self.eval_env) if g is not None for e in g.events]

    @property
    def videos(self) -> list[str]:
        return [v for g in (self.env, self.eval_env) if g is not None for v in g.videos]

    # --- lifecycle ---------------------------------------------------------------------------------------
    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Stop every worker (``wait_s``: how long env workers may take to close their simulators before they
        are killed), release the placement groups, and shut Ray down if it was started here."""
        groups = [g for g in (self.eval_env, self.env, self.inference) if g is not None]
        pids = [info.get("pid") for group in groups for info in (getattr(group, "infos", None) or [])]
        try:
            if self.actors is not None:
                self.actors.close(kill=wait_s < CLOSE_WAIT_S)
            for group in (self.eval_env, self.env):
                if group is not None:
                    group.close(wait_s)
            if self.inference is not None:
                self.inference.close(min(wait_s, 10.0))
        finally:
            self.actors = self.eval_env = self.env = self.inference = None
            if self.remote:
                # these workers are gone and can create no more entries: remove what one killed mid-way
                # left behind (e.g. a response ring it opened while the run was interrupted)
                for pid in pids:
                    if pid:
                        segments.sweep(segments.process_prefix(pid))
            if self.placement is not None:
                from embodirl.workers.placement_groups import remove_placement_groups

                remove_placement_groups(self.placement[1])
                self.placement = None
            if self._owns_ray:
                from embodirl.workers.ray_cluster import shutdown_ray

                shutdown_ray()
                self._owns_ray = False

    def __enter__(self) -> WorkerGroups:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, WorkerHung):
            exc.kill_local()        # stopped or stuck: it would not close; the others close as after any error
        self.close(CLOSE_WAIT_S if exc_type is None else CLOSE_WAIT_ON_ERROR_S)


def _env_group(cfg: Config, env_key: str, layout: SlotLayout, *, remote: bool, placement, process_vars,
               placement_offset: int = 0) -> EnvWorkerGroup:
    from embodirl.schema.envs import action_conversion

    train = env_key == "env.train"
    channel = cfg.rollout.channel
    return_value = train and cfg.model.value_type is not None and uses_critic(cfg.algorithm.adv_type)
    return EnvWorkerGroup(cfg.env.train if train else cfg.env.eval, layout, remote=remote, return_value=return_value,
                          seed=cfg.runner.seed + (0 if train else EVAL_SEED_OFFSET),
                          use_shm=channel.shm, queue_size=channel.queue_size,
                          placement=placement, process_vars=process_vars, mode=TRAIN if train else EVAL,
                          env_placement_offset=placement_offset, deadline=cfg.runner.worker_deadline,
                          conversion=action_conversion(cfg, env_key))
