"""The env worker: S pipeline stages x B simulators and the rollout loop that drives them.

A plain class (in-process in most tests) that the worker groups wrap with ``ray.remote``. It builds
its env batches with the adapter registry, connects to one inference worker (an object in this process,
a Ray worker on this node reached through a shared-memory stream, or one elsewhere reached through
Ray's object store: :mod:`embodirl.workers.stream`, :mod:`embodirl.workers.transport`) and runs
:class:`~embodirl.rollout.collector.RolloutCollector`: the trajectory of its ``S*B`` slots comes back
as the return value of :meth:`EnvWorker.collect`. Images stay on the env side until then, so the
per-decision traffic to the inference worker is one observation batch out and a few KB back.

Besides the trajectory it keeps, per collection, the videos it wrote.

Its slots are ``slot_offset .. slot_offset + S*B - 1`` of the run (see
:mod:`embodirl.rollout.starts`); stage ``s`` is built with ``env_offset = slot_offset + s*B``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from embodirl.rollout.collector import RolloutCollector
from embodirl.rollout.starts import EpisodeStarts
from embodirl.workers import process_env
from embodirl.workers.stream import StreamClient
from embodirl.workers.transport import LocalClient, RayClient, pack_trajectory

log = logging.getLogger(__name__)


class EnvWorker:
    """Args:
        env_cfg: the env config (``env.train`` or ``env.eval``).
        num_stages: S (``rollout.pipeline_stage_num``).
        envs_per_stage: B.
        num_decisions: T.
        slot_offset: global index of this worker's first slot.
        group_size: GRPO group size (``group_id`` blocks).
        return_value: ask for values and bootstrap values (policies with a value head, PPO).
        seed: base seed of the simulators and of episode starts.
        use_shm / queue_size: ``rollout.channel.{shm, queue_size}``.
        process_vars: the driver's environment variables (see :mod:`embodirl.workers.process_env`).
        env_builder: builds one stage's batch as ``env_builder(env_cfg, num_envs=, seed=, env_offset=)``;
            default: the adapter registry's ``make_env`` (a callable here must be picklable for Ray).
        keep_lost_episodes: an episode whose simulator crashes on every re-run is kept, marked in the
            collection's ``stats.crashed_slots``, instead of ending the collection (evaluation).
        deadline: the typed ``runner.worker_deadline`` section: a Ray inference worker that does not answer a batch in
            time raises :class:`~embodirl.workers.transport.InferenceWorkerHung` (None: wait).
        conversion: the policy's actions -> this env's (:class:`~embodirl.envs.conventions.ActionConversion`, from
            the driver's check); None: the policy emits what the env consumes.
    """

    def __init__(self, env_cfg, *, num_stages: int, envs_per_stage: int, num_decisions: int,
                 slot_offset: int = 0, group_size: int = 1, return_value: bool = False, seed: int = 0,
                 use_shm: bool = True, queue_size: int = 4, process_vars: Mapping[str, str] | None = None,
                 env_builder: Callable | None = None, keep_lost_episodes: bool = False, deadline=None,
                 conversion=None):
        process_env.adopt(process_vars)
        self.deadline = deadline            # runner.worker_deadline: how long an inference worker's answer may take
        if env_builder is None:
            from embodirl.envs.registry import make_env  # after adopt(): runtime set up

            env_builder = make_env
        from embodirl.envs.registry import env_config

        self.env_cfg = env_config(env_cfg)     # the typed env split (a mapping of it is converted once)
        self.S, self.B, self.T = int(num_stages), int(envs_per_stage), int(num_decisions)
        self.slot_offset = int(slot_offset)
        self.group_size = int(group_size)
        self.return_value = bool(return_value)
        self.seed = int(seed)
        self.use_shm = bool(use_shm)
        self.queue_size = int(queue_size)
        self.keep_lost_episodes = bool(keep_lost_episodes)
        self.conversion = conversion
        self.envs = []
        self.client: LocalClient | RayClient | StreamClient | None = None
        self.collector: RolloutCollector | None = None
        try:
            for s in range(self.S):
                self.envs.append(env_builder(self.env_cfg, num_envs=self.B, seed=self.seed,
                                          env_offset=self.slot_offset + s * self.B))
        except BaseException:
            self.close()
            raise
        # envs the config records for video; rendering every step is only paid when video is asked for
        self._record_ids = [list(getattr(env, "record_env_ids", [])) for env in self.envs]
        self._set_recording(False)
        self.videos: list[str] = []

    @property
    def num_slots(self) -> int:
        return self.S * self.B

    def spec(self):
        return self.envs[0].spec

    def info(self) -> dict:
        return process_env.describe()

    def ready(self) -> bool:
        return True

    # --- wiring ------------------------------------------------------------------------------------
    def connect(self, inference_worker, *, same_node: bool = True, mode: str = "train") -> None:
        """Serve decisions from ``inference_worker``: an object in this process (:meth:`connect_local`) or a
        Ray worker (:meth:`connect_remote`), whichever the worker groups hand over."""
        from embodirl.workers.inference_worker import InferenceWorker

        if isinstance(inference_worker, InferenceWorker):
            self.connect_local(inference_worker, mode=mode)
        else:
            self.connect_remote(inference_worker, same_node=same_node, mode=mode)

    def connect_local(self, inference_worker, *, mode: str = "train", background: bool | None = None) -> None:
        """Serve decisions from an inference worker object in this process (``background``: on a thread,
        so that stages overlap; default when S > 1)."""
        self._set_client(LocalClient(inference_worker, mode=mode, background=self.S > 1 if background is None
                                     else background))

    def connect_remote(self, worker, *, same_node: bool, mode: str = "train") -> None:
        """Serve decisions from an inference worker on Ray: a shared-memory stream when ``same_node`` (and
        ``use_shm``), Ray's object store otherwise. Connecting again (a restarted inference worker) keeps
        the rings and drops what the old worker held."""
        stream = self.use_shm and same_node
        kind = StreamClient if stream else RayClient
        if isinstance(self.client, kind):
            self.client.reconnect(worker)
            self.client.mode = mode
        elif stream:
            # per stage a decision and a final-observation value request (a time-limit truncation) in
            # flight, plus a bootstrap request: the ring must hold them all (its answers use as many slots)
            slots = max(self.queue_size, 2 * self.S + 1)
            self._set_client(StreamClient(worker, queue_size=slots, mode=mode, tag=f"s{self.slot_offset}",
                                          deadline=self.deadline))
        else:
            self._set_client(RayClient(worker, mode=mode, deadline=self.deadline))

    def _set_client(self, client) -> None:
        if self.client is not None and self.client is not client:
            self.client.close()
        self.client = client
        self.collector = RolloutCollector(self.envs, client, num_decisions=self.T,
                                          auto_reset=self.env_cfg.auto_reset,
                                          return_value=self.return_value, group_size=self.group_size,
                                          slot_offset=self.slot_offset, seed=self.seed,
                                          keep_lost_episodes=self.keep_lost_episodes, conversion=self.conversion)

    # --- work --------------------------------------------------------------------------------------
    def collect(self, starts: EpisodeStarts | None = None, seed: int | None = None, video_dir: str | None = None,
                step: int = 0, packed: bool = False, mode: str | None = None):
        """One rollout of this worker's slots: the trajectory ``[S*B, T]`` (stage-major rows). With
        ``video_dir`` the envs the config's ``video`` section selects are recorded to mp4 files there
        (paths in :attr:`videos`). ``packed``: return it as :func:`~embodirl.workers.transport.pack_trajectory`
        does (the cheap form to send through Ray). ``mode``: the inference worker's sampling mode for this
        rollout only (default: the one connected with)."""
        if self.collector is None:
            raise RuntimeError("connect the env worker to an inference worker before collect()")
        assert self.client is not None           # connected with the collector
        if mode is not None and mode != self.client.mode:
            connected, self.client.mode = self.client.mode, mode
            try:
                return self.collect(starts, seed=seed, video_dir=video_dir, step=step, packed=packed)
            finally:
                self.client.mode = connected
        recorders = self._recorders(video_dir, step) if video_dir else [None] * self.S
        self.videos = []
        shm_before, ray_before = self._batches_sent()
        try:
            traj = self.collector.collect(starts, seed=seed, observers=recorders)
        finally:
            if video_dir:
                self._set_recording(False)
                self.videos = [str(p) for r in recorders if r is not None for p in r.written]
                for recorder in recorders:
                    if recorder is not None:
                        recorder.close()
        stats = self.collector.stats
        # the client counts over its life (reconnects included): this collection's share
        shm_after, ray_after = self._batches_sent()
        stats.shm_batches, stats.object_store_batches = shm_after - shm_before, ray_after - ray_before
        log.debug("env worker slots %d..%d: %d decisions, env %.2fs, waiting %.2fs", self.slot_offset,
                  self.slot_offset + self.num_slots - 1, stats.decisions, stats.env_s, stats.wait_s)
        return pack_trajectory(traj) if packed else traj

    def videos_written(self) -> list[str]:
        """Video files the last :meth:`collect` with ``video_dir`` wrote."""
        return list(self.videos)

    def _set_recording(self, on: bool) -> None:
        for env, ids in zip(self.envs, self._record_ids):
            if ids:
                env.record_env_ids = ids if on else []

    def _recorders(self, video_dir: str, step: int) -> list:
        from embodirl.envs.video import VideoRecorder

        self._set_recording(True)
        return [VideoRecorder.for_env(env, video_dir, self.env_cfg.video, env_offset=self.slot_offset + s * self.B, step=step)
                if ids else None for s, (env, ids) in enumerate(zip(self.envs, self._record_ids))]

    def transport_info(self) -> dict:
        """How observations reached the inference worker (counts per path; ring name)."""
        info = getattr(self.client, "info", None)
        return info() if info is not None else {"shm": False, "segment": None, "local": True}

    def _batches_sent(self) -> tuple[int, int]:
        """Observation batches the client has sent so far: (shared memory, object store)."""
        info = self.transport_info()
        return int(info.get("shm_batches", 0)), int(info.get("ray_batches", 0))

    def last_stats(self):
        """The last :meth:`collect`'s :class:`~embodirl.rollout.collector.RolloutStats`, with the
        observation batches it sent through each transport (``shm_batches``, ``object_store_batches``)."""
        return self.collector.stats if self.collector is not None else None

    def offload(self) -> None:
        """Collocated placement: simulators keep their state; only cached accelerator memory goes."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def onload(self) -> None:
        pass

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        for env in self.envs:
            try:
                env.close()
            except Exception as exc:
                log.debug("closing env failed: %s", exc)
        self.envs = []

