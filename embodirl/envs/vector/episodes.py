"""Episode semantics of ONE simulator: :class:`EpisodeRunner` wraps a :class:`~embodirl.envs.base.SimEnv`
with the time limit, ``ignore_terminations``, reward scaling / relative rewards, success-so-far, episode
totals, auto-reset and video frames, exactly as :mod:`embodirl.envs.vector.vector_env` documents them for the batch.

It lives where the simulator lives (a sub-process of :class:`~embodirl.envs.vector.vector_env.ProcessVectorEnv`,
see :mod:`embodirl.envs.vector.subproc`), so that a whole ``step`` including an auto-reset is one round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embodirl.envs.base import SimEnv

NO_INIT_STATE = -1               # init_state_id of an episode whose init state is random


@dataclass
class ResetOut:
    obs: dict[str, np.ndarray]
    task_id: int
    init_state_id: int
    frame: np.ndarray | None = None      # [h, w, 3] first video frame when recording


@dataclass
class StepOut:
    obs: dict[str, np.ndarray]           # after the chunk (and after an auto-reset)
    rewards: np.ndarray                  # float32 [steps], scaled (and relative) step rewards
    terminated: bool
    truncated: bool
    success: bool
    episode_return: float
    episode_length: int
    frames: list[np.ndarray] | None = None
    final_obs: dict[str, np.ndarray] | None = None   # set when auto-reset happened
    reset: ResetOut | None = None

    @property
    def steps(self) -> int:
        return int(self.rewards.shape[0])


def video_frame(images: np.ndarray) -> np.ndarray:
    """Camera images ``[V, C, h, w]`` uint8 -> one video frame ``[h, V*w, 3]`` (cameras side by side)."""
    return np.concatenate([np.ascontiguousarray(img.transpose(1, 2, 0)) for img in images], axis=1)


def check_finite(obs: dict[str, np.ndarray], rewards: np.ndarray | None = None) -> None:
    # MuJoCo instabilities surface as NaN/inf states long before they raise; treat them as crashes.
    for key, value in obs.items():
        if np.issubdtype(np.asarray(value).dtype, np.floating) and not np.all(np.isfinite(value)):
            raise FloatingPointError(f"non-finite values in observation '{key}'")
    if rewards is not None and not np.all(np.isfinite(rewards)):
        raise FloatingPointError("non-finite step reward")


class EpisodeRunner:
    """Runs one :class:`SimEnv` episode by episode: time limit, ``ignore_terminations``, reward
    scaling / relative rewards, success-so-far, episode totals, auto-reset and video frames. Lives in
    the simulator's process so that a whole ``step`` (including an auto-reset) is one round trip."""

    def __init__(self, env: SimEnv, *, auto_reset: bool, ignore_terminations: bool, reward_coef: float,
                 use_rel_reward: bool):
        self.env = env
        self.spec = env.spec
        self.auto_reset = auto_reset
        self.ignore_terminations = ignore_terminations
        self.reward_coef = float(reward_coef)
        self.use_rel_reward = use_rel_reward
        self._started = False

    # -- episode state ---------------------------------------------------------------------------
    def _begin(self, obs: dict[str, np.ndarray], task_id: int, init_state_id: int) -> None:
        self._started = True
        self.obs = obs
        self.task_id = task_id
        self.init_state_id = init_state_id
        self.elapsed = 0
        self.prev_reward = 0.0
        self.success = False
        self.episode_return = 0.0
        self.terminated = False
        self.truncated = False

    def _frame(self, obs: dict[str, np.ndarray]) -> np.ndarray | None:
        if "images" in obs:
            return video_frame(obs["images"])
        return self.env.render_frame()

    def reset(self, task_id: int | None = None, init_state_id: int | None = None, seed: int | None = None,
              render: bool = False) -> ResetOut:
        obs = self.env.reset(task_id=task_id, init_state_id=init_state_id, seed=seed)
        check_finite(obs)
        chosen = init_state_id if init_state_id is not None else self.env.init_state_id
        chosen = NO_INIT_STATE if chosen is None else int(chosen)
        self._begin(obs, int(obs["task_id"]), chosen)
        return ResetOut(obs, self.task_id, chosen, self._frame(obs) if render else None)

    def step(self, actions: np.ndarray, render_all: bool = False) -> StepOut:
        """Execute ``actions`` ``[H, A]`` within the time limit (see module docstring)."""
        if not self._started:
            raise RuntimeError("step() before reset()")
        if self.terminated or self.truncated:   # ended, no auto-reset: stays ended until reset
            return self._out(np.zeros(0, np.float32), [] if render_all else None)
        budget = self.spec.max_episode_steps - self.elapsed
        todo = actions[:budget]                              # (h<=H, A): cut at the time limit
        raw: list[np.ndarray] = []
        frames: list[np.ndarray] | None = [] if render_all else None
        executed = 0
        while executed < len(todo):
            res = self.env.step_chunk(todo[executed:], render_all=render_all)
            if res.steps <= 0:
                raise RuntimeError(f"{type(self.env).__name__}.step_chunk executed no step")
            step_rewards = np.asarray(res.rewards, np.float32)[: res.steps]
            check_finite(res.obs, step_rewards)
            raw.append(step_rewards)
            executed += res.steps
            self.obs = res.obs
            self.success |= bool(res.success)
            if frames is not None:
                if res.frames is not None:
                    frames.extend(video_frame(f) for f in res.frames[: res.steps])
                elif (frame := self._frame(res.obs)) is not None:
                    frames.append(frame)
            if res.truncated:                                # the simulator's own limit
                self.truncated = True
                break
            if res.terminated and not self.ignore_terminations:
                self.terminated = True
                break
            # with ignore_terminations the chunk's remaining actions still execute
        self.elapsed += executed
        if self.elapsed >= self.spec.max_episode_steps and not self.terminated:
            self.truncated = True
        rewards = self._transform(np.concatenate(raw) if raw else np.zeros(0, np.float32))
        self.episode_return += float(rewards.sum())
        out = self._out(rewards, frames)
        if self.auto_reset and (self.terminated or self.truncated):
            out.final_obs = out.obs
            out.reset = self.reset(render=render_all)
            out.obs = out.reset.obs
        return out

    def _transform(self, raw: np.ndarray) -> np.ndarray:
        scaled = self.reward_coef * raw                      # (steps,)
        if not self.use_rel_reward or scaled.size == 0:
            return scaled.astype(np.float32)
        previous = np.concatenate([[self.prev_reward], scaled[:-1]])
        self.prev_reward = float(scaled[-1])
        return (scaled - previous).astype(np.float32)

    def _out(self, rewards: np.ndarray, frames: list[np.ndarray] | None) -> StepOut:
        return StepOut(obs=self.obs, rewards=rewards, terminated=self.terminated, truncated=self.truncated,
                        success=self.success, episode_return=self.episode_return, episode_length=self.elapsed,
                        frames=frames)

    def close(self) -> None:
        self.env.close()
