"""Env + policy -> ``Trajectory``, in one process: the rollout loop every env worker runs.

A :class:`RolloutCollector` drives ``S`` independent env batches (pipeline stages, ``B`` simulators
each) for ``T`` decisions against an :class:`~embodirl.rollout.inference.InferenceClient`. With
``S = 2`` the loop requests stage 1's actions from inference, steps stage 0 with the actions it
already has, and so on: while one batch simulates, the policy thinks about the other (ping-pong; with
``S = 1`` env and policy alternate). Per decision it records what the policy saw and returned and
what the env answered (:class:`~embodirl.rollout.records.DecisionRecorder`) and returns one
trajectory ``[S*B, T]`` (stage-major rows).

Episode bookkeeping:

* without ``auto_reset`` a slot runs one episode; decisions after it ended are ``valid = False``
  (the env no longer touches that simulator). When every slot of a stage has ended early the stage
  stops stepping and its remaining decisions are recorded as invalid;
* with ``auto_reset`` a row holds consecutive episodes separated by ``terminated``/``truncated``;
* an episode cut by the horizon ``T`` (last decision valid and not done) gets
  ``extras.bootstrap_value`` = the value of the observation after its last chunk (policies with a value
  head; zero for rows that ended);
* an episode the time limit truncates gets ``final_value`` at its last decision = the value of its own
  final observation (policies with a value head): the observation the env returned without
  auto-reset, ``info["final_obs"]`` with it (the returned one belongs to the next episode). Inside a row
  it is asked for beside the next decision; at the row's end it shares the bootstrap request;
* ``executed`` marks the actions of each chunk that ran (``info["steps"]``): an episode that ends inside
  a chunk leaves the rest of it unexecuted;
* the policy's chunk is handed to the env through ``conversion`` (:class:`~embodirl.envs.conventions.ActionConversion`,
  the one place where a policy's action convention meets the env's: OpenVLA-OFT's [0, 1] gripper becomes LIBERO's
  -1 open / +1 close), and ``action_chunk`` records what the env executed;
* observers (one per stage, e.g. :class:`~embodirl.envs.video.VideoRecorder`) see every
  ``reset``/``step`` of the main pass through ``on_reset(info)`` / ``on_step(reward, terminated,
  truncated, info)`` and are flushed at the end;
* a slot whose simulator crashed and was replaced mid-episode (``info["restarted"]``) lost that
  episode: after the pass the stage is run again from the same starts and the broken rows are taken
  from the new pass (up to ``max_recollect`` times), so the result always holds valid trajectories. An
  episode that crashes on every re-run raises :class:`RecollectFailed` - or, with ``keep_lost_episodes``
  (evaluation, as OpenVLA-OFT's ``run_libero_eval.py`` counts an episode that raised as a failure), stays in
  the result as it was collected, its slot listed in ``stats.crashed_slots``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from embodirl import data as D
from embodirl.envs.base import ChunkVectorEnv
from embodirl.envs.conventions import ActionConversion
from embodirl.progress import Ticker
from embodirl.rollout.inference import InferenceClient, Pending
from embodirl.rollout.records import DecisionRecorder
from embodirl.rollout.starts import EpisodeStarts, group_ids

log = logging.getLogger(__name__)

DEFAULT_MAX_RECOLLECT = 3


class EpisodeObserver(Protocol):
    """Sees one stage's resets and steps (video recording); ``flush`` ends the rollout."""

    def on_reset(self, info: dict) -> None: ...

    def on_step(self, reward: np.ndarray, terminated: np.ndarray, truncated: np.ndarray, info: dict): ...

    def flush(self): ...


class RecollectFailed(RuntimeError):
    """Simulators kept crashing: episodes could not be collected after ``max_recollect`` attempts."""


@dataclass
class RolloutStats:
    """Wall-clock split of one :meth:`RolloutCollector.collect` (seconds), fault counts, and how the
    observation batches travelled (filled by the env worker from its client; zero in-process)."""

    env_s: float = 0.0           # inside env.reset/step
    wait_s: float = 0.0          # waiting for inference results (not hidden behind env steps)
    infer_s: float = 0.0         # inference time as reported by the inference side
    total_s: float = 0.0
    decisions: int = 0
    restarts: int = 0            # sub-env restarts seen mid-episode
    recollected_rows: int = 0
    shm_batches: int = 0         # observation batches sent through a shared-memory stream (same node)
    object_store_batches: int = 0   # ... as Ray calls through the object store (other node, shm off)
    baseline_s: float = 0.0      # ReMax's greedy baseline rollouts (filled by the runner)
    rollouts_drawn: int = 0      # re-sampled group filtering: trajectories collected / kept (runner)
    rollouts_kept: int = 0
    crashed_slots: list[int] = field(default_factory=list)   # global slots whose episode kept crashing (kept)


@dataclass
class _Stage:
    env: ChunkVectorEnv
    starts: EpisodeStarts
    # set by RolloutCollector._reset before the stage's first decision
    recorder: DecisionRecorder = field(init=False)
    obs: dict[str, np.ndarray] = field(init=False)
    alive: np.ndarray = field(init=False)           # (B,) episode still running (without auto-reset)
    broken: np.ndarray = field(init=False)          # (B,) episode lost to a simulator restart
    init_state_id: np.ndarray = field(init=False)   # (B,) as reported at reset
    observer: EpisodeObserver | None = None
    pending: Pending | None = None
    bootstrap: Pending | None = None   # value request for the observation after the last decision
    bootstrap_truncated: np.ndarray | None = None   # (B,) rows whose bootstrap request holds a final obs
    final: tuple[int, np.ndarray, Pending] | None = None   # (decision, truncated rows, value request)
    bootstrap_value: np.ndarray | None = None   # (B,) or (B, H); zero for rows that ended
    finished_at: int | None = None     # decision index at which every slot had ended


def _merge_rows(obs: dict, final_obs: dict | None, rows: np.ndarray) -> dict:
    """``obs`` with the ``rows`` (bool ``[B]``) taken from ``final_obs`` (None: ``obs`` unchanged)."""
    if final_obs is None or not rows.any():
        return obs
    return {key: np.where(rows.reshape(-1, *([1] * (np.ndim(value) - 1))), final_obs[key], value)
            for key, value in obs.items()}


class RolloutCollector:
    """Collects ``T`` decisions from ``S`` env batches (see module docstring).

    Args:
        envs: the S stages (each a ``ChunkVectorEnv`` of B simulators).
        inference: where actions come from.
        num_decisions: T.
        auto_reset: whether the envs reset ended episodes themselves (the env config's key).
        return_value: ask the policy for values (PPO) and compute ``bootstrap_value``.
        group_size: GRPO group size G (``group_id`` of slot n is ``(slot_offset + n) // G``).
        slot_offset: global index of this collector's first slot.
        seed: base seed; stage s is reset with ``seed + (slot_offset + s*B)`` (sub-env i adds i).
        max_recollect: re-runs of a stage whose episodes a simulator crash cut short.
        keep_lost_episodes: keep (and list in ``stats.crashed_slots``) episodes still crashing after them.
        conversion: the policy's actions -> the env's (:func:`embodirl.envs.conventions.pairing`, checked before any
            worker started); None: the policy emits what the env consumes.
    """

    def __init__(self, envs: Sequence[ChunkVectorEnv], inference: InferenceClient, *, num_decisions: int,
                 auto_reset: bool = False, return_value: bool = False, group_size: int = 1, slot_offset: int = 0,
                 seed: int | None = None, max_recollect: int = DEFAULT_MAX_RECOLLECT, keep_lost_episodes: bool = False,
                 conversion: ActionConversion | None = None):
        if not envs:
            raise ValueError("a collector needs at least one env batch")
        sizes = {env.num_envs for env in envs}
        if len(sizes) != 1:
            raise ValueError(f"pipeline stages must have equal batch sizes, got {sorted(sizes)}")
        self.envs = list(envs)
        self.inference = inference
        self.T = int(num_decisions)
        self.B = sizes.pop()
        self.S = len(self.envs)
        self.auto_reset = auto_reset
        self.return_value = return_value
        self.group_size = int(group_size)
        self.slot_offset = int(slot_offset)
        self.seed = seed
        self.max_recollect = int(max_recollect)
        self.keep_lost_episodes = bool(keep_lost_episodes)
        self.conversion = conversion
        self.spec = self.envs[0].spec
        self.stats = RolloutStats()

    @property
    def num_slots(self) -> int:
        return self.S * self.B

    def collect(self, starts: EpisodeStarts | None = None, seed: int | None = None,
                observers: Sequence[EpisodeObserver | None] | None = None):
        """One rollout of every slot; ``starts`` (``[S*B]``) fixes episode starts; ``observers`` (one
        per stage or None) watch the envs. Returns the trajectory ``[S*B, T]``."""
        t0 = time.perf_counter()
        self.stats = RolloutStats()
        starts = starts if starts is not None else EpisodeStarts.unset(self.num_slots)
        if len(starts) != self.num_slots:
            raise ValueError(f"starts cover {len(starts)} slots, this collector has {self.num_slots}")
        seed = self.seed if seed is None else seed
        observers = list(observers) if observers is not None else [None] * self.S
        stages = [_Stage(env, starts.slice(s * self.B, (s + 1) * self.B), observer=observers[s])
                  for s, env in enumerate(self.envs)]
        try:
            self._run(list(enumerate(stages)), seed)
        finally:
            for observer in observers:
                if observer is not None:
                    observer.flush()
        for s, stage in enumerate(stages):
            self._recollect_broken(s, stage, seed)
        batches = [self._build(s, stage) for s, stage in enumerate(stages)]
        self.stats.total_s = time.perf_counter() - t0
        return D.concat(batches) if len(batches) > 1 else batches[0]

    # --- the pipelined loop ------------------------------------------------------------------------
    def _run(self, stages: list[tuple[int, _Stage]], seed: int | None) -> None:
        ticker = Ticker()
        for s, stage in stages:
            self._reset(s, stage, seed)
            stage.pending = self.inference.request(stage.obs, return_value=self.return_value)
        for t in range(self.T):
            for _, stage in stages:
                if stage.finished_at is None:
                    self._decide(t, stage)
            if ticker.due():   # a long rollout (a 7B policy, long episodes) says where it is
                running = sum(int(stage.alive.sum()) for _, stage in stages if stage.finished_at is None)
                log.info("rollout: decision %d of %d, %d of %d episodes running, %.0f s (env %.0f s, waiting for "
                         "the policy %.0f s)", t + 1, self.T, running, len(stages) * self.B, ticker.elapsed,
                         self.stats.env_s, self.stats.wait_s)
        if self.return_value:
            for _, stage in stages:
                stage.bootstrap_value = self._bootstrap_values(stage)

    def _reset(self, s: int, stage: _Stage, seed: int | None) -> None:
        t0 = time.perf_counter()
        stage_seed = None if seed is None else int(seed) + self.slot_offset + s * self.B
        stage.obs, info = stage.env.reset(seed=stage_seed, **stage.starts.reset_kwargs())
        self.stats.env_s += time.perf_counter() - t0
        if stage.observer is not None:
            stage.observer.on_reset(info)
        stage.recorder = DecisionRecorder(self.B, self.T)
        stage.alive = np.ones(self.B, bool)
        stage.broken = np.zeros(self.B, bool)
        stage.init_state_id = np.asarray(info.get("init_state_id", stage.starts.init_state_ids), np.int64)
        stage.finished_at = None

    def _decide(self, t: int, stage: _Stage) -> None:
        self._take_final_values(stage)      # asked for before this decision (counts its own wait)
        t0 = time.perf_counter()
        assert stage.pending is not None    # requested at the reset or after the previous decision
        out = stage.pending.result()
        t1 = time.perf_counter()
        stage.pending = None
        rec = stage.recorder
        rec.record_obs(t, stage.obs, stage.alive)
        executed = out.action_chunk if self.conversion is None else self.conversion.to_env(out.action_chunk)  # (B, H, A)
        rec.record_policy(t, {**out.fields, D.ACTION_CHUNK: executed}, out.weight_version)
        obs, reward, terminated, truncated, info = stage.env.step(executed)
        t2 = time.perf_counter()
        self.stats.wait_s += t1 - t0
        self.stats.env_s += t2 - t1
        self.stats.infer_s += out.timings.get("infer_s", 0.0)
        self.stats.decisions += 1
        rec.record_step(t, reward, terminated, truncated, info["success"], steps=info.get("steps"),
                        chunk=np.asarray(executed).shape[1])
        if stage.observer is not None:
            stage.observer.on_step(reward, terminated, truncated, info)
        restarted = np.asarray(info.get("restarted", np.zeros(self.B, bool)), bool)
        lost = restarted & stage.alive
        if lost.any():
            self.stats.restarts += int(lost.sum())
            log.warning("rollout: %d simulator(s) restarted mid-episode (rows %s); they will be collected again",
                        int(lost.sum()), np.flatnonzero(lost).tolist())
        stage.broken |= lost
        if not self.auto_reset:
            stage.alive &= ~(np.asarray(terminated, bool) | np.asarray(truncated, bool))
        stage.obs = obs
        last = t + 1 == self.T
        truncated_rows = rec.truncated[:, t].copy()                       # (B,) valid decisions only
        # the observation after each row's chunk in its own episode: with auto-reset an ended episode's
        # final observation is in info (the returned one starts the next episode)
        after = _merge_rows(obs, info.get("final_obs"), truncated_rows) if self.auto_reset else obs
        if self.return_value and truncated_rows.any() and not last:
            stage.final = (t, truncated_rows, self.inference.request(after, return_value=True))
        if not last and not stage.alive.any():
            stage.finished_at = t + 1          # every episode of the stage ended: stop stepping
            rec.mark_rest_invalid(t + 1)
            self._take_final_values(stage)
        elif not last:
            stage.pending = self.inference.request(obs, return_value=self.return_value)
        elif self.return_value and (self._cut_rows(stage).any() or truncated_rows.any()):
            stage.bootstrap = self.inference.request(after, return_value=True)
            stage.bootstrap_truncated = truncated_rows

    def _take_final_values(self, stage: _Stage) -> None:
        """Record the answer to an earlier decision's final-observation value request."""
        if stage.final is None:
            return
        t, rows, pending = stage.final
        stage.final = None
        t0 = time.perf_counter()
        values = pending.result().fields[D.VALUE]
        self.stats.wait_s += time.perf_counter() - t0
        stage.recorder.record_final_value(t, rows, values)

    def _cut_rows(self, stage: _Stage) -> np.ndarray:
        rec = stage.recorder
        return rec.valid[:, -1] & ~rec.terminated[:, -1] & ~rec.truncated[:, -1]   # (B,)

    # --- faults ------------------------------------------------------------------------------------
    def _recollect_broken(self, s: int, stage: _Stage, seed: int | None) -> None:
        attempt = 0
        while stage.broken.any():
            attempt += 1
            if attempt > self.max_recollect:
                lost = np.flatnonzero(stage.broken).tolist()
                if self.keep_lost_episodes:
                    log.warning("rollout: the episodes of rows %s of stage %d crashed their simulators %d times in a "
                                "row; they count as failures", lost, s, attempt)
                    self.stats.crashed_slots += [self.slot_offset + s * self.B + r for r in lost]
                    return
                raise RecollectFailed(f"stage {s}: rows {lost} lost their episodes "
                                      f"{self.max_recollect} times in a row; the simulators keep crashing")
            rows = np.flatnonzero(stage.broken)
            log.warning("rollout: collecting %d lost episode(s) of stage %d again (attempt %d)", len(rows), s, attempt)
            # Re-run the whole batch (a vector env steps all its simulators) and keep the lost rows, which
            # start where they started the first time: the task seen at the first decision and the init
            # state the env reported.
            starts = EpisodeStarts(stage.starts.task_ids.copy(), stage.starts.init_state_ids.copy())
            seen_tasks = stage.recorder.field(D.TASK_ID)
            assert seen_tasks is not None       # every observation holds task_id (the policy reads it)
            starts.task_ids[rows] = seen_tasks[rows, 0]
            starts.init_state_ids[rows] = stage.init_state_id[rows]
            again = _Stage(stage.env, starts)
            self._run([(s, again)], seed)
            stage.recorder.replace_rows(rows, again.recorder, rows)
            if self.return_value:       # _run computed both
                assert stage.bootstrap_value is not None and again.bootstrap_value is not None
                stage.bootstrap_value[rows] = again.bootstrap_value[rows]
            stage.broken = np.zeros(self.B, bool)
            stage.broken[rows] = again.broken[rows]
            self.stats.recollected_rows += len(rows)

    # --- output ------------------------------------------------------------------------------------
    def _build(self, s: int, stage: _Stage):
        first = self.slot_offset + s * self.B
        return stage.recorder.build(group_id=group_ids(self.B, self.group_size, first),
                                    init_state_id=stage.init_state_id, bootstrap_value=stage.bootstrap_value)

    def _bootstrap_values(self, stage: _Stage) -> np.ndarray:
        rec = stage.recorder
        value = rec.field(D.VALUE)
        shape = (self.B, *value.shape[2:]) if value is not None else (self.B,)
        bootstrap = np.zeros(shape, np.float32)                          # (B,) or (B, H)
        cut = self._cut_rows(stage)
        if stage.bootstrap is not None:
            t0 = time.perf_counter()
            values = np.asarray(stage.bootstrap.result().fields[D.VALUE], np.float32)
            self.stats.wait_s += time.perf_counter() - t0
            bootstrap[cut] = values[cut]
            if stage.bootstrap_truncated is not None and stage.bootstrap_truncated.any():
                rec.record_final_value(self.T - 1, stage.bootstrap_truncated, values)
        stage.bootstrap = None
        stage.bootstrap_truncated = None
        return bootstrap
