"""Patches to robosuite 1.4 / LIBERO internals that make :mod:`embodirl.envs.libero.simulator`'s episodes cheaper
without changing an observation (a test drives a stock ``OffScreenRenderEnv`` the OFT way next to the
adapter and compares bit for bit). The protocol itself lives in :mod:`embodirl.envs.libero.simulator`.

* **Render at decisions only.** Within an action chunk the H-1 intermediate steps run physics only:
  robosuite's camera sensors are gated (they return a blank image while closed) and only the chunk's
  last step renders, unless ``render_all`` (video). robosuite samples all observables at one substep
  of every control step whose phase depends on the reset history, so the gate swaps the sensors'
  output, never their timing; the image at the chunk's end is bit-identical to rendering every step.
  A chunk cut short by success renders the terminal image from a copy of the simulator taken at that
  step's sampling substep (``mj_copyData``), so early ends are bit-identical too.
* **Cheap reset.** LIBERO's default hard reset rebuilds the MuJoCo model and the renderer (seconds).
  Here the env is built with ``hard_reset=False`` and kept per task: a reset is robosuite's soft reset
  (``sim.reset()`` and the usual re-initialisation) plus zeroing the gripper's accumulated command
  (``gripper.current_action``, which a hard reset re-creates and a soft one would keep), then
  ``set_init_state`` - the resulting episode equals a hard reset's step for step.
* **No throwaway renders at build.** robosuite calls every observable's sensor once when it creates it, to learn
  the shape of its data; for a camera that is a full render whose image is discarded (one per camera per scene
  built, 0.1-0.15 CPU-s each on the software renderer). The camera sensors' shape is known, ``(h, w, 3)``: it is set without
  the render (:func:`camera_shapes_without_rendering`); the other sensors are checked as robosuite does.
* **No repeated forward pass.** Within ``env.step`` robosuite runs MuJoCo's forward pass before the
  controller, and the OSC controller runs it again on the same state; the controllers get a ``sim``
  whose ``forward`` is skipped during steps (about a third less physics time per step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# robosuite observables the adapter reads; the others (object poses) are switched off to save time
EEF_POS, EEF_QUAT, GRIPPER_QPOS = "robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos"
PROPRIO_OBSERVABLES = (EEF_POS, EEF_QUAT, GRIPPER_QPOS)


@contextlib.contextmanager
def global_numpy_seed(seed: int):
    """LIBERO's samplers draw from numpy's global RNG: seed it for the block, then put the caller's back."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


class CameraGate:
    """Wraps a robosuite env's camera sensors so that they render only while ``open``.

    Closed, a sensor returns a blank image of the right shape; robosuite's observable timing is
    untouched. With ``keep_snapshot`` a closed gate also copies the simulator data (and the site colours
    LIBERO toggles) at the sampling substep, so that :meth:`render_snapshot` can later produce exactly
    the images the sensors would have returned then.
    """

    def __init__(self, env, camera_names: Sequence[str]):
        import mujoco

        self._mujoco = mujoco
        self.env = env                              # robosuite env (LIBERO problem class)
        self.names = [f"{cam}_image" for cam in camera_names]
        self.open = True
        self.keep_snapshot = False
        self._real: dict[str, Callable[[dict], np.ndarray]] = {}     # observable -> robosuite's own sensor
        self._blank: dict[str, np.ndarray] = {}
        self._snapshot: Any = None                  # mujoco.MjData
        self._backup: Any = None                    # mujoco.MjData
        self._snapshot_time: float | None = None
        self._snapshot_rgba: np.ndarray | None = None
        self.install()

    def install(self) -> None:
        """Wrap the camera observables' sensors."""
        for name in self.names:
            observable = self.env._observables[name]
            real = observable._sensor
            self._real[name] = real
            self._blank[name] = np.zeros(observable._data_shape, np.uint8)           # (h, w, 3)

            def gated(obs_cache, _name=name, _real=real):
                if self.open:
                    self.make_current()
                    return _real(obs_cache)
                if self.keep_snapshot:
                    self._take_snapshot()
                return self._blank[_name]

            # robosuite's Observable reads the sensor function's __modality__ (vars(): mypy does not model
            # attributes set on a function)
            vars(gated)["__modality__"] = real.__modality__
            # set directly: Observable.set_sensor would call (and so render) the sensor once
            observable._sensor = gated

    def make_current(self) -> None:
        """Make this scene's GL context current before it renders.

        robosuite 1.4 makes a context current only when it is created, and rendering uses whatever
        context is current in the thread. With several scenes in one process (the task cache), or after
        another robosuite env closed its context, a render would otherwise draw with a foreign or freed
        context: black or wrong images.
        """
        context = getattr(self.env.sim, "_render_context_offscreen", None)
        if context is not None:
            context.gl_ctx.make_current()

    def _take_snapshot(self) -> None:
        sim = self.env.sim
        data = sim.data._data
        if self._snapshot_time == data.time:        # cameras sample at the same substep: copy once
            return
        model = sim.model._model
        if self._snapshot is None:
            self._snapshot = self._mujoco.MjData(model)
        self._mujoco.mj_copyData(self._snapshot, model, data)
        self._snapshot_rgba = np.array(sim.model.site_rgba)
        self._snapshot_time = data.time

    def forget_snapshot(self) -> None:
        self._snapshot_time = None

    @property
    def has_snapshot(self) -> bool:
        return self._snapshot_time is not None

    def render_snapshot(self) -> dict[str, np.ndarray]:
        """Camera images ``{observable: [h, w, 3]}`` of the last snapshot; the simulator is left as it was."""
        if not self.has_snapshot:
            raise RuntimeError("no camera snapshot to render")
        mujoco, sim = self._mujoco, self.env.sim
        model, data = sim.model._model, sim.data._data
        if self._backup is None:
            self._backup = mujoco.MjData(model)
        mujoco.mj_copyData(self._backup, model, data)
        rgba = np.array(sim.model.site_rgba)
        try:
            mujoco.mj_copyData(data, model, self._snapshot)
            sim.model.site_rgba[:] = self._snapshot_rgba
            self.make_current()
            return {name: np.asarray(self._real[name]({})) for name in self.names}
        finally:
            mujoco.mj_copyData(data, model, self._backup)
            sim.model.site_rgba[:] = rgba


class ControllerSim:
    """What a robosuite controller sees as its ``sim``: the real one, except that ``forward()`` is
    skipped while ``in_step``. Inside ``env.step`` robosuite calls ``sim.forward()`` right before
    ``_pre_action``, whose controller update calls it again on the same state; MuJoCo's forward pass is
    a pure function of the state, so the second call only costs time (about a third of a physics step).
    Outside steps (controller construction at reset) every call goes through."""

    def __init__(self, sim):
        self._sim = sim
        self.in_step = False

    def forward(self) -> None:
        if not self.in_step:
            self._sim.forward()

    def __getattr__(self, name: str):
        return getattr(self._sim, name)


@dataclass
class Scene:
    """One task's built simulator and the adapter's hooks into it."""

    env: Any                           # libero OffScreenRenderEnv (untyped)
    gate: CameraGate | None           # None without cameras
    controller_sim: ControllerSim

    @contextlib.contextmanager
    def stepping(self):
        """Around ``env.step`` calls: controllers skip their redundant forward pass (:class:`ControllerSim`)."""
        self.controller_sim.in_step = True
        try:
            yield
        finally:
            self.controller_sim.in_step = False

    def attach_controllers(self) -> None:
        """robosuite builds new controllers on every reset: give them the skipping sim."""
        for robot in self.env.env.robots:
            robot.controller.sim = self.controller_sim

    def clear_gripper_commands(self) -> None:
        """Zero the grippers' accumulated command, which a hard reset re-creates and a soft one keeps."""
        for robot in self.env.env.robots:
            robot.gripper.current_action = np.zeros(robot.gripper.dof)


@contextlib.contextmanager
def camera_shapes_without_rendering(rs_cameras: Sequence[str], image_size: tuple[int, int]):
    """While robosuite builds an env: its camera observables ``<camera>_image`` of ``rs_cameras`` take their data
    shape ``(h, w, 3)`` (what robosuite's camera sensor returns without depth) instead of rendering once to learn it;
    every other observable is checked by robosuite's own ``_check_sensor_validity``."""
    from robosuite.utils.observables import Observable

    names = {f"{cam}_image" for cam in rs_cameras}
    shape = (*image_size, 3)
    check = Observable._check_sensor_validity

    def shape_of_cameras(observable) -> None:
        if observable.name not in names:
            check(observable)
            return
        _ = observable.modality                  # what robosuite asserts of a sensor besides its output
        observable._data_shape, observable._is_number = shape, False

    Observable._check_sensor_validity = shape_of_cameras
    try:
        yield
    finally:
        Observable._check_sensor_validity = check


def build_scene(bddl_file: str, rs_cameras: Sequence[str], image_size: tuple[int, int]) -> Scene:
    """One task's ``OffScreenRenderEnv`` built for cheap resets (``hard_reset=False``), with the object-pose
    sensors switched off, gated cameras and the controllers' forward-skipping sim."""
    from libero.libero.envs import OffScreenRenderEnv

    h, w = image_size
    with camera_shapes_without_rendering(rs_cameras, (h, w)):
        env = OffScreenRenderEnv(
            bddl_file_name=bddl_file, camera_names=list(rs_cameras), use_camera_obs=bool(rs_cameras),
            camera_heights=h, camera_widths=w,
            hard_reset=False, ignore_done=True)   # episode limits are ours; robosuite's horizon would raise
    inner = env.env
    for name, observable in inner._observables.items():
        if name not in PROPRIO_OBSERVABLES and not name.endswith("_image"):
            observable.set_enabled(False)      # object-pose sensors: unused, they cost time every step
    gate = CameraGate(inner, rs_cameras) if rs_cameras else None
    return Scene(env, gate, ControllerSim(inner.sim))


def bad_state_warnings(sim) -> int:
    """MuJoCo's count of bad qpos/qvel/qacc warnings (after each, MuJoCo silently resets the data)."""
    import mujoco

    data = sim.data._data
    return sum(int(data.warning[w].number) for w in (mujoco.mjtWarning.mjWARN_BADQPOS,
                                                      mujoco.mjtWarning.mjWARN_BADQVEL,
                                                      mujoco.mjtWarning.mjWARN_BADQACC))
