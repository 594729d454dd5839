"""Where the runner's rollouts, evaluations and learner ranks run: one class, in this process or on Ray.

:class:`Rollouts` holds the run's :class:`~embodirl.workers.groups.WorkerGroups` (env workers and rollout
workers) and makes its :class:`~embodirl.workers.actor_group.ActorGroup` (the learner's ranks). The same
worker classes run either way; ``cluster.use_ray`` (:func:`embodirl.placement.use_ray`) only decides
whether they are objects in this process or Ray workers:

* in this process (the default job: no Ray) - one env worker whose simulators run in sub-processes,
  pipeline stages overlapping through a background inference thread, and one rollout worker acting with
  the learner rank's own policy object (no copy: a publication moves only the version);
* Ray - env workers with the shared-memory observation channel to rollout workers holding inference
  copies of the policy, learner ranks as Ray workers on the placement's devices; a local Ray is started
  unless one runs or ``cluster.ray_address`` / ``RAY_ADDRESS`` names a cluster, and shut down after.

=====================================  ========================================================================
``spec``, ``num_slots``                the training (or, evaluation only, the evaluation) env's spec; N slots
``policy``                             the driver's policy object (in this process: the one the learner
                                       trains; Ray: evaluation only, the one a checkpoint is loaded into)
``collect(starts, seed, video_dir,``   one rollout of N slots -> trajectory ``[N, T]``; ``stats`` holds its
``step, greedy)``                      :class:`~embodirl.rollout.collector.RolloutStats` (env / inference / wait)
``make_actors()``                      the learner's ranks
``receive_weights(handle)``            the rollout workers apply the ranks' publication -> ``sync/*`` metrics
``load_weights(tensors, version)``     every trainable tensor: a loaded checkpoint (evaluation only)
``evaluate(step, out_dir, seed)``      the evaluation sweep -> ``eval_info`` dict (``eval_report`` shape),
                                       videos under ``out_dir/videos`` (:func:`~embodirl.runner.evaluation.run_sweep`)
``close()`` (also as context manager)  every worker, simulator and (when started here) Ray is gone after it
=====================================  ========================================================================
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from embodirl.models.registry import make_policy
from embodirl.placement import use_ray
from embodirl.plain import to_plain
from embodirl.rollout.collector import RolloutStats
from embodirl.rollout.starts import EpisodeStarts
from embodirl.runner.evaluation import eval_env_cfg, run_sweep
from embodirl.workers.groups import WorkerGroups
from embodirl.workers.rollout_worker import EVAL

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 60.0          # a normal close: env workers shut their simulators down
CLOSE_WAIT_ON_ERROR_S = 5.0  # after an exception or Ctrl-C the workers may be busy: kill them soon
#: how a publication reached the rollout workers (``RolloutWorker.receive_weights`` paths) -> metric
SYNC_PATHS = {"shm": "sync/shm_workers", "object_store": "sync/object_store_workers", "cuda_ipc": "sync/cuda_ipc_workers"}


def worker_config(cfg: DictConfig) -> DictConfig:
    """The config the worker groups are built from: ``env.train`` with the configured video envs selected
    when training videos are asked for (rendered only during a recorded rollout), ``env.eval`` as
    evaluation runs it (:func:`~embodirl.runner.evaluation.eval_env_cfg`)."""
    worker_cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    train = to_plain(cfg.env.train)
    if int(cfg.runner.train_video_interval or 0) > 0:
        train["video"] = {**(train.get("video") or {}), "enabled": True}
    worker_cfg.env.train = train
    worker_cfg.env.eval = eval_env_cfg(cfg)
    return worker_cfg


class Rollouts:
    """The run's workers (see module docstring); ``train=False``: evaluation only (no training envs)."""

    def __init__(self, cfg: DictConfig, *, train: bool = True):
        self.cfg = cfg
        self.train = train
        self.remote = use_ray(cfg)
        self.stats = RolloutStats()
        self.policy = None
        self.actors = None
        self.groups: WorkerGroups | None = None
        self._transport_logged = False
        self._owns_ray = False
        if self.remote:
            import ray

            from embodirl.workers.ray_cluster import init_ray, ray_address

            self._owns_ray = not ray.is_initialized() and ray_address(cfg.cluster) is None
            init_ray(cfg.cluster)
        try:
            self.groups = WorkerGroups.from_config(worker_config(cfg), remote=self.remote, policy_for=self._policy_for,
                                                   train=train,
                                                   weight_source=self._full_weights if train and self.remote else None)
        except BaseException:
            self._shutdown_ray()
            raise
        self.spec = self.groups.env.spec if train else self.groups.eval_spec()

    def _policy_for(self, spec):
        """The policy object the rollout workers get, once the env spec is known.

        In this process: the driver's, which the learner rank trains (or, evaluation only, a checkpoint is
        loaded into) and the rollout worker acts with. Ray, training: None - the driver holds no weights;
        rollout workers and learner ranks build the policy with the same seeded initialisation (a checkpoint
        in ``model.path`` is loaded by each). Ray, evaluation: the driver's, which loads a run checkpoint's
        trained weights and hands them to the rollout workers (a random initialisation goes to them whole)."""
        if self.remote and self.train:
            return None
        self.policy = make_policy(self.cfg.model, spec)
        return None if self.remote and self.cfg.model.get("path") else self.policy

    @property
    def num_slots(self) -> int:
        return self.groups.env.layout.num_slots

    # --- the learner -------------------------------------------------------------------------------
    def make_actors(self):
        """The learner's ranks: one in this process whose module the rollout worker acts with, or Ray workers
        on the placement's ``actor`` devices."""
        from embodirl.workers.actor_group import ActorGroup

        if self.remote:
            self.actors = ActorGroup.remote_group(self.cfg, self.spec, placement=self.groups._placement,
                                                  process_vars=self.groups._process_vars)
        else:
            self.actors = ActorGroup.local(self.cfg, self.spec, policy=self.policy)
        return self.actors

    def consumer_nodes(self) -> list:
        return self.groups.rollout.consumer_nodes()

    def consumer_gpus(self) -> list:
        """The GPUs rollout workers run on (a publication shares rank 0's GPU buffer with them)."""
        return sorted({info["gpu_uuid"] for info in self.groups.rollout.infos if info.get("gpu_uuid")})

    def _full_weights(self):
        """A restarted rollout worker's weights: a full publication of the actor group's rank 0."""
        return self.actors.full_update(consumer_nodes=self.consumer_nodes(), consumer_gpus=self.consumer_gpus())

    def receive_weights(self, handle) -> dict[str, float]:
        """Every rollout worker applies rank 0's publication; metrics say how it travelled (none when the
        rollout worker shares the rank's module: only the version moves)."""
        self.groups.receive_weights(handle)
        if isinstance(handle, int):
            return {}
        paths = self.groups.rollout.sync_paths
        return {**{metric: float(paths.get(path, 0)) for path, metric in SYNC_PATHS.items()},
                "sync/bytes": float(handle.nbytes)}

    def load_weights(self, tensors: Mapping, version: int) -> None:
        self.groups.load_weights(tensors, version)

    def rng_states(self) -> list[dict] | None:
        """The Ray rollout workers' generator states (None: they sample with the driver's generators)."""
        return self.groups.rollout.rng_states()

    def set_rng_states(self, states: list[dict] | None) -> None:
        self.groups.rollout.set_rng_states(states)

    # --- rollouts ------------------------------------------------------------------------------------
    def collect(self, starts: EpisodeStarts, *, seed: int, video_dir: str | Path | None = None, step: int = 0,
                greedy: bool = False):
        """One rollout of every slot. ``greedy``: the rollout workers' evaluation sampling, greedy with
        ``runner.eval_greedy`` (which config validation requires for ReMax's baseline rollouts)."""
        if self.policy is not None:
            self.policy.eval()           # the learner's module acts here: out of its training mode
        video_dir = None if video_dir is None else str(Path(video_dir).resolve())   # workers' cwd may differ
        batch = self.groups.collect(starts, seed=seed, video_dir=video_dir, step=step, mode=EVAL if greedy else None)
        # env workers run in parallel: the slowest one's split is the rollout's
        per_worker = self.groups.env.last_stats()
        stats = copy.copy(max(per_worker, key=lambda s: s.total_s))
        for key in ("decisions", "restarts", "recollected_rows", "shm_batches", "object_store_batches"):
            setattr(stats, key, sum(getattr(s, key) for s in per_worker))
        self.stats = stats
        if self.remote and not self._transport_logged:        # in this process there is no transport to tell of
            self._transport_logged = True
            shm = sum(bool(info.get("shm")) for info in self.groups.env.transport_infos())
            log.info("rollout transport: %d of %d env workers stream observations through shared memory",
                     shm, len(self.groups.env.workers))
        return batch

    def evaluate(self, *, step: int, out_dir: Path, seed: int) -> dict:
        if self.policy is not None:
            self.policy.eval()
        return run_sweep(self.groups, self.cfg, out_dir=out_dir, seed=seed)

    # --- lifecycle -----------------------------------------------------------------------------------
    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        try:
            if self.actors is not None:
                self.actors.close(kill=wait_s < CLOSE_WAIT_S)
                self.actors = None
            if self.groups is not None:
                self.groups.close(wait_s)
                self.groups = None
        finally:
            self._shutdown_ray()

    def _shutdown_ray(self) -> None:
        if self._owns_ray:
            from embodirl.workers.ray_cluster import shutdown_ray

            shutdown_ray()
            self._owns_ray = False

    def __enter__(self) -> Rollouts:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(CLOSE_WAIT_S if exc_type is None else CLOSE_WAIT_ON_ERROR_S)
