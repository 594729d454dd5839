"""GPU-batched ManiSkill: ``B`` scenes in one ManiSkill env (``sim_backend="physx_cuda"``, one process),
stepped one action chunk ``[B, H, A]`` at a time with the same episode semantics as
:class:`~embodirl.envs.vector.vector_env.ProcessVectorEnv` (time limit, termination, ``ignore_terminations``,
reward scaling and relative rewards, chunk- or action-level rewards, same-step auto-reset, info keys).

NOT TESTED ON CUDA HERE: the development machine has no GPU. The class is written for
``physx_cuda`` and also accepts ``sim_backend="physx_cpu"`` with ``num_envs=1`` (PhysX-CPU holds one
scene per process); the test suite runs that configuration against ``ProcessVectorEnv`` +
:class:`~embodirl.envs.maniskill.simulator.ManiSkillSimEnv` on the same actions and init states, which
exercises every line of the batched bookkeeping, partial resets and render skipping. Group resets
that copy one scene into several envs (below) only happen with ``B > 1`` and are untested.

How a chunk runs: every control step advances all ``B`` scenes together (the batched simulator cannot
pause one scene). Envs whose episode ended earlier in the chunk, or before it without auto-reset,
receive zero actions and their results are ignored; their observation row stays the one at their
last step. Cameras render only when an env's episode ends before the chunk's last step (its final
observation is needed), when a recorded env needs a video frame, and once after the last step.

Fixed init states on one GPU scene: ManiSkill seeds the torch RNG of a (partial) reset with one seed
for the whole batch, so two envs reset together with the same seed would still draw different
scenes. Init state ``k`` is therefore built by resetting *one* env with seed ``k``; other envs that
need ``k`` in the same reset copy its simulator state (``reset_to_env_states``). GPU and CPU
simulators draw different scenes for the same ``k`` (different random number generators), but every
GPU env does the same thing for ``k``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from embodirl.envs.base import ChunkVectorEnv
from embodirl.envs.maniskill.simulator import (
    CPU_BACKEND,
    TASK_ID,
    ManiSkillEnvConfig,
    ObsConverter,
    action_bounds,
    draw_init_state,
    init_state_seed,
    make_maniskill_env,
    make_spec,
    resolve_sim_backend,
    settings_of,
    sparse_from_info,
    step_without_observation,
    success_fail,
)
from embodirl.envs.vector.episodes import NO_INIT_STATE, video_frame

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# pure bookkeeping (numpy, tested against a per-env loop)
# --------------------------------------------------------------------------------------------------
def transform_rewards(raw: np.ndarray, steps: np.ndarray, prev_reward: np.ndarray, reward_coef: float,
                      use_rel_reward: bool) -> tuple[np.ndarray, np.ndarray]:
    """Batched form of the per-env reward rule of :class:`~embodirl.envs.vector.episodes.EpisodeRunner`.

    ``raw`` float32 ``[B, H]``: simulator step rewards, valid for the first ``steps[b]`` entries.
    Returns ``(rewards [B, H], prev_reward [B])``: ``reward_coef * raw``; with ``use_rel_reward`` the
    difference to the previous scaled step reward (``prev_reward`` carries the last one across
    chunks, 0 at an episode's start). Entries past ``steps`` are 0; envs with no step keep their
    ``prev_reward``.
    """
    B, H = raw.shape
    valid = np.arange(H)[None, :] < steps[:, None]                           # (B, H)
    scaled = np.where(valid, reward_coef * raw, 0.0).astype(np.float32)      # (B, H)
    if not use_rel_reward:
        return scaled, prev_reward.copy()
    previous = np.concatenate([prev_reward[:, None], scaled[:, :-1]], axis=1)  # (B, H)
    rewards = np.where(valid, scaled - previous, 0.0).astype(np.float32)     # (B, H)
    last = np.clip(steps - 1, 0, H - 1)
    new_prev = np.where(steps > 0, scaled[np.arange(B), last], prev_reward).astype(np.float32)  # (B,)
    return rewards, new_prev


def end_flags(success: np.ndarray, fail: np.ndarray, elapsed: np.ndarray, running: np.ndarray,
              max_episode_steps: int, ignore_terminations: bool) -> tuple[np.ndarray, np.ndarray]:
    """Which running envs end after a step: ``(terminated [B], truncated [B])``. Reaching the time
    limit wins over a simultaneous success/failure (as in ``EpisodeRunner``); with
    ``ignore_terminations`` only the time limit ends an episode."""
    truncated = running & (elapsed >= max_episode_steps)
    terminated = running & (success | fail) & ~truncated
    if ignore_terminations:
        terminated = np.zeros_like(terminated)
    return terminated, truncated


def group_by_init_state(env_ids: np.ndarray, init_state_ids: np.ndarray) -> dict[int, np.ndarray]:
    """``{init_state_id: env ids (ascending)}``; the first env of each group is built from the seed,
    the others copy it."""
    groups: dict[int, list[int]] = {}
    for env, init in sorted(zip(env_ids.tolist(), init_state_ids.tolist())):
        groups.setdefault(int(init), []).append(int(env))
    return {k: np.asarray(v, np.int64) for k, v in groups.items()}


def _index_tree(tree, index):
    if isinstance(tree, dict):
        return {k: _index_tree(v, index) for k, v in tree.items()}
    return tree[index]


# --------------------------------------------------------------------------------------------------
# the batched env
# --------------------------------------------------------------------------------------------------
class ManiSkillGPUEnv(ChunkVectorEnv):
    """``B`` ManiSkill scenes in one GPU-batched simulator (see the module docstring).

    Observations, ``reset``/``step`` returns and ``info`` keys are those of
    :class:`~embodirl.envs.vector.vector_env.ProcessVectorEnv` (``restarted`` is always False: there are no
    sub-processes to replace). Env ``i`` draws random init states with ``seed + i``.
    """

    def __init__(self, cfg: ManiSkillEnvConfig | Mapping, *, num_envs: int, seed: int = 0, env_offset: int = 0,
                 sim_backend: str | None = None):
        self.settings = settings_of(cfg)
        backend = sim_backend or resolve_sim_backend(self.settings.sim_backend)
        if backend == CPU_BACKEND and num_envs != 1:
            raise ValueError("PhysX-CPU holds one scene per process: use num_envs=1 or ProcessVectorEnv")
        env = self.settings
        self.num_envs = B = int(num_envs)
        self.auto_reset = env.auto_reset
        self.ignore_terminations = env.ignore_terminations
        self.reward_coef = env.reward_coef
        self.use_rel_reward = env.use_rel_reward
        self.reward_type = env.reward_type             # one of REWARD_TYPES (the schema's choice list)
        self.record_env_ids = sorted(g - env_offset for g in env.video.env_ids
                                     if env.video.enabled and 0 <= g - env_offset < B)

        self._env = make_maniskill_env(self.settings, num_envs=B, sim_backend=backend)
        self._base = self._env.unwrapped
        self._device = self._base.device
        self._convert = ObsConverter(self._base, self.settings)
        self._low, self._high = action_bounds(self._base)
        self._sparse_from_info = sparse_from_info(self.settings)
        self._seed = int(seed)
        self._rngs = [np.random.default_rng(self._seed + i) for i in range(B)]
        self._obs = self._convert(self._base.get_obs())                      # rows: current obs per env
        self.spec = make_spec(self.settings, self._base, self._convert, int(self._obs["state"].shape[1]))
        self._started = np.zeros(B, bool)
        self._init_state = np.full(B, NO_INIT_STATE, np.int64)
        self._elapsed = np.zeros(B, np.int64)
        self._prev_reward = np.zeros(B, np.float32)
        self._success = np.zeros(B, bool)
        self._return = np.zeros(B, np.float32)
        self._terminated = np.zeros(B, bool)
        self._truncated = np.zeros(B, bool)

    # -- ChunkVectorEnv ------------------------------------------------------------------------------
    def reset(self, *, env_ids: np.ndarray | None = None, task_ids: np.ndarray | None = None,
              init_state_ids: np.ndarray | None = None, seed: int | None = None
              ) -> tuple[dict[str, np.ndarray], dict]:
        """Reset all envs or ``env_ids`` to ``init_state_ids`` (None / -1: drawn by each env's RNG,
        reseeded with ``seed + i`` when ``seed`` is given). Returns the full batched observation."""
        ids = np.arange(self.num_envs) if env_ids is None else np.asarray(env_ids, np.int64).reshape(-1)
        if task_ids is not None and any(t is not None and int(t) not in (TASK_ID, NO_INIT_STATE)
                                        for t in np.asarray(task_ids).reshape(-1).tolist()):
            raise ValueError(f"a ManiSkill env config holds one task (task_id {TASK_ID}), got task_ids {task_ids}")
        if seed is not None:
            for i in ids.tolist():
                self._rngs[i] = np.random.default_rng(int(seed) + i)
        wanted = [None] * len(ids) if init_state_ids is None else np.asarray(init_state_ids).reshape(-1).tolist()
        if len(wanted) != len(ids):
            raise ValueError(f"init_state_ids has {len(wanted)} entries for {len(ids)} envs to reset")
        inits = np.array([draw_init_state(self._rngs[i], self.settings) if w is None or int(w) < 0
                          else int(w) for i, w in zip(ids.tolist(), wanted)], np.int64)
        self._reset_envs(ids, inits)
        frames: list = [None] * self.num_envs
        for i in self.record_env_ids:
            if i in set(ids.tolist()):
                frames[i] = [self._frame(self._obs, i)]
        info = dict(task_id=np.full(self.num_envs, TASK_ID, np.int64), init_state_id=self._init_state.copy(),
                    restarted=np.zeros(self.num_envs, bool), frames=frames, num_restarts=0)
        return self._copy_obs(), info

    def step(self, actions: np.ndarray):
        """Step one chunk ``[B, H, A]`` (clipped to the action space) in every env."""
        actions = np.asarray(actions, dtype=np.float32)
        B = self.num_envs
        if actions.ndim != 3 or actions.shape[0] != B or actions.shape[2] != self.spec.action_dim:
            raise ValueError(f"actions must have shape [B={B}, H, A={self.spec.action_dim}], got {list(actions.shape)}")
        if not self._started.all():
            raise RuntimeError("call reset() before step()")
        import torch

        H = actions.shape[1]
        clipped = np.clip(actions, self._low, self._high)                   # (B, H, A)
        running = ~(self._terminated | self._truncated)                      # (B,) ended envs stay ended
        raw = np.zeros((B, H), np.float32)                                   # (B, H)
        steps = np.zeros(B, np.int64)                                        # (B,)
        captured = np.zeros(B, bool)                                         # obs row already final
        recorded = np.zeros(B, bool)
        recorded[self.record_env_ids] = True
        frames: list = [[] if recorded[i] else None for i in range(B)]
        info: dict = {}
        for h in range(H):
            if not running.any():
                break
            act = np.where(running[:, None], clipped[:, h], 0.0).astype(np.float32)  # (B, A)
            reward, info = step_without_observation(self._base, torch.from_numpy(act).to(self._device),
                                                    self._sparse_from_info)
            succ, fail = success_fail(info, B)                                # (B,), (B,)
            raw[running, h] = reward.cpu().numpy().reshape(B)[running]
            steps += running
            self._elapsed += running
            self._success |= succ & running
            terminated, truncated = end_flags(succ, fail, self._elapsed, running,
                                              self.settings.max_episode_steps, self.ignore_terminations)
            self._terminated |= terminated
            self._truncated |= truncated
            ended = terminated | truncated
            stepped = running.copy()
            running &= ~ended
            last_step = h == H - 1 or not running.any()
            want_frames = (recorded & stepped).any()
            if not last_step and (ended.any() or want_frames):               # render before the chunk's end
                obs_now = self._convert(self._base.get_obs(info))
                self._set_rows(obs_now, ended)
                captured |= ended
                self._record(frames, obs_now, recorded & stepped)
        pending = (steps > 0) & ~captured
        if pending.any():                                                    # the one render of the chunk
            obs_end = self._convert(self._base.get_obs(info))
            self._set_rows(obs_end, pending)
            self._record(frames, obs_end, recorded & pending)

        rewards, self._prev_reward = transform_rewards(raw, steps, self._prev_reward, self.reward_coef,
                                                       self.use_rel_reward)  # (B, H)
        self._return += rewards.sum(axis=1)
        terminated, truncated = self._terminated.copy(), self._truncated.copy()
        info_out: dict[str, Any] = dict(success=self._success.copy(), restarted=np.zeros(B, bool), steps=steps,
                        episode_return=self._return.copy(), episode_length=self._elapsed.copy(),
                        frames=frames, reset_frames=[None] * B, num_restarts=0)
        if self.auto_reset:
            done = terminated | truncated
            info_out.update(final_obs=self._copy_obs(), _final_obs=done,
                            final_task_id=np.full(B, TASK_ID, np.int64), final_init_state_id=self._init_state.copy())
            if done.any():
                ids = np.flatnonzero(done)
                inits = np.array([draw_init_state(self._rngs[i], self.settings) for i in ids], np.int64)
                self._reset_envs(ids, inits)
                for i in ids.tolist():
                    if recorded[i]:
                        info_out["reset_frames"][i] = [self._frame(self._obs, i)]
        info_out.update(task_id=np.full(B, TASK_ID, np.int64), init_state_id=self._init_state.copy())
        if self.reward_type == "chunk_level":
            rewards = rewards.sum(axis=1)                                    # (B,)
        return self._copy_obs(), rewards, terminated, truncated, info_out

    def close(self) -> None:
        env = getattr(self, "_env", None)
        if env is not None:
            env.close()
            self._env = None

    # -- internals -----------------------------------------------------------------------------------
    def _reset_envs(self, ids: np.ndarray, inits: np.ndarray) -> None:
        """Reset envs ``ids`` to init states ``inits`` (one seeded reset per distinct init state,
        copies for the rest) and clear their episode bookkeeping."""
        import torch

        groups = group_by_init_state(ids, inits)
        raw = None
        for k, members in groups.items():
            env_idx = torch.as_tensor(members[:1], device=self._device)
            # a full-length seed list: the torch RNG gets seed k and env members[0]'s numpy RNG too
            raw, _ = self._base.reset(seed=[init_state_seed(k)] * self.num_envs,
                                      options=dict(env_idx=env_idx, reconfigure=False))
        copies = sorted((int(e), int(members[0])) for members in groups.values() for e in members[1:])
        if copies:
            state = self._base.get_state_dict()
            source = torch.as_tensor([src for _, src in copies], device=self._device)
            raw, _ = self._base.reset(options=dict(
                env_idx=torch.as_tensor([dst for dst, _ in copies], device=self._device),
                reset_to_env_states=dict(env_states=_index_tree(state, source))))
        mask = np.zeros(self.num_envs, bool)
        mask[ids] = True
        self._set_rows(self._convert(raw), mask)
        self._started[ids] = True
        self._init_state[ids] = inits
        self._elapsed[ids] = 0
        self._prev_reward[ids] = 0.0
        self._success[ids] = False
        self._return[ids] = 0.0
        self._terminated[ids] = False
        self._truncated[ids] = False

    def _set_rows(self, obs: dict[str, np.ndarray], mask: np.ndarray) -> None:
        for key, value in obs.items():
            self._obs[key][mask] = value[mask]

    def _copy_obs(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self._obs.items()}

    def _frames(self, obs: dict[str, np.ndarray], env_ids: list[int]) -> list[np.ndarray]:
        """Video frames ``[h, w, 3]`` of ``env_ids``: their cameras side by side, or (state mode)
        ManiSkill's human render camera (one batched render)."""
        if "images" in obs:
            return [video_frame(obs["images"][i]) for i in env_ids]
        if not env_ids:
            return []
        rendered = self._base.render_rgb_array().cpu().numpy().astype(np.uint8)   # (B, h, w, 3)
        return [rendered[i] for i in env_ids]

    def _frame(self, obs: dict[str, np.ndarray], i: int) -> np.ndarray:
        return self._frames(obs, [i])[0]

    def _record(self, frames: list, obs: dict[str, np.ndarray], mask: np.ndarray) -> None:
        env_ids = np.flatnonzero(mask).tolist()
        for i, frame in zip(env_ids, self._frames(obs, env_ids)):
            frames[i].append(frame)
