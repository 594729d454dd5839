"""TEST FIXTURE, not a benchmark: ``toy`` reach, a small learnable image + instruction task.

A white point "end effector" moves in the square ``[-1, 1]^2``; one coloured goal square sits at a
position fixed per task (colour k at angle ``2*pi*k/num_tasks + pi/4`` on a circle around the centre). The
instruction names the colour ("move to the red square"). Everything a policy needs is in the 64x64
RGB image (and in the optional state vector ``[x, y, goal_x, goal_y]``), and the goal direction is
also determined by the task id, so a small policy learns the task with GRPO/PPO in seconds to minutes
on CPU (tests/envs/test_toy.py trains a linear policy on pixels in about 10 s). Pure numpy: thousands
of steps per second.

* actions ``[H, A]`` in ``[-1, 1]`` (A = 7 like LIBERO by default so a VLA action head fits): the first
  two dims move the point by ``step_size`` per unit, the others are ignored;
* success (episode terminates) when the point is inside the goal square; sparse reward 1 on that step,
  or with ``reward_mode: dense`` the decrease of the distance to the goal on every step plus 1 on success;
* ``num_init_states`` fixed start positions (init state j is a fixed seed), so GRPO groups can share
  an init state; ``reset`` without one picks one at random (from ``init_state_ids`` when given);
  :meth:`ToyAdapter.eval_schedule` lists an evaluation sweep's ``(task_id, init_state_id)`` pairs;
* :func:`oracle_actions` is a scripted policy that always succeeds from the image alone (or the
  state); a uniform random policy rarely does.

The adapter builds the batch with :class:`~embodirl.envs.vector.vector_env.ProcessVectorEnv` (in-process by
default, ``processes: true`` for one process per env), so the toy obeys the same batch semantics as
the real simulators.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from embodirl.config_fields import instance, num, one_of, required
from embodirl.envs.base import ChunkResult, CommonEnvConfig, EnvSpec, SimEnv
from embodirl.envs.conventions import NO_GRIPPER, ActionConvention
from embodirl.envs.registry import register_adapter
from embodirl.envs.vector.vector_env import ProcessVectorEnv
from embodirl.errors import ConfigError

# name -> RGB; task k is colour k
COLOURS: list[tuple[str, tuple[int, int, int]]] = [
    ("red", (230, 40, 40)), ("green", (40, 200, 60)), ("blue", (50, 90, 230)), ("yellow", (230, 210, 40)),
    ("magenta", (210, 60, 210)), ("cyan", (40, 210, 210)), ("orange", (240, 140, 30)), ("purple", (130, 60, 200)),
]
BACKGROUND = (30, 30, 30)
AGENT_COLOUR = (255, 255, 255)
CAMERA = "main"
REWARD_MODES = ("sparse", "dense")
GOAL_DISTANCE = 0.6          # goal centres lie on this circle around the origin
GOAL_HALF_SIZE = 0.15        # half side of the goal square (success region)
START_RADIUS = 0.25          # start positions are uniform in this disc
AGENT_HALF_SIZE = 0.04       # half side of the drawn point
SUCCESS_REWARD = 1.0
MIN_IMAGE_SIZE = 16
STATE_DIM = 4                # [x, y, goal_x, goal_y]
MOVE_DIMS = 2                # action dims that move the point
INIT_STATE_SEED = 10_007     # init state j starts from default_rng((INIT_STATE_SEED, j))
#: the first MOVE_DIMS dims move the point, the others (a VLA's gripper dim included) are ignored
ACTION_CONVENTION = ActionConvention(arm="toy_point", gripper=NO_GRIPPER)


def instruction(task_id: int) -> str:
    return f"move to the {COLOURS[task_id][0]} square"


def goal_position(task_id: int, num_tasks: int) -> np.ndarray:
    """Centre of task ``task_id``'s goal square, float64 ``[2]``."""
    angle = 2.0 * math.pi * task_id / num_tasks + math.pi / 4
    return GOAL_DISTANCE * np.array([math.cos(angle), math.sin(angle)])


def init_position(init_state_id: int) -> np.ndarray:
    """Start position of fixed init state ``init_state_id`` (the same for every task), ``[2]``."""
    rng = np.random.default_rng((INIT_STATE_SEED, init_state_id))
    radius = START_RADIUS * math.sqrt(rng.uniform())
    angle = rng.uniform(0.0, 2.0 * math.pi)
    return radius * np.array([math.cos(angle), math.sin(angle)])


def _to_world(rc: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    h, w = size
    x = rc[..., 1] / (w - 1) * 2.0 - 1.0
    y = 1.0 - rc[..., 0] / (h - 1) * 2.0
    return np.stack([x, y], axis=-1)


@functools.lru_cache(maxsize=8)
def _pixel_world(size: tuple[int, int]) -> np.ndarray:
    """World coordinates of every pixel centre, float64 ``[h, w, 2]`` (cached per image size)."""
    rows, cols = np.mgrid[0:size[0], 0:size[1]]
    return _to_world(np.stack([rows, cols], axis=-1).astype(np.float64), size)


def render(pos: np.ndarray, goal: np.ndarray, colour: tuple[int, int, int], size: tuple[int, int]) -> np.ndarray:
    """The scene as uint8 ``[3, h, w]``: background, goal square, point on top."""
    h, w = size
    image = np.empty((h, w, 3), np.uint8)                                  # (h, w, 3)
    image[:] = BACKGROUND
    world = _pixel_world((h, w))                                           # (h, w, 2)
    image[np.max(np.abs(world - goal), axis=-1) <= GOAL_HALF_SIZE] = colour
    image[np.max(np.abs(world - pos), axis=-1) <= AGENT_HALF_SIZE] = AGENT_COLOUR
    return image.transpose(2, 0, 1)                                        # (3, h, w)


#: the chunk of an episode at which a ``crash_init_state`` episode raises
CRASH_AT_CHUNK = 2


class ToySimEnv(SimEnv):
    """TEST FIXTURE: one toy reach scene (see module docstring). ``cfg``: the typed :class:`ToyEnvConfig` (or a
    mapping of it)."""

    def __init__(self, cfg, seed: int = 0):
        env = ToyAdapter.check_config(cfg)
        self.num_tasks = env.num_tasks
        self.task_ids = list(env.task_ids or range(self.num_tasks))
        h, w = env.image_size
        self.image_size = (h, w)
        self.cameras = list(env.cameras)
        self.use_state = env.state_obs
        self.step_size = env.step_size
        self.reward_mode = env.reward_mode
        self.init_pool = list(env.init_state_ids or range(env.num_init_states))
        self.spec = EnvSpec(
            action_dim=env.action_dim, max_episode_steps=env.max_episode_steps,
            task_descriptions=[instruction(k) for k in range(self.num_tasks)], camera_names=self.cameras,
            image_size=self.image_size if self.cameras else None, state_dim=STATE_DIM if self.use_state else 0,
            num_init_states=[env.num_init_states] * self.num_tasks, name=env.name)
        self.rng = np.random.default_rng(seed)
        self.pos = np.zeros(2)
        self.task_id = self.task_ids[0]
        self.goal = goal_position(self.task_id, self.num_tasks)
        # a stalled simulator on purpose (env.step_timeout_s tests): the first process to reach its
        # hang_at_step-th chunk creates hang_marker and never answers again; later processes see the marker
        self.hang_at_step = env.hang_at_step
        self.hang_marker = env.hang_marker
        # a simulator that crashes on purpose (evaluation tests): every episode from this init state raises at its
        # second chunk, on every re-run, as a MuJoCo instability the policy's own greedy actions cause would
        self.crash_init_state = env.crash_init_state
        self.chunks_stepped = 0
        self.episode_chunks = 0

    def reset(self, task_id: int | None = None, init_state_id: int | None = None,
              seed: int | None = None) -> dict[str, np.ndarray]:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        if task_id is None:
            task_id = self.task_ids[self.rng.integers(len(self.task_ids))]
        if not 0 <= task_id < self.num_tasks:
            raise ValueError(f"toy task_id {task_id} outside 0..{self.num_tasks - 1}")
        if init_state_id is None:
            init_state_id = int(self.init_pool[self.rng.integers(len(self.init_pool))])
        self.task_id, self.init_state_id = int(task_id), int(init_state_id)
        self.episode_chunks = 0
        self.goal = goal_position(self.task_id, self.num_tasks)
        self.pos = init_position(self.init_state_id)
        return self._obs()

    def _distance(self) -> float:
        return float(np.linalg.norm(self.pos - self.goal))

    def _inside(self) -> bool:
        return bool(np.max(np.abs(self.pos - self.goal)) < GOAL_HALF_SIZE)

    def _image(self) -> np.ndarray:
        return render(self.pos, self.goal, COLOURS[self.task_id][1], self.image_size)   # (3, h, w)

    def _obs(self) -> dict[str, np.ndarray]:
        obs: dict[str, np.ndarray] = {"task_id": np.array(self.task_id, np.int64)}
        if self.cameras:
            obs["images"] = np.stack([self._image()] * len(self.cameras))     # (V, 3, h, w)
        if self.use_state:
            obs["state"] = np.concatenate([self.pos, self.goal]).astype(np.float32)   # (S,)
        return obs

    def _hang_once(self) -> None:
        try:
            os.close(os.open(str(self.hang_marker), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return                                   # another process (or an earlier one) hung already
        threading.Event().wait()                     # never returns: the process stops answering

    def step_chunk(self, actions: np.ndarray, render_all: bool = False) -> ChunkResult:
        """Move by each action ``[H, A]``; stops at success (the time limit is the vector env's)."""
        self.chunks_stepped += 1
        self.episode_chunks += 1
        if self.hang_at_step is not None and self.chunks_stepped >= int(self.hang_at_step):
            self._hang_once()
        if self.crash_init_state is not None and self.init_state_id == int(self.crash_init_state) \
                and self.episode_chunks >= CRASH_AT_CHUNK:
            raise RuntimeError(f"toy simulator: unstable state at init state {self.init_state_id} (crash_init_state)")
        rewards, frames = [], []
        success = False
        for action in np.asarray(actions, np.float64):
            before = self._distance()
            self.pos = np.clip(self.pos + self.step_size * np.clip(action[:MOVE_DIMS], -1.0, 1.0), -1.0, 1.0)
            success = self._inside()
            reward = (before - self._distance()) if self.reward_mode == "dense" else 0.0
            rewards.append(reward + (SUCCESS_REWARD if success else 0.0))
            if render_all and self.cameras:
                frames.append(np.stack([self._image()] * len(self.cameras)))
            if success:
                break
        return ChunkResult(obs=self._obs(), rewards=np.asarray(rewards, np.float32), terminated=success,
                           truncated=False, success=success, steps=len(rewards),
                           frames=np.stack(frames) if frames else None)

    def render_frame(self) -> np.ndarray:
        return self._image().transpose(1, 2, 0)                          # (h, w, 3)


# --------------------------------------------------------------------------------------------------
# scripted oracle
# --------------------------------------------------------------------------------------------------
def locate(image: np.ndarray, task_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Point and goal centre (world coordinates ``[2]``) read from one image ``[3, h, w]``."""
    hwc = image.transpose(1, 2, 0)
    size = hwc.shape[:2]
    agent = np.argwhere(np.all(hwc == AGENT_COLOUR, axis=-1))              # (n, 2) pixel (row, col)
    goal = np.argwhere(np.all(hwc == COLOURS[task_id][1], axis=-1))
    if len(agent) == 0 or len(goal) == 0:
        raise ValueError("toy image shows no point or no goal square")
    # the point may cover part of the square: take the middle of the square's bounding box
    goal_rc = (goal.min(axis=0) + goal.max(axis=0)) / 2.0
    return _to_world(agent.mean(axis=0), size), _to_world(goal_rc, size)


def oracle_actions(obs: Mapping[str, np.ndarray], chunk_len: int, action_dim: int,
                   step_size: float) -> np.ndarray:
    """Scripted policy: a chunk that heads straight for the goal, float32 ``[B, H, A]``.

    Uses ``obs["state"]`` when present, else reads positions from ``obs["images"]`` ``[B, V, 3, h, w]``.
    """
    B = len(obs["task_id"])
    actions = np.zeros((B, chunk_len, action_dim), np.float32)                 # (B, H, A)
    for b in range(B):
        if "state" in obs:
            pos, goal = np.asarray(obs["state"][b][:2], np.float64), np.asarray(obs["state"][b][2:4], np.float64)
        else:
            pos, goal = locate(obs["images"][b][0], int(obs["task_id"][b]))
        for t in range(chunk_len):
            move = np.clip((goal - pos) / step_size, -1.0, 1.0)                    # (2,)
            actions[b, t, :MOVE_DIMS] = move
            pos = pos + step_size * move
    return actions


# --------------------------------------------------------------------------------------------------
# adapter
# --------------------------------------------------------------------------------------------------
@dataclass
class ToyEnvConfig(CommonEnvConfig):
    """``adapter: toy`` (config/env/toy_reach.yaml)."""

    name: str = required()
    num_tasks: int = num(1, len(COLOURS))
    task_ids: list[int] | None = required()
    image_size: list[int] = required()
    cameras: list[str] = required()
    state_obs: bool = required()
    action_dim: int = num(MOVE_DIMS)
    step_size: float = num(0, lo_open=True)
    reward_mode: str = one_of(REWARD_MODES)
    processes: bool = required()
    hang_at_step: int | None = num(1, null=True)
    hang_marker: str | None = required()
    crash_init_state: int | None = num(0, null=True)
    num_init_states: int = num(1)

    @property
    def task_subset(self) -> list[int] | None:
        return self.task_ids


@register_adapter("toy", config=ToyEnvConfig)
class ToyAdapter:
    """``adapter: toy`` (TEST FIXTURE)."""

    @staticmethod
    def check_config(cfg) -> ToyEnvConfig:
        """The env split as the typed :class:`ToyEnvConfig`, with the rules between its keys checked."""
        env = instance(ToyEnvConfig, cfg, "env")
        for task in env.task_ids or []:
            if not 0 <= task < env.num_tasks:
                raise ConfigError("env.task_ids", f"toy task id {task} is outside 0..{env.num_tasks - 1}")
        unknown = [c for c in env.cameras if c != CAMERA]
        if unknown:
            raise ConfigError("env.cameras", f"the toy task has one camera '{CAMERA}', not {unknown}")
        if env.hang_at_step is not None and not (env.hang_marker and env.processes):
            raise ConfigError("env.hang_at_step", f"must be null or a chunk count >= 1 with env.hang_marker (a file "
                                                  f"path) and env.processes=true, got {env.hang_at_step!r}")
        if env.crash_init_state is not None and not env.crash_init_state < env.num_init_states:
            raise ConfigError("env.crash_init_state", f"must be null or a toy init state 0..{env.num_init_states - 1}, "
                                                      f"got {env.crash_init_state!r}")
        if not env.cameras and not env.state_obs:
            raise ConfigError("env.cameras", "the toy task needs a camera or state_obs: true to observe anything")
        if min(env.image_size) < MIN_IMAGE_SIZE:
            raise ConfigError("env.image_size", f"toy images must be at least {MIN_IMAGE_SIZE} pixels, "
                                                f"got {list(env.image_size)}")
        bad = [i for i in env.init_state_ids or [] if not 0 <= i < env.num_init_states]
        if bad:
            raise ConfigError("env.init_state_ids", f"toy init states are 0..{env.num_init_states - 1}, got {bad}")
        return env

    @staticmethod
    def eval_schedule(cfg) -> list[tuple[int, int]]:
        """An evaluation sweep as ordered ``(task_id, init_state_id)`` pairs: for every task of
        ``task_ids`` (all when null), trial k uses init state k (``num_trials_per_task`` trials), or the
        listed ``init_state_ids``."""
        env = instance(ToyEnvConfig, cfg, "env")
        tasks = list(env.task_ids or range(env.num_tasks))
        trials = list(env.init_state_ids or range(env.num_trials_per_task))
        return [(task, init) for task in tasks for init in trials]

    @staticmethod
    def action_convention(cfg) -> ActionConvention:
        """The point's planar move in the first two dims, the rest ignored: no gripper to convert."""
        return ACTION_CONVENTION

    @classmethod
    def make(cls, cfg, *, num_envs: int, seed: int, env_offset: int = 0) -> ProcessVectorEnv:
        env = cls.check_config(cfg)
        factories = [functools.partial(ToySimEnv, env, seed=seed + env_offset + i) for i in range(num_envs)]
        return ProcessVectorEnv.from_config(factories, env, env_offset=env_offset, processes=env.processes)
