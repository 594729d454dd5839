"""LIBERO (robosuite 1.4 + MuJoCo) behind :class:`~embodirl.envs.base.SimEnv`, following the OpenVLA-OFT
LIBERO evaluation protocol.

The protocol (OpenVLA-OFT ``experiments/robot/libero/run_libero_eval.py``), and where this module keeps it:

* **Scene**: one ``OffScreenRenderEnv`` per task, built from the task's BDDL file with cameras of
  ``image_size`` (OFT renders 256x256 and lets the processor resize).
* **Episode start**: ``env.reset()``, then ``env.set_init_state(init_states[k])`` with the package's
  ``get_task_init_states`` (50 per task); trial k of a task uses init state k (:func:`eval_schedule`). Training
  starts from states held out from these (``train_init_states``, ids from 2**30: :mod:`embodirl.envs.libero.states`).
  Then ``num_settle_steps`` (10) no-op steps ``[0, 0, 0, 0, 0, 0, -1]`` let objects settle; they do not
  count towards ``max_episode_steps`` (220 / 280 / 300 / 520 / 400 policy steps for spatial / object /
  goal / 10 / 90, in the suite YAMLs) and their done flag is ignored.
* **Observation**: cameras ``agentview`` and ``wrist`` (robosuite's ``robot0_eye_in_hand``), each image
  rotated by 180 degrees (``img[::-1, ::-1]``: both axes flipped, as OFT does to match its training
  data), returned as uint8 ``[V, 3, h, w]``; an 8-D proprio ``state``: end-effector position (3), the
  axis-angle of the end-effector quaternion (3, OFT's ``quat2axisangle``: ``2*acos(w)`` about
  ``xyz/|xyz|``, zero when ``w = +-1``) and the two gripper finger positions (2).
* **Actions** are LIBERO's own (:data:`ACTION_CONVENTION`): six end-effector delta dims for robosuite's
  OSC_POSE controller and the gripper, -1 = open, +1 = close, passed to ``env.step`` unchanged. A policy of
  another convention is converted before the chunk gets here (:mod:`embodirl.envs.conventions`): OpenVLA-OFT's
  [0, 1] gripper (1 = open) becomes OFT's ``invert_gripper_action(normalize_gripper_action(a, binarize=True))``,
  ``-sign(2g - 1)``; π0's LIBERO checkpoints emit LIBERO's convention and pass unchanged.
* **Success**: the env's done flag (``env._check_success()``, the BDDL goal predicates); the episode
  terminates on success. **Reward**: sparse, 1.0 at a step after which the goal holds, else 0 (the
  reward LIBERO itself returns). With ``ignore_terminations`` the chunk is not cut at success and every
  step on which the goal holds earns 1.0 (the vector env reports success-so-far).

Three patches to robosuite internals make the same episodes cheaper without changing an observation
(rendering at decisions only, a cheap soft reset, no repeated forward pass: :mod:`embodirl.envs.libero.patches`).
One more departure is the protocol's own:

* **Deterministic scene.** Each reset re-samples the placement of fixtures (cabinets, stoves: up to
  about 1 cm) from numpy's global RNG, which the init-state vector does not cover; OFT inherits that
  randomness from ``env.seed(0)`` and the reset order. Here numpy's global RNG is seeded from
  ``(task_id, init_state_id)`` before each reset, so an init state id names one whole scene: GRPO
  groups that share it see the same scene, and evaluation is reproducible in any order.
  ``scene_seeding: oft`` (what ``runner.eval_protocol: oft`` sets for evaluation) reproduces OFT's
  episodes instead: each task has its own numpy RNG state, seeded 0 the way ``get_libero_env``'s
  ``env.seed(0)`` seeds it, and trial k's reset draws from it after trials 0..k-1 have drawn. A
  simulator asked for trial k of a task whose trials it has not all run replays the missing resets
  first, so OFT's order holds in every simulator whatever the batch it serves.

Faults: a simulator that goes unstable (non-finite ``qpos``/``qvel`` or MuJoCo's bad-state warnings,
after which MuJoCo silently resets the data) raises :class:`SimulationUnstable` from ``step_chunk``; the
vector env then replaces the sub-env.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from embodirl import runtime
from embodirl.config_fields import instance, num, required
from embodirl.envs.base import TRAIN_INIT_STATE_BASE, ChunkResult, CommonEnvConfig, EnvSpec, SimEnv, TrainingStates
from embodirl.envs.conventions import OSC_POSE_DELTA, SIGNED_CLOSE_POSITIVE, ActionConvention
from embodirl.envs.libero import paths as libero_paths
from embodirl.envs.libero import pro
from embodirl.envs.libero import states as libero_states
from embodirl.envs.libero.patches import (
    EEF_POS,
    EEF_QUAT,
    GRIPPER_QPOS,
    Scene,
    bad_state_warnings,
    build_scene,
    global_numpy_seed,
)
from embodirl.envs.libero.suite import SUITE_NUM_TASKS, eval_schedule, suite_info, task_pool
from embodirl.envs.registry import register_adapter
from embodirl.errors import ConfigError

log = logging.getLogger(__name__)

# config camera name -> robosuite camera; LIBERO's scenes all define these (the slow test checks)
CAMERAS = {
    "agentview": "agentview",
    "wrist": "robot0_eye_in_hand",
    "robot0_eye_in_hand": "robot0_eye_in_hand",
    "frontview": "frontview",
    "birdview": "birdview",
    "sideview": "sideview",
}
ACTION_DIM = 7                  # OSC_POSE delta (6) + gripper (1)
STATE_DIM = 8                   # eef pos (3) + axis-angle (3) + gripper qpos (2)
LIBERO_GRIPPER_OPEN = -1.0
#: what LIBERO consumes: robosuite's OSC_POSE delta and its gripper (-1 open, +1 close; robosuite moves the fingers by
#: the command's sign)
ACTION_CONVENTION = ActionConvention(arm=OSC_POSE_DELTA, gripper=SIGNED_CLOSE_POSITIVE)
SETTLE_ACTION = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, LIBERO_GRIPPER_OPEN])   # OFT's dummy action
SUCCESS_REWARD = 1.0
SCENE_SEED = 20_231_031         # numpy's global RNG is seeded from (SCENE_SEED, task, init state)
#: scene_seeding: per_start (the seed above) | oft (OFT's get_libero_env: env.seed(0), i.e. np.random.seed(0),
#: once per task, then the trials' resets in init-state order)
SCENE_SEEDINGS = ("per_start", "oft")
OFT_TASK_SEED = 0
#: numpy's legacy global RNG state (np.random.get_state / set_state)
_NumpyRandomState = dict[str, Any] | tuple[str, np.ndarray, int, int, float]


class SimulationUnstable(RuntimeError):
    """The MuJoCo state became non-finite or invalid; the episode cannot continue."""


# --------------------------------------------------------------------------------------------------
# protocol pieces (pure functions)
# --------------------------------------------------------------------------------------------------
def quat_to_axis_angle(quat: np.ndarray) -> np.ndarray:
    """Quaternion ``[4]`` (x, y, z, w; robosuite's order) -> axis-angle ``[3]``, as OFT's ``quat2axisangle``:
    ``w`` clipped to [-1, 1], angle ``2*acos(w)`` in [0, 2*pi], zero vector when ``sqrt(1 - w^2) == 0``."""
    quat = np.asarray(quat, np.float64)
    w = min(max(float(quat[3]), -1.0), 1.0)
    den = math.sqrt(1.0 - w * w)
    if den == 0.0:
        return np.zeros(3)
    return quat[:3] * 2.0 * math.acos(w) / den


def proprio_state(raw_obs: Mapping[str, np.ndarray]) -> np.ndarray:
    """robosuite observation dict -> OFT's 8-D state float32 ``[8]``."""
    return np.concatenate([raw_obs[EEF_POS], quat_to_axis_angle(raw_obs[EEF_QUAT]),
                           raw_obs[GRIPPER_QPOS]]).astype(np.float32)


def flip_image(image_hwc: np.ndarray) -> np.ndarray:
    """robosuite camera image ``[h, w, 3]`` -> rotated by 180 degrees, channels first ``[3, h, w]``."""
    return np.ascontiguousarray(image_hwc[::-1, ::-1].transpose(2, 0, 1))


def scene_seed(task_id: int, init_state_id: int) -> int:
    """numpy global seed (uint32) for the fixture placement of ``(task_id, init_state_id)``."""
    return int(np.random.SeedSequence([SCENE_SEED, task_id, init_state_id]).generate_state(1)[0])


# --------------------------------------------------------------------------------------------------
# one simulator
# --------------------------------------------------------------------------------------------------
class LiberoSimEnv(SimEnv):
    """One LIBERO simulator serving the tasks of ``task_ids`` (see the module docstring).

    Scenes are built on the first reset into a task and kept (``max_cached_tasks`` of them, least
    recently used closed first: a scene holds about 0.6-1 GB with its renderer).

    Args:
        cfg: a LIBERO env split, the typed :class:`LiberoEnvConfig` (or a mapping of it, converted once).
        seed: seeds the choice of task / init state when :meth:`reset` is not told them.
    """

    def __init__(self, cfg, seed: int = 0):
        runtime.configure()                     # before robosuite / mujoco are imported
        env = LiberoAdapter.check_config(cfg)
        self.cfg = env
        self.suite = suite_info(env)
        if set(self.suite.groups) - set(SUITE_NUM_TASKS):
            pro.register_objects()              # LIBERO-PRO's object variants, before a perturbed scene is built
        self.task_ids = task_pool(env)
        self.camera_names = list(env.cameras)
        self._rs_cameras = [CAMERAS[c] for c in self.camera_names]
        self.image_size = (env.image_size[0], env.image_size[1])    # (h, w)
        self.max_episode_steps = env.max_episode_steps
        self.num_settle_steps = env.num_settle_steps
        self.stop_on_success = not env.ignore_terminations
        self.max_cached_tasks = env.max_cached_tasks
        self.fixed_starts = env.use_fixed_reset_state_ids
        self.scene_seeding = env.scene_seeding
        #: scene_seeding oft: task -> (trials whose resets have drawn, numpy RNG state after them)
        self._oft_rng: dict[int, tuple[int, _NumpyRandomState]] = {}
        self._init_pool = env.init_state_ids
        self.starts = libero_states.StartStates(env, self.suite)    # what an init state id names
        self.spec = EnvSpec(
            action_dim=ACTION_DIM, max_episode_steps=self.max_episode_steps,
            task_descriptions=list(self.suite.descriptions), camera_names=list(self.camera_names),
            image_size=self.image_size if self.camera_names else None, state_dim=STATE_DIM,
            num_init_states=[len(self.starts.training_ids(t)) for t in range(len(self.suite.descriptions))],
            first_init_state=self.starts.first_training_id, task_groups=list(self.suite.groups),
            action_low=[-1.0] * ACTION_DIM, action_high=[1.0] * ACTION_DIM, name=self.suite.name)
        self.rng = np.random.default_rng(seed)
        self._scenes: OrderedDict[int, Scene] = OrderedDict()
        self.task_id: int | None = None
        self.init_state_id: int | None = None
        self.elapsed = 0                       # policy steps of the current episode
        self.last_raw_obs: dict | None = None  # robosuite's observation dict of the last step (debugging)
        self._obs: dict[str, np.ndarray] | None = None
        self._warnings_at_reset = 0

    # -- scenes ----------------------------------------------------------------------------------
    @property
    def libero_env(self):
        """The ``OffScreenRenderEnv`` of the current task (None before the first reset)."""
        return self._scenes[self.task_id].env if self.task_id in self._scenes else None

    def _scene(self, task_id: int) -> Scene:
        if task_id in self._scenes:
            self._scenes.move_to_end(task_id)
            return self._scenes[task_id]
        while len(self._scenes) >= self.max_cached_tasks:
            _, old = self._scenes.popitem(last=False)
            old.env.close()
        start = time.perf_counter()
        scene = self._scenes[task_id] = build_scene(str(self.suite.bddl_files[task_id]), self._rs_cameras,
                                                    self.image_size)
        log.info("built LIBERO %s task %d in %.1f s", self.suite.name, task_id, time.perf_counter() - start)
        return scene

    # -- SimEnv ----------------------------------------------------------------------------------
    def reset(self, task_id: int | None = None, init_state_id: int | None = None,
              seed: int | None = None) -> dict[str, np.ndarray]:
        """Start an episode of ``task_id`` from init state ``init_state_id`` and return its first
        observation (after the settle steps). Unset ids are drawn with the env's RNG (``seed`` re-seeds
        it) from ``task_ids`` / ``init_state_ids`` (unset: the task's training states); with
        ``use_fixed_reset_state_ids`` an unseeded reset without ids (an auto-reset) repeats the previous
        episode's start, so a GRPO group keeps sharing its init state."""
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        elif self.fixed_starts and task_id is None and init_state_id is None and self.task_id is not None:
            task_id, init_state_id = self.task_id, self.init_state_id
        if task_id is None:
            task_id = self.task_ids[int(self.rng.integers(len(self.task_ids)))]
        task_id = int(task_id)
        if not 0 <= task_id < len(self.suite.descriptions):
            raise ValueError(f"{self.suite.name} has tasks 0..{len(self.suite.descriptions) - 1}, not {task_id}")
        if init_state_id is None:
            pool = self._init_pool if self._init_pool is not None else self.starts.training_ids(task_id)
            init_state_id = int(pool[int(self.rng.integers(len(pool)))])
        init_state_id = int(init_state_id)
        init_state = self.starts.state(task_id, init_state_id)      # ValueError naming the valid ids
        scene = self._scene(task_id)
        env, gate = scene.env, scene.gate
        self.task_id, self.init_state_id = task_id, init_state_id
        if gate is not None:
            gate.open = False                           # the reset's own forced render is wasted
            gate.keep_snapshot = False
        if self.scene_seeding == "oft" and init_state_id < TRAIN_INIT_STATE_BASE:   # OFT's order: its trials only
            self._oft_reset(env, task_id, init_state_id)
        else:
            with global_numpy_seed(scene_seed(task_id, init_state_id)):   # fixture placement (module docstring)
                env.reset()
        scene.clear_gripper_commands()              # a hard reset would re-create the gripper model
        scene.attach_controllers()
        if gate is not None:
            gate.open = self.num_settle_steps == 0      # without settle steps this is the first observation
        raw = env.set_init_state(init_state)
        self._warnings_at_reset = self._bad_state_warnings()
        with scene.stepping():
            for k in range(self.num_settle_steps):
                if gate is not None:
                    gate.open = k == self.num_settle_steps - 1
                raw, _, _, _ = env.step(SETTLE_ACTION)
        self._check_stable()
        self.elapsed = 0
        self._obs = self._observation(raw)
        return self._obs

    def _oft_reset(self, env, task_id: int, trial: int) -> None:
        """``env.reset()`` drawing fixture placements as OFT's trial ``trial`` of ``task_id`` does (module
        docstring): from the task's RNG state, after replaying the resets of earlier trials not run here."""
        done, state = self._oft_rng.get(task_id, (0, None))
        if state is None or trial < done:
            done, state = 0, np.random.RandomState(OFT_TASK_SEED).get_state()   # = np.random.seed(0)
        caller = np.random.get_state()
        np.random.set_state(state)
        try:
            for _ in range(trial - done):
                env.reset()
            env.reset()
            self._oft_rng[task_id] = (trial + 1, np.random.get_state())
        finally:
            np.random.set_state(caller)

    def step_chunk(self, actions: np.ndarray, render_all: bool = False) -> ChunkResult:
        """Execute ``actions`` ``[H, 7]`` (policy convention, see module docstring). Stops after the step
        that solves the task (unless ``ignore_terminations``) or reaches ``max_episode_steps``."""
        if self.task_id is None:
            raise RuntimeError("LiberoSimEnv.step_chunk() before reset()")
        actions = np.asarray(actions, np.float64)
        if actions.ndim != 2 or actions.shape[1] != ACTION_DIM:
            raise ValueError(f"LIBERO actions must have shape [H, {ACTION_DIM}], got {list(actions.shape)}")
        if not np.all(np.isfinite(actions)):
            raise ValueError("LIBERO actions contain non-finite values")
        budget = self.max_episode_steps - self.elapsed
        if budget <= 0:
            raise RuntimeError(f"the episode already ran its {self.max_episode_steps} steps; reset() first")
        todo = actions[:budget]                                               # (h <= H, 7)
        scene = self._scene(self.task_id)
        env, gate = scene.env, scene.gate
        rewards: list[float] = []
        frames: list[np.ndarray] = []
        success_any = False
        raw = None
        if gate is not None:
            gate.keep_snapshot = self.stop_on_success and not render_all
            gate.forget_snapshot()
        with scene.stepping():
            for k, action in enumerate(todo):
                last = k == len(todo) - 1
                if gate is not None:
                    gate.open = render_all or last
                raw, _, done, _ = env.step(np.array(action, np.float64))      # LIBERO's own action (7,)
                self._check_stable()
                success = bool(done)
                rewards.append(SUCCESS_REWARD if success else 0.0)
                if render_all and gate is not None:
                    frames.append(self._images(raw))
                success_any |= success
                if success and self.stop_on_success:
                    break
        steps = len(rewards)
        self.elapsed += steps
        images = None
        if gate is not None and not gate.open and gate.has_snapshot:
            # cut short by success: render what the cameras would have sampled in that step
            images = self._images_from(gate.render_snapshot())
        assert raw is not None, "an empty action chunk"    # at least one step ran
        self._obs = self._observation(raw, images)
        terminated = success_any
        truncated = self.elapsed >= self.max_episode_steps and not terminated
        return ChunkResult(obs=self._obs, rewards=np.asarray(rewards, np.float32), terminated=terminated,
                           truncated=truncated, success=success_any, steps=steps,
                           frames=np.stack(frames) if frames else None)

    def render_frame(self) -> np.ndarray | None:
        """The first camera's image of the latest observation, ``[h, w, 3]`` uint8."""
        if self._obs is None or "images" not in self._obs:
            return None
        return np.ascontiguousarray(self._obs["images"][0].transpose(1, 2, 0))

    def close(self) -> None:
        while self._scenes:
            _, scene = self._scenes.popitem()
            scene.env.close()

    # -- internals -------------------------------------------------------------------------------
    def _images(self, raw: Mapping[str, np.ndarray]) -> np.ndarray:
        """Camera images of a robosuite observation -> uint8 ``[V, 3, h, w]``, rotated by 180 degrees."""
        return np.stack([flip_image(raw[f"{cam}_image"]) for cam in self._rs_cameras])

    def _images_from(self, rendered: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.stack([flip_image(rendered[f"{cam}_image"]) for cam in self._rs_cameras])   # (V, 3, h, w)

    def _observation(self, raw: Mapping[str, np.ndarray], images: np.ndarray | None = None) -> dict[str, np.ndarray]:
        self.last_raw_obs = dict(raw)
        obs = {"task_id": np.array(self.task_id, np.int64), "state": proprio_state(raw)}   # state (8,)
        if self._rs_cameras:
            obs["images"] = images if images is not None else self._images(raw)          # (V, 3, h, w)
        return obs

    def _bad_state_warnings(self) -> int:
        return bad_state_warnings(self.libero_env.env.sim)

    def _check_stable(self) -> None:
        # MuJoCo resets the data (and counts a warning) when qpos/qvel/qacc go bad, so a blown-up
        # simulation may look finite afterwards: check both the state and the warning counters.
        data = self.libero_env.env.sim.data
        if not (np.all(np.isfinite(data.qpos)) and np.all(np.isfinite(data.qvel))):
            raise SimulationUnstable(f"LIBERO {self.suite.name} task {self.task_id}: non-finite MuJoCo state")
        if self._bad_state_warnings() > self._warnings_at_reset:
            raise SimulationUnstable(f"LIBERO {self.suite.name} task {self.task_id}: MuJoCo reported a bad "
                                     "qpos/qvel/qacc and reset its data")


# --------------------------------------------------------------------------------------------------
# adapter
# --------------------------------------------------------------------------------------------------
def _make_sim_env(env: LiberoEnvConfig, seed: int) -> LiberoSimEnv:
    return LiberoSimEnv(env, seed=seed)


@dataclass
class LiberoEnvConfig(CommonEnvConfig):
    """``adapter: libero`` (config/env/_libero_base.yaml): the types of its keys; the adapter registers it as its
    config class, and the simulators run on an instance of it (:meth:`LiberoAdapter.check_config`)."""

    suite: str = required()
    task_ids: list[int] | None = required()
    num_settle_steps: int = num(0)
    cameras: list[str] = required()
    image_size: list[int] = required()
    assets_path: str | None = required()
    max_cached_tasks: int = num(1)
    scene_seeding: str = required()
    perturbations: list[str] | None = required()
    train_init_states: str = required()     # heldout | official | <path>.npz (embodirl/envs/libero/states.py)
    num_init_states: int = num(1)           # heldout: states sampled per task
    init_states_seed: int = num(0)          # heldout: the sampler's seed
    training_state_keys: ClassVar[tuple[str, ...]] = ("train_init_states", "num_init_states", "init_states_seed")

    @property
    def task_subset(self) -> list[int] | None:
        return self.task_ids

    @property
    def statistics_key(self) -> str:
        """OpenVLA-OFT keeps a LIBERO checkpoint's action statistics under the suite's name."""
        return self.suite


@register_adapter("libero", config=LiberoEnvConfig)
class LiberoAdapter:
    """``adapter: libero``: one :class:`LiberoSimEnv` per sub-process of a ProcessVectorEnv."""

    @staticmethod
    def check_config(cfg) -> LiberoEnvConfig:
        """The env split as the typed :class:`LiberoEnvConfig` (a mapping is converted once: types, ranges and
        choices), with the cheap checks that need LIBERO's tables run before any worker starts; one-sentence
        ConfigError / AssetsMissing."""
        env = instance(LiberoEnvConfig, cfg, "env")
        suite = env.suite
        if suite not in SUITE_NUM_TASKS:
            raise ConfigError("suite", f"unknown LIBERO suite '{suite}'; available: {', '.join(SUITE_NUM_TASKS)}")
        num_tasks = SUITE_NUM_TASKS[suite]
        perturbations = env.perturbations
        if perturbations is not None:
            entries = (pro.ORIGINAL, *pro.FAMILIES)
            unknown = [p for p in perturbations if p not in entries]
            if unknown or not perturbations or len(set(perturbations)) != len(perturbations):
                raise ConfigError("perturbations", f"must be null or a list of distinct entries of {', '.join(entries)} "
                                                   f"({pro.ORIGINAL}: the suite unperturbed), got {list(perturbations)}")
            if set(perturbations) - {pro.ORIGINAL} and suite not in pro.BASE_SUITES:
                raise ConfigError("perturbations", f"LIBERO-PRO perturbs {', '.join(pro.BASE_SUITES)}, not {suite}")
        task_ids = env.task_ids
        if task_ids is not None:
            bad = [t for t in task_ids if not 0 <= t < num_tasks]
            if bad or not task_ids:
                raise ConfigError("task_ids", f"{suite} has task ids 0..{num_tasks - 1} (null for all), got "
                                              f"{list(task_ids)}")
        unknown = [c for c in env.cameras if c not in CAMERAS]
        if unknown:
            raise ConfigError("cameras", f"unknown LIBERO camera(s) {unknown}; available: {', '.join(CAMERAS)}")
        size = env.image_size
        if len(size) != 2 or min(size) < 1:
            raise ConfigError("image_size", f"must be [height, width] with positive sizes, got {size}")
        if env.scene_seeding not in SCENE_SEEDINGS:
            raise ConfigError("scene_seeding", f"must be one of {', '.join(SCENE_SEEDINGS)}, got "
                                               f"{env.scene_seeding!r}")
        info = suite_info(env)                      # AssetsMissing when the asset folder is absent
        libero_states.check_config(env, info)       # train_init_states
        counts = {info.num_init_states[t] for t in task_pool(env)}
        limit = min(counts)
        init_ids = env.init_state_ids
        if init_ids is not None:
            training = min((libero_states.training_ids(env, info, t) for t in task_pool(env)), key=len)
            bad = [i for i in init_ids if not (0 <= i < limit or i in training)]
            if bad or not init_ids:
                also = f" and training states {training.start}..{training.stop - 1}" if training.start and len(training) else ""
                raise ConfigError("init_state_ids", f"{suite} tasks have init states 0..{limit - 1}{also}, got "
                                                    f"{list(init_ids)}")
        elif env.num_trials_per_task > limit:
            raise ConfigError("num_trials_per_task", f"{suite} tasks have {limit} init states, so at most {limit} "
                                                     f"trials per task, got {env.num_trials_per_task}")
        return env

    @staticmethod
    def eval_schedule(cfg) -> list[tuple[int, int]]:
        """Ordered ``(task_id, init_state_id)`` pairs of an evaluation sweep (see :func:`eval_schedule`)."""
        return eval_schedule(instance(LiberoEnvConfig, cfg, "env"))

    @staticmethod
    def action_convention(cfg) -> ActionConvention:
        """LIBERO's own actions, whatever the suite (:data:`ACTION_CONVENTION`)."""
        return ACTION_CONVENTION

    @staticmethod
    def training_states(train_cfg, eval_cfg) -> TrainingStates:
        """Where ``train_cfg``'s episodes start beside ``eval_cfg``'s sweep (:func:`.states.training_states`)."""
        return libero_states.training_states(instance(LiberoEnvConfig, train_cfg, "env.train"),
                                             instance(LiberoEnvConfig, eval_cfg, "env.eval"))

    @classmethod
    def make(cls, cfg, *, num_envs: int, seed: int, env_offset: int = 0):
        """``num_envs`` LIBERO simulators, one process each, as a ProcessVectorEnv."""
        from embodirl.envs.vector.vector_env import ProcessVectorEnv

        env = cls.check_config(cfg)
        # sub-processes resolve the asset folder themselves: pass on the one found here
        env = dataclasses.replace(env, assets_path=str(libero_paths.resolve_assets_dir(env.assets_path)))
        factories = [functools.partial(_make_sim_env, env, seed + env_offset + i) for i in range(num_envs)]
        return ProcessVectorEnv.from_config(factories, env, env_offset=env_offset)


