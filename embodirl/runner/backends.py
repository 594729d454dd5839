"""Where the runner's rollouts and evaluations run: in this process, or on Ray worker groups.

Both collection back-ends (not to be confused with ``rollout.backend``, the inference engine inside a
rollout worker) offer the runner one interface:

=====================================  ========================================================================
``spec``, ``num_slots``                the training (or, evaluation only, the evaluation) env's spec; N slots
``policy``                             the driver's policy object: the learner trains it
``collect(starts, seed, video_dir,``   one rollout of N slots -> trajectory ``[N, T]``; ``stats`` holds its
``step)``                              :class:`~embodirl.rollout.collector.RolloutStats` (env / inference / wait)
``load_weights(tensors, version)``     every trainable tensor: the start, a resumed run, a loaded checkpoint
``sync_weights(tensors, version)``     the tensors one update changed
``evaluate(step, out_dir, seed)``      the evaluation sweep -> ``eval_info`` dict (``eval_report`` shape),
                                       videos under ``out_dir/videos``: :func:`~embodirl.runner.evaluation.run_sweep`
                                       on evaluation env workers, the same for both
``close()`` (also as context manager)  every worker, simulator and (when started here) Ray is gone after it
=====================================  ========================================================================

* :class:`InProcessBackend` - env batches (simulators in sub-processes) and the learner's own policy
  acting in this process; pipeline stages overlap through a background inference thread; evaluation
  on in-process :class:`~embodirl.workers.groups.WorkerGroups` (an env worker with the evaluation
  simulators, kept between evaluations, and a rollout worker acting with that same policy object).
* :class:`RayBackend` - :class:`~embodirl.workers.groups.WorkerGroups` as Ray actors: env workers
  with the shared-memory observation channel to rollout workers holding inference copies of the
  policy; evaluation env workers (kept between evaluations) served by the same rollout workers.

:func:`open_backend` picks one by :func:`embodirl.config.use_ray` (``cluster.use_ray``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from embodirl.algorithms.advantages import CRITIC_ESTIMATORS
from embodirl.envs.registry import make_env
from embodirl.models.base import SamplingParams
from embodirl.models.registry import make_policy
from embodirl.placement import use_ray
from embodirl.plain import to_plain
from embodirl.rollout.collector import RolloutCollector, RolloutStats
from embodirl.rollout.inference import PolicyInference
from embodirl.rollout.records import decisions_per_episode
from embodirl.rollout.starts import EpisodeStarts
from embodirl.runner.evaluation import eval_env_cfg, run_sweep

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 60.0          # a normal close: env workers shut their simulators down
CLOSE_WAIT_ON_ERROR_S = 5.0  # after an exception or Ctrl-C the workers may be busy: kill them soon


def open_backend(cfg: DictConfig, *, train: bool = True) -> InProcessBackend | RayBackend:
    """The back-end ``cfg`` asks for; ``train=False``: evaluation only (no training envs)."""
    return RayBackend(cfg, train=train) if use_ray(cfg) else InProcessBackend(cfg, train=train)


def _returns_value(cfg: DictConfig) -> bool:
    return cfg.algorithm.adv_type in CRITIC_ESTIMATORS


def _train_env_cfg(cfg: DictConfig) -> dict:
    """``env.train`` with the configured video envs selected when training videos are asked for
    (they are rendered at every step only during a recorded rollout)."""
    env_cfg = to_plain(cfg.env.train)
    if int(cfg.runner.train_video_interval or 0) > 0:
        env_cfg["video"] = {**(env_cfg.get("video") or {}), "enabled": True}
    return env_cfg


def _worker_config(cfg: DictConfig) -> DictConfig:
    """The config the worker groups are built from: ``env.train`` and ``env.eval`` as collection and
    evaluation run them."""
    worker_cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    worker_cfg.env.train = _train_env_cfg(cfg)
    worker_cfg.env.eval = eval_env_cfg(cfg)
    return worker_cfg


class _Closing:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(CLOSE_WAIT_S if exc_type is None else CLOSE_WAIT_ON_ERROR_S)


class InProcessBackend(_Closing):
    """Zero remote workers (see module docstring)."""

    def __init__(self, cfg: DictConfig, *, train: bool = True):
        self.cfg = cfg
        self.envs = []
        self.actors = None
        self.inference: PolicyInference | None = None
        self.collector: RolloutCollector | None = None
        self.eval_groups = None                  # WorkerGroups in this process, built at the first evaluation
        self.stats = RolloutStats()
        seed = int(cfg.runner.seed)
        try:
            if train:
                env_cfg = self.env_cfg = _train_env_cfg(cfg)
                S = int(cfg.rollout.pipeline_stage_num)
                B = int(env_cfg["num_envs"]) // S
                self.envs = [make_env(env_cfg, num_envs=B, seed=seed, env_offset=s * B) for s in range(S)]
                self.spec = self.envs[0].spec
                self._record_ids = [list(env.record_env_ids) for env in self.envs]
                self._set_recording(False)
                self.policy = make_policy(cfg.model, self.spec)
            else:
                self._eval_groups(policy_for=self._eval_only_policy)
                self.spec = self.eval_groups.eval_spec()
            if train:
                sampling = SamplingParams(temperature=float(cfg.rollout.temperature), top_k=cfg.rollout.top_k,
                                          top_p=cfg.rollout.top_p)
                self.inference = PolicyInference(self.policy, self.spec.task_descriptions, sampling, background=S > 1)
                self.collector = RolloutCollector(self.envs, self.inference, num_decisions=decisions_per_episode(cfg),
                                                  auto_reset=bool(env_cfg["auto_reset"]),
                                                  return_value=_returns_value(cfg),
                                                  group_size=int(cfg.algorithm.group_size), seed=seed)
        except BaseException:
            self.close()
            raise

    @property
    def num_slots(self) -> int:
        return self.collector.num_slots

    def _eval_only_policy(self, spec):
        self.policy = make_policy(self.cfg.model, spec)
        return self.policy

    def _eval_groups(self, policy_for=None):
        """The evaluation worker groups: env workers of ``env.eval`` and a rollout worker acting with
        :attr:`policy` itself, in this process."""
        if self.eval_groups is None:
            from embodirl.workers.groups import WorkerGroups

            self.eval_groups = WorkerGroups.from_config(_worker_config(self.cfg), remote=False, train=False,
                                                        policy=None if policy_for else self.policy,
                                                        policy_for=policy_for)
        return self.eval_groups

    def make_actors(self):
        """The learner: one rank in this process whose module the inference above also uses (no copy,
        no transfer: a publication only moves the version)."""
        from embodirl.workers.actor_group import ActorGroup

        self.actors = ActorGroup.local(self.cfg, self.spec, policy=self.policy)
        return self.actors

    def consumer_nodes(self) -> list:
        return []

    def consumer_gpus(self) -> list:
        return []

    def receive_weights(self, handle) -> dict[str, float]:
        self.load_weights({}, int(handle))
        return {}

    def collect(self, starts: EpisodeStarts, *, seed: int, video_dir: str | Path | None = None, step: int = 0,
                greedy: bool = False):
        """``greedy``: deterministic actions (ReMax's baseline rollout) instead of ``rollout`` sampling."""
        self.policy.eval()
        recorders = self._recorders(video_dir, step) if video_dir else None
        sampling = self.inference.sampling
        if greedy:
            self.inference.sampling = SamplingParams(greedy=True)
        try:
            batch = self.collector.collect(starts, seed=seed, observers=recorders)
        finally:
            self.inference.sampling = sampling
            if recorders is not None:
                self._set_recording(False)
                for recorder in recorders:
                    if recorder is not None:
                        recorder.close()
        self.stats = self.collector.stats
        return batch

    def _set_recording(self, on: bool) -> None:
        for env, ids in zip(self.envs, self._record_ids):
            if ids:
                env.record_env_ids = ids if on else []

    def _recorders(self, video_dir: str | Path, step: int) -> list:
        from embodirl.envs.video import VideoRecorder

        self._set_recording(True)
        B = self.collector.B
        return [VideoRecorder.for_env(env, video_dir, self.env_cfg["video"], env_offset=s * B, step=step)
                if ids else None for s, (env, ids) in enumerate(zip(self.envs, self._record_ids))]

    def load_weights(self, tensors: Mapping, version: int) -> None:
        # the inference policy is the learner's module: only the version moves
        if self.inference is not None:
            self.inference.weight_version = int(version)

    def rng_states(self) -> None:
        """None: the policy acts with the driver's generators (saved with the driver's state)."""
        return None

    def set_rng_states(self, states) -> None:
        """Nothing to restore here: the driver's generators come back with ``runner/rng.pt``."""

    def sync_weights(self, tensors: Mapping, version: int) -> None:
        self.load_weights(tensors, version)

    def evaluate(self, *, step: int, out_dir: Path, seed: int) -> dict:
        self.policy.eval()
        return run_sweep(self._eval_groups(), self.cfg, out_dir=out_dir, seed=seed)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        try:
            if self.actors is not None:
                self.actors.close()
                self.actors = None
            if self.inference is not None:
                self.inference.close()
                self.inference = None
        finally:
            closing, self.envs = self.envs, []
            try:
                for env in closing:
                    env.close()
            finally:
                if self.eval_groups is not None:
                    self.eval_groups.close(wait_s)
                    self.eval_groups = None


class RayBackend(_Closing):
    """Ray env and rollout worker groups (see module docstring). Starts a local Ray unless one is
    running or ``cluster.ray_address`` / ``RAY_ADDRESS`` names a cluster, and shuts down what it started."""

    def __init__(self, cfg: DictConfig, *, train: bool = True):
        import ray

        from embodirl.workers.groups import WorkerGroups
        from embodirl.workers.ray_cluster import init_ray, ray_address

        self.cfg = cfg
        self.train = train
        self.stats = RolloutStats()
        self.policy = None
        self.actors = None
        self._transport_logged = False
        self._owns_ray = not ray.is_initialized() and ray_address(cfg.cluster) is None
        init_ray(cfg.cluster)
        try:
            self.groups = WorkerGroups.from_config(_worker_config(cfg), remote=True, policy_for=self._make_policy,
                                                   train=train, weight_source=self._full_weights if train else None)
        except BaseException:
            self._shutdown_ray()
            raise
        self.spec = self.groups.env.spec if train else self.groups.eval_spec()

    def _make_policy(self, spec):
        """Training: None - the driver holds no weights; rollout workers and actor ranks build the policy
        with the same seeded initialisation (a checkpoint in ``model.path`` is loaded by each).
        Evaluation: the driver's policy, which loads a run checkpoint's trained weights and hands them
        to the rollout workers (a random initialisation goes to them whole)."""
        if self.train:
            return None
        self.policy = make_policy(self.cfg.model, spec)
        return None if self.cfg.model.get("path") else self.policy

    def make_actors(self):
        """The learner's ranks as Ray actors on the placement's ``actor`` devices."""
        from embodirl.workers.actor_group import ActorGroup

        self.actors = ActorGroup.remote_group(self.cfg, self.spec, placement=self.groups._placement,
                                              process_vars=self.groups._process_vars)
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
        """Every rollout worker applies rank 0's publication; metrics say how it travelled."""
        self.groups.receive_weights(handle)
        paths = self.groups.rollout.sync_paths
        return {"sync/shm_workers": float(paths.get("shm", 0)),
                "sync/object_store_workers": float(paths.get("object_store", 0)),
                "sync/cuda_ipc_workers": float(paths.get("cuda_ipc", 0)), "sync/bytes": float(handle.nbytes)}

    @property
    def num_slots(self) -> int:
        return self.groups.env.layout.num_slots

    def collect(self, starts: EpisodeStarts, *, seed: int, video_dir: str | Path | None = None, step: int = 0,
                greedy: bool = False):
        """``greedy``: the rollout workers' evaluation sampling, greedy with ``runner.eval_greedy`` (which
        config validation requires for ReMax's baseline rollouts)."""
        from embodirl.workers.rollout_worker import EVAL

        video_dir = None if video_dir is None else str(Path(video_dir).resolve())   # workers' cwd may differ
        batch = self.groups.collect(starts, seed=seed, video_dir=video_dir, step=step, mode=EVAL if greedy else None)
        # env workers run in parallel: the slowest one's split is the rollout's
        per_worker = self.groups.env.last_stats()
        stats = copy.copy(max(per_worker, key=lambda s: s.total_s))
        stats.decisions = sum(s.decisions for s in per_worker)
        stats.restarts = sum(s.restarts for s in per_worker)
        stats.recollected_rows = sum(s.recollected_rows for s in per_worker)
        stats.shm_batches = sum(s.shm_batches for s in per_worker)
        stats.object_store_batches = sum(s.object_store_batches for s in per_worker)
        self.stats = stats
        if not self._transport_logged:
            self._transport_logged = True
            shm = sum(bool(info.get("shm")) for info in self.groups.env.transport_infos())
            log.info("rollout transport: %d of %d env workers stream observations through shared memory",
                     shm, len(self.groups.env.workers))
        return batch

    def load_weights(self, tensors: Mapping, version: int) -> None:
        self.groups.load_weights(tensors, version)

    def rng_states(self) -> list[dict] | None:
        """The rollout workers' generator states (they sample actions in their own processes)."""
        return self.groups.rollout.rng_states()

    def set_rng_states(self, states: list[dict] | None) -> None:
        self.groups.rollout.set_rng_states(states)

    def sync_weights(self, tensors: Mapping, version: int) -> None:
        self.groups.sync_weights(tensors, version)

    def evaluate(self, *, step: int, out_dir: Path, seed: int) -> dict:
        return run_sweep(self.groups, self.cfg, out_dir=out_dir, seed=seed)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        try:
            if self.actors is not None:
                self.actors.close(kill=wait_s < CLOSE_WAIT_S)
                self.actors = None
            groups = getattr(self, "groups", None)
            if groups is not None:
                groups.close(wait_s)
                self.groups = None
        finally:
            self._shutdown_ray()

    def _shutdown_ray(self) -> None:
        if self._owns_ray:
            from embodirl.workers.ray_cluster import shutdown_ray

            shutdown_ray()
            self._owns_ray = False

