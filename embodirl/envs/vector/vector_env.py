"""Lifting single simulators (:class:`~embodirl.envs.base.SimEnv`) into a batch
(:class:`~embodirl.envs.base.ChunkVectorEnv`): one process per simulator, chunk execution with episode
bookkeeping, and recovery from crashed simulators. The batch is this module; the episode semantics of one
simulator are :mod:`embodirl.envs.vector.episodes`, the sub-process transport :mod:`embodirl.envs.vector.subproc`,
the crash restart and hang detection :mod:`embodirl.envs.vector.recovery`.

Usage (an adapter's ``make``)::

    factories = [functools.partial(LiberoSimEnv, cfg, env_index=i) for i in range(num_envs)]
    venv = ProcessVectorEnv(factories, auto_reset=cfg["auto_reset"], reward_type=cfg["reward_type"], ...)
    obs, info = venv.reset(task_ids=..., init_state_ids=...)
    obs, reward, terminated, truncated, info = venv.step(actions)      # actions [B, H, A]

Factories are pickled with cloudpickle (closures and lambdas work) and called inside the sub-process,
so a simulator is built, stepped and closed in one process. ``processes=False`` runs every simulator
in the calling process (debugging, cheap test envs) with the same semantics.

Episode semantics (per sub-env, see also :mod:`embodirl.envs.base`):

* **Time limit** in low-level steps (``spec.max_episode_steps``): a chunk that crosses the limit is
  cut, only the steps inside the limit execute, and the env reports ``truncated``.
* **Termination**: ``terminated`` when the simulator says the episode ended (success or failure);
  the rest of the chunk is not executed. With ``ignore_terminations`` the simulator's end is ignored
  and the chunk's remaining actions still execute: ``terminated`` is never set, the episode runs to
  its time limit, and ``info["success"]`` is "succeeded at some step of this episode so far".
* **Rewards** per executed step ``r_t`` are scaled, ``reward_coef * r_t``; with ``use_rel_reward``
  the env returns the difference of successive (scaled) step rewards ``r_t - r_{t-1}`` (``r_{-1} = 0``
  at the episode start), so an episode's rewards sum to its last step reward: a shaped "progress"
  signal from a reward that measures the state. ``reward_type="chunk_level"`` returns the chunk's sum
  ``[B]``; ``"action_level"`` returns ``[B, H]`` with zeros after the last executed step.
* **Auto-reset** (gymnasium's same-step mode): an env whose episode ended is reset inside ``step``
  (task and init state: the adapter's choice); ``obs`` is the new episode's first observation,
  ``info["final_obs"]`` the batched observation before any reset (rows of envs that did not reset
  equal ``obs``) and ``info["_final_obs"]`` marks the envs that reset. Without auto-reset an ended env
  stays ended until :meth:`ProcessVectorEnv.reset`: later steps do not touch its simulator, return its
  final observation, zero reward and the same done flags.
* **Faults**: a sub-process that dies, a ``reset``/``step_chunk`` that raises, a non-finite
  observation or reward, or (with ``step_timeout``) a simulator that hangs gets its sub-env replaced
  by a new one from its factory (a new process), reset to the same task / init state / seed. Its row
  then carries the new episode's first observation, zero reward, no done flag and
  ``info["restarted"] = True``: the episode in progress is lost and callers must treat it as invalid.
  ``max_restarts`` bounds consecutive failures of one sub-env (a successful step clears the count);
  past it :class:`SubEnvCrashed` propagates. Errors while *building* the envs propagate unchanged
  (an adapter's :class:`~embodirl.errors.ConfigError` keeps its one-sentence message).

``step`` info keys (arrays have leading dim B):

====================  =============  ==========================================================
key                   dtype/shape    meaning
====================  =============  ==========================================================
success               bool [B]       the stepped episode succeeded at some step so far
restarted             bool [B]       the sub-env was replaced this call (episode invalid)
steps                 int64 [B]      low-level steps executed in this chunk
episode_return        float32 [B]    the stepped episode's reward sum so far (final if it ended)
episode_length        int64 [B]      its low-level steps so far (final if it ended)
task_id               int64 [B]      task of the episode ``obs`` belongs to (after any reset)
init_state_id         int64 [B]      its init state (-1: random)
final_obs             dict           auto_reset only: observation before any reset
_final_obs            bool [B]       auto_reset only: the env was reset this call
final_task_id         int64 [B]      auto_reset only: task of the stepped episode
final_init_state_id   int64 [B]      auto_reset only: its init state
frames                list[B]        recorded envs: list of [h, w, 3] uint8 frames, one per
                                     executed step (cameras side by side); others None
reset_frames          list[B]        recorded envs that (auto-)reset or restarted: [first frame]
num_restarts          int            restarts of all sub-envs since construction
====================  =============  ==========================================================

Processes end on :meth:`~ProcessVectorEnv.close`, when the object is garbage-collected, at
interpreter exit, and when the owning process dies (even by SIGKILL): a sub-process exits at the end
of its command pipe and, while busy in a step, a watchdog thread ends it when the owner is gone.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait as wait_connections
from typing import Any, Literal, overload

import cloudpickle
import numpy as np

from embodirl.envs.base import REWARD_TYPES, ChunkVectorEnv, CommonEnvConfig, EnvSpec, SimEnv
from embodirl.envs.vector.episodes import NO_INIT_STATE, ResetOut, StepOut
from embodirl.envs.vector.recovery import DEFAULT_MAX_RESTARTS, HangLimits, Recovery, SubEnvSlot
from embodirl.envs.vector.subproc import START_METHODS, LocalSubEnv, ProcessSubEnv, SubEnvFailure

DEFAULT_START_TIMEOUT_S = 600.0   # building a LIBERO scene on a busy 2-core machine takes seconds
#: imported last by a preloading forkserver: freezes the preloaded heap (the simulators it forks never walk it)
FROZEN_HEAP = "embodirl.envs.vector.frozen_heap"


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for venv in list(_LIVE):
        venv.close()


class ProcessVectorEnv(ChunkVectorEnv):
    """B :class:`SimEnv` instances stepped one action chunk at a time (semantics: module docstring).

    Args:
        env_fns: one factory per sub-env; called in the sub-process (pickled with cloudpickle).
        auto_reset: reset an ended episode inside ``step`` (gymnasium same-step mode).
        ignore_terminations: run every episode to its time limit; ``success`` is success-so-far.
        reward_coef: multiplies every step reward.
        use_rel_reward: return differences of successive step rewards.
        reward_type: ``"chunk_level"`` (reward ``[B]``) or ``"action_level"`` (``[B, H]``).
        processes: one sub-process per simulator; False runs them in this process.
        start_method: ``"forkserver"`` or ``"spawn"`` (fork breaks MuJoCo/EGL and SAPIEN).
        max_restarts: consecutive failures of one sub-env tolerated before :class:`SubEnvCrashed`.
        record_env_ids: envs whose every low-level step is rendered for video (``info["frames"]``).
        step_timeout: seconds a sub-process may take for one command before it is presumed hung and
            restarted (None: wait forever); within it a step much slower than the sub-env's own recent steps
            is presumed hung sooner (:class:`~embodirl.envs.vector.recovery.HangLimits`).
        start_timeout: seconds a sub-process may take to build its simulator.
        preload: modules the forkserver imports before forking the simulator processes (the adapter's heavy
            imports, e.g. ``embodirl.envs.maniskill.preload``), so each process does not import them itself.
    """

    def __init__(self, env_fns: Sequence[Callable[[], SimEnv]], *, auto_reset: bool = False,
                 ignore_terminations: bool = False, reward_coef: float = 1.0, use_rel_reward: bool = False,
                 reward_type: str = "chunk_level", processes: bool = True, start_method: str = "forkserver",
                 max_restarts: int = DEFAULT_MAX_RESTARTS, record_env_ids: Sequence[int] = (),
                 step_timeout: float | None = None, start_timeout: float = DEFAULT_START_TIMEOUT_S,
                 preload: Sequence[str] = ()):
        if not env_fns:
            raise ValueError("ProcessVectorEnv needs at least one env factory")
        if reward_type not in REWARD_TYPES:
            raise ValueError(f"reward_type must be one of {REWARD_TYPES}, got {reward_type!r}")
        if processes and start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        self.num_envs = len(env_fns)
        self.reward_type = reward_type
        self.auto_reset = auto_reset
        self.processes = processes
        self.step_timeout = step_timeout
        self.start_timeout = start_timeout
        self.record_env_ids = record_env_ids
        self._closed = False
        self._runner_kwargs = dict(auto_reset=auto_reset, ignore_terminations=ignore_terminations,
                                   reward_coef=reward_coef, use_rel_reward=use_rel_reward)
        self.env_fns = list(env_fns)        # kept to restart sub-envs (and to rebuild in another mode)
        if processes:
            self._ctx = mp.get_context(start_method)
            if start_method == "forkserver" and preload:
                # modules the forkserver imports once before it forks each simulator process; takes effect
                # when this process starts its forkserver (the first vector env), later calls keep that one.
                # The last one freezes what the others built (embodirl/envs/vector/frozen_heap.py).
                self._ctx.set_forkserver_preload(["embodirl.envs.vector.subproc", *preload, FROZEN_HEAP])
            self._factory_bytes = [cloudpickle.dumps(fn) for fn in self.env_fns]
        self._recovery = Recovery(max_restarts)
        self._hangs = HangLimits()
        self._slots = [SubEnvSlot(self._new_handle(i)) for i in range(self.num_envs)]
        _LIVE.add(self)
        try:
            for slot in self._slots:
                slot.handle.start()
            specs = [self._recv_start(i) for i in range(self.num_envs)]
        except BaseException:
            self.close()
            raise
        self.spec: EnvSpec = specs[0]
        for i, spec in enumerate(specs[1:], 1):
            if (spec.action_dim, spec.max_episode_steps) != (self.spec.action_dim, self.spec.max_episode_steps):
                self.close()
                raise ValueError(f"sub-env {i} has action_dim/max_episode_steps "
                                 f"{spec.action_dim}/{spec.max_episode_steps}, sub-env 0 has "
                                 f"{self.spec.action_dim}/{self.spec.max_episode_steps}")

    @classmethod
    def from_config(cls, env_fns: Sequence[Callable[[], SimEnv]], env: CommonEnvConfig, *, env_offset: int = 0,
                    **kwargs) -> ProcessVectorEnv:
        """Build from an env split's shared keys (the typed config: ``auto_reset``, ``ignore_terminations``,
        ``reward_coef``, ``use_rel_reward``, ``reward_type``, ``step_timeout_s``, ``video.enabled``/``video.env_ids``).
        ``video.env_ids`` are global env indices; this batch holds envs ``env_offset ..
        env_offset + len(env_fns) - 1`` and records those among them. ``kwargs`` (``processes``,
        ``start_method``, ``max_restarts``, ...) pass through."""
        record = []
        if env.video.enabled:
            record = [g - env_offset for g in env.video.env_ids if 0 <= g - env_offset < len(env_fns)]
        kwargs.setdefault("step_timeout", env.step_timeout_s)     # env.step_timeout_s (null: wait)
        return cls(env_fns, auto_reset=env.auto_reset, ignore_terminations=env.ignore_terminations,
                   reward_coef=env.reward_coef, use_rel_reward=env.use_rel_reward,
                   reward_type=env.reward_type, record_env_ids=record, **kwargs)

    # -- public helpers --------------------------------------------------------------------------
    @property
    def record_env_ids(self) -> list[int]:
        return sorted(self._record)

    @record_env_ids.setter
    def record_env_ids(self, env_ids: Sequence[int]) -> None:
        ids = {int(i) for i in env_ids}
        if any(i < 0 or i >= self.num_envs for i in ids):
            raise ValueError(f"record_env_ids {sorted(ids)} outside 0..{self.num_envs - 1}")
        self._record = ids

    @property
    def num_restarts(self) -> int:
        """Restarts of all sub-envs since construction."""
        return self._recovery.num_restarts

    @property
    def max_restarts(self) -> int:
        return self._recovery.max_restarts

    @property
    def pids(self) -> list[int | None]:
        """Process id of each sub-env (None in-process)."""
        return [slot.handle.pid for slot in self._slots]

    # -- construction / restarts -----------------------------------------------------------------
    def _new_handle(self, i: int):
        if not self.processes:
            return LocalSubEnv(self.env_fns[i], self._runner_kwargs)
        return ProcessSubEnv(self._ctx, self._factory_bytes[i], self._runner_kwargs, f"embodirl-env-{i}")

    def _recv_start(self, i: int) -> EnvSpec:
        try:
            return self._slots[i].handle.recv(self.start_timeout)
        except SubEnvFailure as failure:
            # construction errors reach the user unchanged (adapters raise one-sentence errors)
            raise failure.cause from None

    def _restart(self, i: int, failure: SubEnvFailure, render: bool) -> ResetOut:
        return self._recovery.restart(i, self._slots[i], failure, new_handle=self._new_handle, render=render,
                                      start_timeout=self.start_timeout, step_timeout=self.step_timeout)

    @overload
    def _gather(self, env_ids: Sequence[int], command: Literal["reset"], kwargs: Sequence[dict]
                ) -> dict[int, ResetOut | SubEnvFailure]: ...

    @overload
    def _gather(self, env_ids: Sequence[int], command: Literal["step"], kwargs: Sequence[dict]
                ) -> dict[int, StepOut | SubEnvFailure]: ...

    def _gather(self, env_ids: Sequence[int], command: str, kwargs: Sequence[dict]) -> dict[int, Any]:
        """Send ``command`` to every env first, then collect: sub-processes work in parallel, and their answers
        (or deaths) are awaited together, each up to its own hang limit, so several hung sub-envs are found at
        once. A failure is returned as the env's :class:`SubEnvFailure`."""
        for i, kw in zip(env_ids, kwargs):
            self._slots[i].handle.send(command, kw)
        sent = time.monotonic()
        results: dict[int, Any] = {}        # the sub-envs' answers to command (ResetOut, StepOut), or failures
        pending: dict[int, ProcessSubEnv] = {}
        for i in env_ids:
            handle = self._slots[i].handle
            if isinstance(handle, ProcessSubEnv) and not handle.failed_to_send:
                pending[i] = handle
                continue
            try:                     # in this process the command runs now; a failed send raises its failure
                results[i] = handle.recv(self.step_timeout)
            except SubEnvFailure as failure:
                results[i] = failure
        limits = {i: self._hangs.limit(i, command, self.step_timeout) for i in pending}
        while pending:
            waits = [sent + limit - time.monotonic() for i in pending if (limit := limits[i]) is not None]
            ready = set(wait_connections([w for h in pending.values() for w in h.waitables],
                                         max(0.0, min(waits)) if waits else None))
            now = time.monotonic()
            for i, handle in list(pending.items()):
                limit = limits[i]
                if ready.intersection(handle.waitables):
                    try:
                        results[i] = handle.recv(0)
                        self._hangs.record(i, command, now - sent)
                    except SubEnvFailure as failure:
                        results[i] = failure
                elif limit is not None and now - sent >= limit:
                    results[i] = SubEnvFailure(TimeoutError(
                        f"{handle.name} did not answer '{command}' within {limit:.1f} s ({self._hangs.describe(i)})"))
                else:
                    continue
                del pending[i]
        return results

    # -- ChunkVectorEnv --------------------------------------------------------------------------
    def reset(self, *, env_ids: np.ndarray | None = None, task_ids: np.ndarray | None = None,
              init_state_ids: np.ndarray | None = None, seed: int | None = None
              ) -> tuple[dict[str, np.ndarray], dict]:
        """Reset all envs or ``env_ids``. ``task_ids`` / ``init_state_ids`` (aligned with ``env_ids``;
        None: the adapter's choice) pick each env's episode; sub-env ``i`` is seeded with ``seed + i``.
        Returns the full batched observation (rows of envs not reset are unchanged) and ``info`` with
        ``task_id``, ``init_state_id`` (-1: random), ``restarted`` and, for recorded envs that were
        reset, ``frames[i] = [first frame]``."""
        self._check_open()
        ids = list(range(self.num_envs)) if env_ids is None else [int(i) for i in np.asarray(env_ids).reshape(-1)]
        tasks = self._per_env(task_ids, len(ids), "task_ids")
        inits = self._per_env(init_state_ids, len(ids), "init_state_ids")
        kwargs = []
        for i, task, init in zip(ids, tasks, inits):
            slot = self._slots[i]
            slot.task_id, slot.init_state_id = task, init
            slot.seed = None if seed is None else int(seed) + i
            kwargs.append(dict(task_id=task, init_state_id=init, seed=slot.seed, render=i in self._record))
        results = self._gather(ids, "reset", kwargs)
        restarted = np.zeros(self.num_envs, bool)
        frames: list = [None] * self.num_envs
        for i in ids:
            out = results[i]
            if isinstance(out, SubEnvFailure):
                out = self._restart(i, out, render=i in self._record)
                restarted[i] = True
            else:
                self._slots[i].failures = 0
            self._accept_reset(i, out)
            if out.frame is not None:
                frames[i] = [out.frame]
        info = dict(task_id=self._slot_array("task_id"), init_state_id=self._slot_array("init_state_id"),
                    restarted=restarted, frames=frames, num_restarts=self.num_restarts)
        return self._batch_obs(), info

    def step(self, actions: np.ndarray):
        """Step one chunk ``[B, H, A]`` in every env (see the module docstring for the returned info)."""
        self._check_open()
        actions = np.asarray(actions, dtype=np.float32)
        if actions.ndim != 3 or actions.shape[0] != self.num_envs or actions.shape[2] != self.spec.action_dim:
            raise ValueError(f"actions must have shape [B={self.num_envs}, H, A={self.spec.action_dim}], "
                             f"got {list(actions.shape)}")
        if any(slot.obs is None for slot in self._slots):
            raise RuntimeError("call reset() before step()")
        B, H, _ = actions.shape
        ids = list(range(B))
        results = self._gather(ids, "step", [dict(actions=actions[i], render_all=i in self._record) for i in ids])

        reward = np.zeros((B, H), np.float32)                                # (B, H)
        terminated, truncated = np.zeros(B, bool), np.zeros(B, bool)         # (B,)
        success, restarted, was_reset = np.zeros(B, bool), np.zeros(B, bool), np.zeros(B, bool)
        steps = np.zeros(B, np.int64)
        episode_return, episode_length = np.zeros(B, np.float32), np.zeros(B, np.int64)
        final_task, final_init = self._slot_array("task_id"), self._slot_array("init_state_id")
        final_obs_rows: list[dict[str, np.ndarray]] = []
        frames: list = [None] * B
        reset_frames: list = [None] * B
        for i in ids:
            out = results[i]
            if isinstance(out, SubEnvFailure):
                reset_out = self._restart(i, out, render=i in self._record)
                self._accept_reset(i, reset_out)
                restarted[i] = True
                final_obs_rows.append(reset_out.obs)
                reset_frames[i] = [reset_out.frame] if reset_out.frame is not None else None
                continue
            self._slots[i].failures = 0
            reward[i, : out.steps] = out.rewards
            terminated[i], truncated[i], success[i] = out.terminated, out.truncated, out.success
            steps[i], episode_return[i], episode_length[i] = out.steps, out.episode_return, out.episode_length
            frames[i] = out.frames
            final_obs_rows.append(out.final_obs if out.final_obs is not None else out.obs)
            if out.reset is not None:
                was_reset[i] = True
                self._slots[i].seed = None          # an auto-reset continues the simulator's own RNG
                self._accept_reset(i, out.reset)
                if out.reset.frame is not None:
                    reset_frames[i] = [out.reset.frame]
            else:
                self._slots[i].obs = out.obs
        info = dict(success=success, restarted=restarted, steps=steps, episode_return=episode_return,
                    episode_length=episode_length, task_id=self._slot_array("task_id"),
                    init_state_id=self._slot_array("init_state_id"), frames=frames, reset_frames=reset_frames,
                    num_restarts=self.num_restarts)
        if self.auto_reset:
            info.update(final_obs=_stack(final_obs_rows), _final_obs=was_reset, final_task_id=final_task,
                        final_init_state_id=final_init)
        if self.reward_type == "chunk_level":
            reward = reward.sum(axis=1)                                      # (B,)
        return self._batch_obs(), reward, terminated, truncated, info

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        _LIVE.discard(self)
        for slot in getattr(self, "_slots", []):
            if isinstance(slot.handle, ProcessSubEnv):
                slot.handle.request_close()    # ask everyone first, then wait: closing is parallel too
        for slot in getattr(self, "_slots", []):
            slot.handle.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- internals -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ProcessVectorEnv is closed")

    def _per_env(self, values, n: int, name: str) -> list[int | None]:
        if values is None:
            return [None] * n
        arr = np.asarray(values).reshape(-1)
        if arr.shape[0] != n:
            raise ValueError(f"{name} has {arr.shape[0]} entries for {n} envs to reset")
        return [None if v is None or int(v) < 0 else int(v) for v in arr.tolist()]

    def _accept_reset(self, i: int, out: ResetOut) -> None:
        slot = self._slots[i]
        slot.obs = out.obs
        slot.task_id = out.task_id
        slot.init_state_id = None if out.init_state_id == NO_INIT_STATE else out.init_state_id

    def _slot_array(self, name: str) -> np.ndarray:
        values = [getattr(slot, name) for slot in self._slots]
        return np.array([NO_INIT_STATE if v is None else v for v in values], np.int64)

    def _batch_obs(self) -> dict[str, np.ndarray]:
        rows = []
        for slot in self._slots:
            assert slot.obs is not None, "a sub-env that was never reset"
            rows.append(slot.obs)
        return _stack(rows)


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Un-batched observations -> batched dict (``task_id`` as int64 ``[B]``)."""
    batched = {key: np.stack([np.asarray(row[key]) for row in rows]) for key in rows[0]}
    if "task_id" in batched:
        batched["task_id"] = batched["task_id"].astype(np.int64)
    return batched
