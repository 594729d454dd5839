"""The env worker group: K :class:`~embodirl.workers.env_worker.EnvWorker` s in a
:class:`~embodirl.workers.worker_set.WorkerSet` (in this process or on Ray), each connected to its inference
worker. One collection (:meth:`embodirl.workers.groups.WorkerGroups.collect`) is one ``EnvWorker.collect`` per
env worker on its :meth:`~EnvWorkerGroup.split` of the starts, dead workers replaced
(:mod:`embodirl.workers.recovery`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from embodirl import data as D
from embodirl.envs.registry import env_config
from embodirl.rollout.starts import EpisodeStarts, plan_starts
from embodirl.workers import recovery
from embodirl.workers.deadlines import CallTimes
from embodirl.workers.env_worker import EnvWorker
from embodirl.workers.inference_group import InferenceGroup
from embodirl.workers.inference_worker import TRAIN
from embodirl.workers.layout import SlotLayout, placement_options
from embodirl.workers.transport import unpack_trajectory
from embodirl.workers.worker_set import WorkerSet


class EnvWorkerGroup:
    """K env workers, each connected to its inference worker (see module docstring)."""

    def __init__(self, env_cfg, layout: SlotLayout, *, remote: bool, return_value: bool, seed: int = 0,
                 use_shm: bool = True, queue_size: int = 4, placement=None,
                 process_vars: Mapping[str, str] | None = None, mode: str = TRAIN,
                 max_faults: int = recovery.DEFAULT_MAX_FAULTS, env_placement_offset: int = 0, env_builder=None,
                 deadline=None, conversion=None):
        self.env_cfg = env_config(env_cfg)     # the typed env split (a mapping of it is converted once)
        self.layout = layout
        self.inference: InferenceGroup | None = None
        self.mode = mode
        self.max_faults = max_faults
        self.events: list[dict] = []
        self.videos: list[str] = []
        self._rng = np.random.default_rng(seed)
        self._kwargs = dict(num_stages=layout.num_stages, envs_per_stage=layout.envs_per_stage,
                            num_decisions=layout.num_decisions, group_size=layout.group_size,
                            return_value=return_value, seed=seed, use_shm=use_shm, queue_size=queue_size,
                            process_vars=dict(process_vars or {}), env_builder=env_builder,
                            # an evaluation sweep never aborts: an episode that keeps crashing counts as a failure
                            keep_lost_episodes=mode != TRAIN, deadline=deadline,
                            # the policy's actions -> this env's (embodirl.envs.conventions), checked by the driver
                            conversion=conversion)
        self.infos: list[dict] = []
        self.workers = WorkerSet(EnvWorker, remote=remote,
                                 options_for=placement_options(placement, "env", env_placement_offset),
                                 times=CallTimes(deadline), label=f"{'evaluation ' if mode != TRAIN else ''}env worker",
                                 info_of=lambda k: self.infos[k] if k < len(self.infos) else None)
        try:
            for k in range(layout.num_env_workers):
                self.start(k)
            self.infos = self.workers.call_all(EnvWorker.info)       # remote: also waits until every worker is built
            self.spec = self.workers.call(0, EnvWorker.spec)
        except BaseException:
            self.close()
            raise
        self._connected_gen: list[int | None] = [None] * layout.num_env_workers

    @property
    def remote(self) -> bool:
        return self.workers.remote

    def start(self, k: int) -> None:
        """Create (or replace) env worker ``k`` with its slots."""
        self.workers.start(k, self.env_cfg, **self._kwargs, slot_offset=k * self.layout.slots_per_worker)

    def attach(self, inference_group: InferenceGroup) -> None:
        """Connect every env worker to its inference worker (``k % R``)."""
        self.inference = inference_group
        for k in range(len(self.workers)):
            self.connect(k)

    def connect(self, k: int) -> None:
        assert self.inference is not None, "attach() first"
        r = self.layout.inference_worker_of(k)
        same_node = self.infos[k]["node_id"] == self.inference.infos[r]["node_id"]
        self.workers.call(k, EnvWorker.connect, self.inference.workers[r], same_node=same_node, mode=self.mode)
        self._connected_gen[k] = self.inference.generation[r]

    # --- collection --------------------------------------------------------------------------------
    def plan_starts(self) -> EpisodeStarts:
        return plan_starts(self.env_cfg, self.spec, self.layout.num_slots, self.layout.group_size, self._rng)

    def split(self, starts: EpisodeStarts | None) -> list[EpisodeStarts]:
        """Each env worker's part of the ``N`` slots' episode starts (planned here when None)."""
        starts = starts if starts is not None else self.plan_starts()
        if len(starts) != self.layout.num_slots:
            raise ValueError(f"starts cover {len(starts)} slots, the group has {self.layout.num_slots}")
        per = self.layout.slots_per_worker
        return [starts.slice(k * per, (k + 1) * per) for k in range(len(self.workers))]

    def join(self, results: list, video_dir: str | None):
        """The workers' trajectories (in worker order) as one ``[N, T]``, slots in order; the videos written."""
        self.videos = [v for vs in self.workers.call_all(EnvWorker.videos_written) for v in vs] if video_dir else []
        return D.concat([unpack_trajectory(r) if self.remote else r for r in results])

    def transport_infos(self) -> list[dict]:
        """How each env worker's observations reach its inference worker (shared memory or Ray)."""
        return self.workers.call_all(EnvWorker.transport_info)

    def last_stats(self) -> list:
        """Every env worker's :class:`~embodirl.rollout.collector.RolloutStats` of the last collection."""
        return self.workers.call_all(EnvWorker.last_stats)

    def env_worker_pids(self) -> list[int]:
        return [info["pid"] for info in self.infos]

    def offload(self) -> None:
        self.workers.call_all(EnvWorker.offload)

    def onload(self) -> None:
        self.workers.call_all(EnvWorker.onload)

    def close(self, wait_s: float = 60.0) -> None:
        self.workers.close(wait_s)
