"""A simulator added the way docs/extending.md's "Adding a simulator" says, from outside the package: this one module (the
simulator, its adapter and its config class, registered under the module's dotted name) and one env YAML naming it
(tests/extension/test_extension.py writes it). A point on a line moves towards a goal; success within 0.1 of it."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from embodirl.config_fields import num
from embodirl.envs.base import ChunkResult, CommonEnvConfig, EnvSpec, SimEnv
from embodirl.envs.conventions import NO_GRIPPER, ActionConvention
from embodirl.envs.registry import register_adapter
from embodirl.envs.vector.vector_env import ProcessVectorEnv


@dataclass
class GridEnvConfig(CommonEnvConfig):
    """The keys this simulator adds to the common ones."""

    step_size: float = num(0, lo_open=True)


class GridSim(SimEnv):
    def __init__(self, env: GridEnvConfig, seed: int):
        self.step_size = env.step_size
        self.spec = EnvSpec(action_dim=1, max_episode_steps=env.max_episode_steps,
                            task_descriptions=["reach the goal"], camera_names=[], image_size=None, state_dim=2,
                            num_init_states=[16], name="grid")
        self.rng = np.random.default_rng(seed)
        self.pos = self.goal = 0.0

    def reset(self, task_id=None, init_state_id=None, seed=None):
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.task_id, self.init_state_id = 0, int(init_state_id if init_state_id is not None else self.rng.integers(16))
        self.pos, self.goal = -1.0 + self.init_state_id / 16.0, 0.5
        return self._obs()

    def _obs(self):
        return {"state": np.array([self.pos, self.goal], np.float32), "task_id": np.array(0, np.int64)}

    def step_chunk(self, actions, render_all=False):
        rewards, success = [], False
        for action in np.asarray(actions, np.float64):
            before = abs(self.goal - self.pos)
            self.pos = float(np.clip(self.pos + self.step_size * np.clip(action[0], -1, 1), -1, 1))
            success = abs(self.goal - self.pos) < 0.1
            rewards.append(before - abs(self.goal - self.pos) + float(success))
            if success:
                break
        return ChunkResult(obs=self._obs(), rewards=np.asarray(rewards, np.float32), terminated=success,
                           truncated=False, success=success, steps=len(rewards))

    def render_frame(self):
        return np.zeros((8, 8, 3), np.uint8)


@register_adapter(__name__, config=GridEnvConfig)
class GridAdapter:
    @staticmethod
    def check_config(cfg) -> None:
        pass

    @staticmethod
    def action_convention(cfg: GridEnvConfig) -> ActionConvention:
        # one dim: the point's step along the line; no gripper
        return ActionConvention(arm="grid_line", gripper=NO_GRIPPER)

    @staticmethod
    def make(cfg: GridEnvConfig, *, num_envs: int, seed: int, env_offset: int = 0):
        factories = [functools.partial(GridSim, cfg, seed + env_offset + i) for i in range(num_envs)]
        return ProcessVectorEnv.from_config(factories, cfg, env_offset=env_offset, processes=False)
