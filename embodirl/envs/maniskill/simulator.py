"""ManiSkill 3 adapter: any registered ManiSkill task as an embodirl environment.

Two simulators behind one config (``config/env/_maniskill_base.yaml``):

* ``physx_cpu`` - one :class:`ManiSkillSimEnv` (a single-scene ManiSkill env) per sub-process, lifted
  into a batch by :class:`~embodirl.envs.vector.vector_env.ProcessVectorEnv`. PhysX-CPU refuses ``num_envs > 1``
  in one process, so this is how ManiSkill vectorises on CPU.
* ``physx_cuda`` - :class:`~embodirl.envs.maniskill.gpu.ManiSkillGPUEnv`, all ``B`` scenes in one
  GPU-batched ManiSkill env. ``sim_backend: auto`` picks it when ``torch.cuda.is_available()``.

Conventions shared by both simulators (the helpers below are used by both):

* **Observations**: ``state`` mode gives ManiSkill's flattened state vector as ``state`` float32
  ``[S]``; ``rgb`` mode gives ``images`` uint8 ``[V, 3, h, w]`` from the task's sensor cameras (or the
  configured ``cameras``, rendered at ``image_size``) plus the agent's proprioception and the task's
  extra observations (goal position, TCP pose, ...) flattened as ``state`` so that an image policy
  can use proprio. ``task_id`` is always 0: an env config is one task, whose instruction
  (:func:`~embodirl.envs.maniskill.tasks.instruction`) is ``spec.task_descriptions[0]``.
* **Actions** are in the env's own action space (``control_mode``; with ``pd_ee_delta_pos`` each of
  the three arm dims in ``[-1, 1]`` is a fraction of the controller's largest end-effector step and
  the gripper dim is -1 closed / +1 open), declared as :func:`action_convention` (a policy of another
  convention is converted before the chunk gets here, :mod:`embodirl.envs.conventions`). They are clipped
  to the space's bounds before they run
  (ManiSkill's controllers clip as well; clipping here makes the bound explicit and the same on both
  simulators), so a policy gains nothing by leaving the space.
* **Chunks**: a chunk ``[H, A]`` runs up to H control steps and stops early at termination
  (``info["success"]`` or ``info["fail"]``) or at the episode's time limit (config
  ``max_episode_steps``, overriding the task's default). Intermediate steps advance physics and the
  controller and evaluate success/reward *without* computing observations, so cameras render once per
  chunk; the observation after the last step is exactly what ``env.step`` would have returned
  (see :func:`step_without_observation`). Rewards are returned per executed step.
* **Init states**: ``reset(init_state_id=k)`` seeds ManiSkill's episode with seed ``k``, so envs that
  share ``k`` (a GRPO group, possibly in different processes) start from the same scene. Without an
  id the env draws one of its training states with its own RNG (:func:`training_init_states`):
  ``init_state_ids`` when listed, else ``num_init_states`` seeds (``null``: every 31-bit one) from
  :data:`~embodirl.envs.base.TRAIN_INIT_STATE_BASE` = 2**30 on (``train_init_states: heldout``), apart from
  the evaluation's seeds ``0 .. num_trials_per_task - 1``, or from 0 on (``official``: the evaluation's own,
  on purpose). Tasks that rebuild their scene on every reset (``reconfiguration_freq``, e.g.
  PegInsertionSide's peg shapes) build it from the same seed, so the rule holds for them too.
* **Assets**: tasks that need downloaded data fail in :meth:`ManiSkillAdapter.check_config` (and at
  construction) with one sentence naming the asset and the ``download_asset`` command.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import numpy as np

from embodirl.config_fields import instance, num, one_of, required
from embodirl.envs.base import (
    OFFICIAL,
    TRAIN_INIT_STATE_BASE,
    TRAIN_INIT_STATES,
    ChunkResult,
    CommonEnvConfig,
    EnvSpec,
    SimEnv,
    TrainingStates,
    shared_starts,
)
from embodirl.envs.conventions import SIGNED_OPEN_POSITIVE, ActionConvention
from embodirl.envs.maniskill.tasks import asset_prompt_guard, check_assets, instruction, task_spec
from embodirl.errors import ConfigError
from embodirl.runtime import configure

log = logging.getLogger(__name__)

OBS_MODES = ("state", "rgb")
REWARD_MODES = ("dense", "normalized_dense", "sparse", "none")
SIM_BACKENDS = ("auto", "physx_cpu", "physx_cuda")
CPU_BACKEND, GPU_BACKEND = "physx_cpu", "physx_cuda"
RGB = "rgb"                      # ManiSkill's texture name for colour images
# obs modes a task must list (ManiSkill's SUPPORTED_OBS_MODES) to be run in our obs_mode
_NEEDED_OBS_MODES = {"state": ("state",), "rgb": ("rgb", "sensor_data", "any_textures")}
MAX_SEED = 2**31                 # ManiSkill episode seeds are 31-bit
TASK_ID = 0                      # one task per env config


# --------------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------------
@dataclass
class ManiSkillEnvConfig(CommonEnvConfig):
    """``adapter: maniskill`` (config/env/_maniskill_base.yaml): the types and choices of its keys. The adapter
    registers it as its config class, and the simulators run on an instance of it (:func:`settings_of`)."""

    task: str = required()
    obs_mode: str = one_of(OBS_MODES)
    control_mode: str | None = required()
    reward_mode: str = one_of(REWARD_MODES)
    cameras: list[str] | None = required()      # rgb: camera names in image order (None: the task's sensors)
    image_size: list[int] = required()          # [h, w]
    sim_backend: str = one_of(SIM_BACKENDS)     # auto | physx_cpu | physx_cuda (as configured)
    train_init_states: str = one_of(TRAIN_INIT_STATES)   # heldout: seeds from 2**30 on | official: from 0 on
    num_init_states: int | None = num(1, null=True)   # None: any seed


def settings_of(cfg) -> ManiSkillEnvConfig:
    """A ManiSkill env split (a DictConfig or the plain dict a simulator process receives) as the typed object the
    simulators run on, checked for form (not against ManiSkill's registry: :func:`check_config`)."""
    settings = instance(ManiSkillEnvConfig, cfg, "env")
    size = settings.image_size
    if len(size) != 2 or any(s <= 0 for s in size):
        raise ConfigError("env.image_size", f"must be [height, width] in pixels, got {size}")
    first = first_training_seed(settings)
    if settings.num_init_states is not None and settings.num_init_states > MAX_SEED - first:
        raise ConfigError("env.num_init_states", f"training seeds start at {first} "
                                                 f"(train_init_states={settings.train_init_states}), so at most "
                                                 f"{MAX_SEED - first} of them fit below 2**31, got "
                                                 f"{settings.num_init_states}")
    return settings


def resolve_sim_backend(sim_backend: str) -> str:
    """``auto`` -> ``physx_cuda`` when CUDA is available, else ``physx_cpu``."""
    import torch

    if sim_backend == "auto":
        return GPU_BACKEND if torch.cuda.is_available() else CPU_BACKEND
    if sim_backend == GPU_BACKEND and not torch.cuda.is_available():
        raise ConfigError("env.sim_backend", "physx_cuda needs a CUDA GPU and none is visible; use auto or physx_cpu")
    return sim_backend


def _renderer() -> str:
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def make_maniskill_env(settings: ManiSkillEnvConfig, *, num_envs: int, sim_backend: str):
    """Build the gymnasium ManiSkill env (``gym.make``) for ``settings``; returns the wrapped env.

    Asset prompts become :class:`~embodirl.errors.AssetsMissing`, an unsupported control mode a
    :class:`ConfigError` listing the robot's modes.
    """
    configure()
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401 - registers the tasks

    h, w = settings.image_size
    reward_mode = "none" if sparse_from_info(settings) else settings.reward_mode
    kwargs: dict[str, Any] = dict(num_envs=num_envs, obs_mode=settings.obs_mode, reward_mode=reward_mode,
                  control_mode=settings.control_mode, sim_backend=sim_backend, render_backend=_renderer(),
                  max_episode_steps=settings.max_episode_steps,
                  human_render_camera_configs=dict(width=w, height=h))
    if settings.obs_mode == "rgb":
        kwargs["sensor_configs"] = dict(width=w, height=h)
    try:
        with asset_prompt_guard(settings.task):
            return gym.make(settings.task, **kwargs)
    except AssertionError as exc:
        if "not in supported modes" in str(exc):   # BaseAgent.set_control_mode's message
            raise ConfigError("env.control_mode", f"{exc}".replace(" not in supported modes:", " is not supported by "
                              f"{settings.task}'s robot; choose one of")) from None
        raise


@functools.cache
def _probe(task: str) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """(control modes of the task's robot or None if unknown, sensor camera names) from a throwaway
    state-only CPU scene without a renderer (a fraction of a second)."""
    configure()
    import gymnasium as gym
    from mani_skill.agents.base_agent import BaseAgent
    from mani_skill.agents.multi_agent import MultiAgent
    from mani_skill.sensors.camera import parse_camera_configs

    with asset_prompt_guard(task):
        env = gym.make(task, num_envs=1, obs_mode="state", sim_backend=CPU_BACKEND, render_backend="none")
    try:
        base: Any = env.unwrapped           # ManiSkill's BaseEnv (gymnasium types it as a plain Env)
        agent = base.agent
        modes = None
        if isinstance(agent, BaseAgent) and not isinstance(agent, MultiAgent):
            modes = tuple(agent.supported_control_modes)
        action_bounds(base)           # a flat action space, or ConfigError
        cameras = list(parse_camera_configs(base._default_sensor_configs))
        if agent is not None:
            cameras += [c for c in parse_camera_configs(agent._sensor_configs) if c not in cameras]
        return modes, tuple(cameras)
    finally:
        env.close()


def check_config(cfg: ManiSkillEnvConfig | Mapping, *, probe: bool = True) -> ManiSkillEnvConfig:
    """Everything that can be checked before a simulator starts (see :class:`ManiSkillAdapter`)."""
    settings = settings_of(cfg)
    backend = resolve_sim_backend(settings.sim_backend)
    spec = task_spec(settings.task)
    check_assets(settings.task)
    supported_rewards = tuple(spec.cls.SUPPORTED_REWARD_MODES)
    if settings.reward_mode not in supported_rewards and settings.reward_mode != "sparse":
        raise ConfigError("env.reward_mode", f"{settings.task} supports reward modes "
                          f"{', '.join(dict.fromkeys([*supported_rewards, 'sparse']))}, not '{settings.reward_mode}'")
    supported_obs = tuple(spec.cls.SUPPORTED_OBS_MODES)
    if not any(m in supported_obs for m in _NEEDED_OBS_MODES[settings.obs_mode]):
        raise ConfigError("env.obs_mode", f"{settings.task} does not support '{settings.obs_mode}' observations "
                          f"(it supports {', '.join(supported_obs)})")
    # A throwaway CPU scene tells the robot's control modes and camera names. Not on the GPU simulator:
    # SAPIEN must enable GPU PhysX before any CPU PhysX scene exists in the process.
    if probe and backend == CPU_BACKEND:
        try:
            modes, cameras = _probe(settings.task)
        except (ConfigError, FileNotFoundError):   # one-sentence errors (AssetsMissing is a FileNotFoundError)
            raise
        except Exception as exc:
            log.debug("probing %s failed (%s); control mode and cameras are checked at construction",
                      settings.task, exc)
            return settings
        if modes is not None and settings.control_mode is not None and settings.control_mode not in modes:
            raise ConfigError("env.control_mode", f"'{settings.control_mode}' is not supported by {settings.task}'s "
                              f"robot; choose one of {', '.join(modes)}")
        if settings.obs_mode == "rgb":
            _check_cameras(settings, cameras)
    return settings


def _check_cameras(settings: ManiSkillEnvConfig, available) -> None:
    if not available:
        raise ConfigError("env.obs_mode", f"{settings.task} has no sensor camera for rgb observations; "
                          "use obs_mode=state")
    unknown = [c for c in settings.cameras or () if c not in available]
    if unknown:
        raise ConfigError("env.cameras", f"{settings.task} has no camera {', '.join(unknown)}; "
                          f"available: {', '.join(available)}")


# --------------------------------------------------------------------------------------------------
# helpers shared by the CPU and GPU simulators (they operate on ManiSkill's batched torch tensors)
# --------------------------------------------------------------------------------------------------
def init_state_seed(init_state_id: int) -> int:
    """ManiSkill episode seed of fixed init state ``init_state_id`` (the id itself: init state k is
    the scene ManiSkill builds for seed k, the usual evaluation convention)."""
    if not 0 <= int(init_state_id) < MAX_SEED:
        raise ValueError(f"init_state_id must be in 0..{MAX_SEED - 1}, got {init_state_id}")
    return int(init_state_id)


def first_training_seed(settings: ManiSkillEnvConfig) -> int:
    """The first seed of the training states: 0 with ``train_init_states: official``, else 2**30."""
    return 0 if settings.train_init_states == OFFICIAL else TRAIN_INIT_STATE_BASE


def training_init_states(settings: ManiSkillEnvConfig) -> range | list[int]:
    """The init state ids (episode seeds) training resets draw from: ``init_state_ids`` when listed, else
    ``num_init_states`` seeds from :func:`first_training_seed` on (``null``: up to 2**31)."""
    if settings.init_state_ids:
        return list(settings.init_state_ids)
    first = first_training_seed(settings)
    return range(first, MAX_SEED if settings.num_init_states is None else first + settings.num_init_states)


def eval_schedule(settings: ManiSkillEnvConfig) -> list[tuple[int, int]]:
    """The evaluation sweep: init states (seeds) ``init_state_ids``, or ``0 .. num_trials_per_task - 1``, of the one
    task."""
    trials = settings.init_state_ids or range(settings.num_trials_per_task)
    return [(TASK_ID, int(k)) for k in trials]


def training_states(train: ManiSkillEnvConfig, evaluation: ManiSkillEnvConfig) -> TrainingStates:
    """Where ``train``'s episodes start beside ``evaluation``'s sweep: the sweep's seeds that training draws too."""
    pools: dict[int, Sequence[int]] = {TASK_ID: training_init_states(train)}
    same_tasks = train.task == evaluation.task
    shared = shared_starts(eval_schedule(evaluation), pools) if same_tasks else []
    if train.init_state_ids:
        key = "env.train.init_state_ids"
    elif train.train_init_states == OFFICIAL:
        key = "env.train.train_init_states"
    else:                                       # held-out seeds meet the sweep only where it reaches 2**30
        key = "env.eval.init_state_ids" if evaluation.init_state_ids else "env.eval.num_trials_per_task"
    return TrainingStates(pools=pools, shared=shared, key=key, on_purpose=train.train_init_states == OFFICIAL,
                          same_tasks=same_tasks)


def draw_init_state(rng: np.random.Generator, settings: ManiSkillEnvConfig) -> int:
    """An init state id for an episode whose caller did not choose one: one of the training states."""
    pool = training_init_states(settings)
    return int(pool[int(rng.integers(len(pool)))])


def sparse_from_info(settings: ManiSkillEnvConfig) -> bool:
    """``reward_mode: sparse`` on a task that defines no sparse reward (the Bridge digital twins
    define none at all): the simulator runs with ``reward_mode="none"`` and the adapter computes
    ManiSkill's generic sparse reward, ``success - fail``, from ``info``."""
    return settings.reward_mode == "sparse" and "sparse" not in task_spec(settings.task).cls.SUPPORTED_REWARD_MODES


class StateObsOnDemand(Mapping):
    """The state part of a ManiSkill observation (agent + task extras, ``BaseEnv._get_obs_state_dict``), computed the
    first time a reward reads it. ManiSkill hands the observation to every reward function, but none of its tasks
    reads it (their rewards use the scene's poses): not computing it takes a PushCube control step (the default job's)
    from 1.61 to 1.49 CPU-ms (medians of 9 runs each, in turn; 2026-12-07, the project's 2-core machine). A task whose
    reward does read it gets the same values, computed then, from the same state."""

    def __init__(self, base, info: dict):
        self._base, self._info = base, info
        self._obs: dict | None = None

    def _state(self) -> dict:
        if self._obs is None:
            self._obs = self._base._get_obs_state_dict(self._info)
        return self._obs

    def __getitem__(self, key):
        return self._state()[key]

    def __iter__(self):
        return iter(self._state())

    def __len__(self) -> int:
        return len(self._state())


def step_without_observation(base, action, sparse_reward_from_info: bool = False):
    """One control step of ManiSkill's ``BaseEnv.step`` (mani_skill/envs/sapien_env.py) minus the
    observation: set the action, run the sim sub-steps, count the step, evaluate and compute the
    reward. Cameras are not rendered; ``base.get_obs(info)`` afterwards returns exactly the
    observation ``BaseEnv.step`` would have returned. Returns ``(reward [B] float, info)`` (torch).

    The reward sees the state part of the observation (agent + task extras), computed only if it reads it
    (:class:`StateObsOnDemand`): no ManiSkill task reads camera data in its reward.
    """
    action = base._step_action(action)
    base._elapsed_steps += 1
    info = base.get_info()
    if sparse_reward_from_info:
        reward = base.compute_sparse_reward(obs=None, action=action, info=info)
    else:
        reward = base.get_reward(obs=StateObsOnDemand(base, info), action=action, info=info)
    return reward.float(), info


def success_fail(info: dict, num_envs: int) -> tuple[np.ndarray, np.ndarray]:
    """``info["success"]`` / ``info["fail"]`` as bool ``[B]`` numpy arrays (False where absent)."""
    def flag(key):
        value = info.get(key)
        if value is None:
            return np.zeros(num_envs, bool)
        return np.asarray(value.cpu() if hasattr(value, "cpu") else value, dtype=bool).reshape(num_envs)

    return flag("success"), flag("fail")


class ObsConverter:
    """ManiSkill's batched torch observation -> embodirl's numpy obs dict (module docstring)::

        images   uint8   [B, V, 3, h, w]   rgb mode only
        state    float32 [B, S]
        task_id  int64   [B]
    """

    def __init__(self, base, settings: ManiSkillEnvConfig):
        self.base = base
        self.obs_mode = settings.obs_mode
        self.cameras: list[str] = []
        if self.obs_mode == "rgb":
            available = list(base._sensors)
            _check_cameras(settings, available)
            self.cameras = list(settings.cameras) if settings.cameras else available

    def __call__(self, raw) -> dict[str, np.ndarray]:
        from mani_skill.utils import common

        if self.obs_mode == "state":
            state = raw                                                     # (B, S)
            out = {}
        else:
            state = common.flatten_state_dict(dict(agent=raw["agent"], extra=raw["extra"]),
                                              use_torch=True, device=self.base.device)  # (B, S)
            images = [raw["sensor_data"][cam][RGB] for cam in self.cameras]  # V x (B, h, w, 3)
            out = {"images": np.ascontiguousarray(
                np.stack([img.cpu().numpy() for img in images], axis=1).transpose(0, 1, 4, 2, 3))}  # (B, V, 3, h, w)
        state = state.float().cpu().numpy().reshape(state.shape[0], -1)    # (B, S)
        out["state"] = np.ascontiguousarray(state, dtype=np.float32)
        out["task_id"] = np.full(state.shape[0], TASK_ID, np.int64)        # (B,)
        return out


def action_bounds(base) -> tuple[np.ndarray, np.ndarray]:
    """Per-dim low/high of the single-env action space, float32 ``[A]``."""
    space = base.single_action_space
    if not hasattr(space, "low"):   # multi-robot tasks take a dict of actions
        raise ConfigError("env.task", f"{base.spec.id if base.spec else type(base).__name__} takes a "
                          f"{type(space).__name__} action space; embodirl needs one flat action vector "
                          "(single-robot tasks)")
    return np.asarray(space.low, np.float32).reshape(-1), np.asarray(space.high, np.float32).reshape(-1)


def action_convention(settings: ManiSkillEnvConfig) -> ActionConvention:
    """What the task's controller consumes: the arm part of ``control_mode`` (``maniskill/<control_mode>``; null: the
    robot's default mode) and the gripper's normalised finger-joint target, -1 closed / +1 open (``PDJointPosMimic``
    between the fingers' closed ``lower`` and open ``upper`` limits, as mani_skill's Panda and WidowX declare them)."""
    return ActionConvention(arm=f"maniskill/{settings.control_mode or 'default'}", gripper=SIGNED_OPEN_POSITIVE)


def make_spec(settings: ManiSkillEnvConfig, base, converter: ObsConverter, state_dim: int) -> EnvSpec:
    low, high = action_bounds(base)
    h, w = settings.image_size          # [h, w] (settings_of checks)
    return EnvSpec(action_dim=int(low.shape[0]), max_episode_steps=settings.max_episode_steps,
                   task_descriptions=[instruction(settings.task)], camera_names=list(converter.cameras),
                   image_size=(h, w) if settings.obs_mode == "rgb" else None,
                   state_dim=state_dim,
                   num_init_states=[settings.num_init_states] if settings.num_init_states is not None else [],
                   first_init_state=first_training_seed(settings),
                   action_low=low.tolist(), action_high=high.tolist(), name=settings.task)


# --------------------------------------------------------------------------------------------------
# one CPU simulator
# --------------------------------------------------------------------------------------------------
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _without_autograd(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run a :class:`ManiSkillSimEnv` method under ``torch.inference_mode``. ManiSkill keeps its state in torch
    tensors and spends most of a CPU step on small torch operations; nothing a simulator computes is ever
    differentiated, and without autograd's bookkeeping (version counters, views) a PushCube control step costs
    1.55 CPU-ms instead of 1.80 (2026-12-07, the project's 2-core machine), with the same numbers. The env is built
    under it too, so its tensors are inference tensors: code outside these methods may read them (an expert reading
    the scene through :attr:`ManiSkillSimEnv.unwrapped`) but must not update them in place, which torch refuses
    outside inference mode."""

    @functools.wraps(method)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        import torch

        with torch.inference_mode():
            return method(*args, **kwargs)

    return run


class ManiSkillSimEnv(SimEnv):
    """One single-scene ManiSkill env on PhysX-CPU (see the module docstring for the conventions).

    ``ignore_terminations`` (config key) makes :meth:`step_chunk` run through success/failure instead
    of stopping there: a task's success is usually a held state, and stopping at each such step would
    render a camera frame per step while the episode runner ignores the end anyway. Its methods compute without
    autograd (:func:`_without_autograd`).
    """

    @_without_autograd
    def __init__(self, cfg: ManiSkillEnvConfig | Mapping, seed: int = 0):
        self.settings = settings_of(cfg)
        self.stop_at_termination = not self.settings.ignore_terminations
        self._env = make_maniskill_env(self.settings, num_envs=1, sim_backend=CPU_BACKEND)
        self._base = self._env.unwrapped
        self._convert = ObsConverter(self._base, self.settings)
        self._low, self._high = action_bounds(self._base)
        self._sparse_from_info = sparse_from_info(self.settings)
        self._rng = np.random.default_rng(seed)
        self.init_state_id: int | None = None
        self._obs = self._unbatch(self._convert(self._base.get_obs()))
        self.spec = make_spec(self.settings, self._base, self._convert, int(self._obs["state"].shape[0]))
        self._elapsed = 0

    # -- SimEnv ------------------------------------------------------------------------------------
    @_without_autograd
    def reset(self, task_id: int | None = None, init_state_id: int | None = None,
              seed: int | None = None) -> dict[str, np.ndarray]:
        if task_id not in (None, TASK_ID):
            raise ValueError(f"a ManiSkill env config holds one task (task_id {TASK_ID}), got task_id {task_id}")
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        if init_state_id is None:
            init_state_id = draw_init_state(self._rng, self.settings)
        self.init_state_id = int(init_state_id)
        raw, _ = self._env.reset(seed=init_state_seed(self.init_state_id), options=dict(reconfigure=False))
        self._elapsed = 0
        self._obs = self._unbatch(self._convert(raw))
        return self._obs

    @_without_autograd
    def step_chunk(self, actions: np.ndarray, render_all: bool = False) -> ChunkResult:
        """Run ``actions`` ``[H, A]`` (clipped to the action space); rewards per executed step."""
        actions = np.asarray(actions, dtype=np.float32)
        if actions.ndim != 2 or actions.shape[1] != self.spec.action_dim:
            raise ValueError(f"actions must have shape [H, A={self.spec.action_dim}], got {list(actions.shape)}")
        import torch

        clipped = np.clip(actions, self._low, self._high)                  # (H, A)
        rewards: list[float] = []
        frames: list[np.ndarray] = []
        success = terminated = truncated = fail = False
        info: dict = {}
        for action in clipped:
            reward, info = step_without_observation(self._base, torch.from_numpy(action[None]), self._sparse_from_info)
            self._elapsed += 1
            rewards.append(float(reward.reshape(-1)[0]))
            succ, failed = success_fail(info, 1)
            success |= bool(succ[0])
            fail = bool(failed[0])
            terminated = bool(succ[0] or failed[0])
            truncated = self._elapsed >= self.settings.max_episode_steps
            if render_all:
                self._obs = self._unbatch(self._convert(self._base.get_obs(info)))
                frames.append(self._images_or_render(self._obs))
            if truncated or (terminated and self.stop_at_termination):
                break
        if not render_all:
            self._obs = self._unbatch(self._convert(self._base.get_obs(info)))  # the one render of the chunk
        return ChunkResult(obs=self._obs, rewards=np.asarray(rewards, np.float32), terminated=terminated,
                           truncated=truncated, success=success, steps=len(rewards),
                           frames=np.stack(frames) if render_all else None,
                           info=dict(fail=fail, elapsed_steps=self._elapsed, init_state_id=self.init_state_id))

    @_without_autograd
    def render_frame(self) -> np.ndarray | None:
        """rgb mode: the first camera's current image; state mode: ManiSkill's human render camera
        (``image_size``). ``[h, w, 3]`` uint8."""
        if "images" in self._obs:
            return np.ascontiguousarray(self._obs["images"][0].transpose(1, 2, 0))
        frame = self._base.render_rgb_array()
        return None if frame is None else frame[0].cpu().numpy().astype(np.uint8)

    def close(self) -> None:
        self._env.close()

    @property
    def unwrapped(self):
        """The ManiSkill ``BaseEnv`` (privileged state for scripted policies and debugging)."""
        return self._base

    # -- internals -----------------------------------------------------------------------------------
    @staticmethod
    def _unbatch(obs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {k: v[0] for k, v in obs.items()}
        out["task_id"] = np.asarray(out["task_id"], np.int64)
        return out

    def _images_or_render(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        if "images" in obs:
            return obs["images"]                                            # (V, 3, h, w)
        frame = self.render_frame()
        assert frame is not None            # state mode renders ManiSkill's human render camera
        return frame.transpose(2, 0, 1)[None]                               # (1, 3, h, w)


def make_sim_env(cfg: ManiSkillEnvConfig | Mapping, seed: int) -> ManiSkillSimEnv:
    """Factory for one sub-process (module-level so that it pickles by reference)."""
    return ManiSkillSimEnv(cfg, seed=seed)
