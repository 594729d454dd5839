"""LIBERO adapter on the real simulator (robosuite 1.4 + MuJoCo, the configured asset folder).

Fast tests share one libero_object scene; the slow tests build every task of the four 10-task suites
and a sample of libero_90 (one after another in the test's own process), run the adapter through
ProcessVectorEnv, and solve a drawer task by setting its joint.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from omegaconf import OmegaConf
from scipy.spatial.transform import Rotation

from embodirl.envs.libero import paths as libero_paths
from embodirl.envs.libero.simulator import (
    CAMERAS,
    LiberoAdapter,
    LiberoSimEnv,
    SimulationUnstable,
    quat_to_axis_angle,
    scene_seed,
)
from embodirl.envs.libero.suite import SUITE_NUM_TASKS, eval_schedule
from embodirl.errors import AssetsMissing, ConfigError

IMAGE_SIZE = [128, 128]
CHUNK = 8
SOUP_TASK = 0               # libero_object task 0: "pick up the alphabet soup and place it in the basket"
DROP_HEIGHT = 0.2           # the soup dropped from this height above the basket lands inside after a few steps


def libero_cfg(suite: str = "libero_object", **overrides) -> dict:
    """A LIBERO env config composed from the YAML tree, with ``overrides`` applied."""
    from embodirl.config import compose

    cfg = OmegaConf.to_container(compose([f"env={suite}"]).env.train, resolve=True)
    cfg.update(overrides)
    return cfg


def random_chunks(seed: int, num_chunks: int) -> np.ndarray:
    """LIBERO-convention chunks ``[num_chunks, H, 7]``: small deltas, gripper +1 / -1 (close / open)."""
    rng = np.random.default_rng(seed)
    chunks = rng.uniform(-0.6, 0.6, size=(num_chunks, CHUNK, 7))
    chunks[..., -1] = rng.choice([1.0, -1.0], size=(num_chunks, CHUNK))
    return chunks


def noop_chunk() -> np.ndarray:
    chunk = np.zeros((CHUNK, 7))
    chunk[:, -1] = -1.0                                           # gripper open (LIBERO's -1)
    return chunk


def direct_proprio(env: LiberoSimEnv) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """End-effector position, rotation matrix and finger positions read straight from MuJoCo."""
    inner = env.libero_env.env
    robot = inner.robots[0]
    data = inner.sim.data
    pos = np.array(data.site_xpos[robot.eef_site_id])
    body = inner.sim.model.body_name2id(robot.robot_model.eef_name)
    rot = np.array(data.body_xmat[body]).reshape(3, 3)
    fingers = np.array(data.qpos[robot._ref_gripper_joint_pos_indexes])
    return pos, rot, fingers


def check_proprio_matches_sim(env: LiberoSimEnv, state: np.ndarray) -> None:
    pos, rot, fingers = direct_proprio(env)
    assert state.shape == (8,) and state.dtype == np.float32
    np.testing.assert_array_equal(state[:3], pos.astype(np.float32))
    np.testing.assert_allclose(Rotation.from_rotvec(state[3:6].astype(np.float64)).as_matrix(), rot, atol=1e-5)
    np.testing.assert_array_equal(state[6:], fingers.astype(np.float32))


def check_images_are_rotated_renders(env: LiberoSimEnv, images: np.ndarray) -> None:
    """``images`` [V, 3, h, w] equal the cameras' raw renders of the current state rotated by 180 degrees."""
    sim = env.libero_env.env.sim
    h, w = env.image_size
    for image, name in zip(images, env.camera_names):
        raw = sim.render(camera_name=CAMERAS[name], width=w, height=h)           # (h, w, 3) OpenGL rows
        assert image.shape == (3, h, w) and image.dtype == np.uint8
        np.testing.assert_array_equal(image, raw[::-1, ::-1].transpose(2, 0, 1))
        assert not np.array_equal(image, raw.transpose(2, 0, 1))                   # the rotation matters
        assert image.std() > 5.0                                                   # a real picture


def drop_soup_into_basket(env: LiberoSimEnv) -> None:
    """Teleport the alphabet soup (free joint) above the basket, at rest."""
    inner = env.libero_env.env
    basket = np.array(inner.sim.data.body_xpos[inner.obj_body_id["basket_1"]])
    joint = inner.get_object("alphabet_soup_1").joints[-1]
    inner.sim.data.set_joint_qpos(joint, np.concatenate([basket + [0.0, 0.0, DROP_HEIGHT], [1.0, 0.0, 0.0, 0.0]]))
    inner.sim.data.set_joint_qvel(joint, np.zeros(6))
    inner.sim.forward()


@pytest.fixture(scope="module")
def object_env():
    env = LiberoSimEnv(libero_cfg(image_size=IMAGE_SIZE), seed=0)
    yield env
    env.close()


# --------------------------------------------------------------------------------------------------
# configuration and protocol (no simulator)
# --------------------------------------------------------------------------------------------------
def test_check_config_names_the_choices():
    cfg = libero_cfg()
    LiberoAdapter.check_config(cfg)
    with pytest.raises(ConfigError, match="libero_spatial, libero_object, libero_goal, libero_10, libero_90"):
        LiberoAdapter.check_config({**cfg, "suite": "libero_100"})
    with pytest.raises(ConfigError, match=r"task_ids: libero_object has task ids 0\.\.9"):
        LiberoAdapter.check_config({**cfg, "task_ids": [3, 10]})
    with pytest.raises(ConfigError, match="unknown LIBERO camera.*'top'.*available: agentview, wrist"):
        LiberoAdapter.check_config({**cfg, "cameras": ["agentview", "top"]})
    with pytest.raises(ConfigError, match=r"init_state_ids: .*init states 0\.\.49"):
        LiberoAdapter.check_config({**cfg, "init_state_ids": [0, 50]})
    with pytest.raises(ConfigError, match="num_trials_per_task"):
        LiberoAdapter.check_config({**cfg, "num_trials_per_task": 51})
    with pytest.raises(ConfigError, match="reward_type"):
        LiberoAdapter.check_config({**cfg, "reward_type": "episode_level"})


def test_check_config_reports_missing_assets(tmp_path, monkeypatch):
    monkeypatch.delenv(libero_paths.ASSETS_ENV_VAR, raising=False)
    cfg = libero_cfg(assets_path=str(tmp_path / "nowhere"))
    with pytest.raises(AssetsMissing) as err:
        LiberoAdapter.check_config(cfg)
    message = str(err.value)
    assert "nowhere" in message and libero_paths.ASSETS_ENV_VAR in message
    assert message.count(". ") == 0 and message.endswith(".")              # one sentence


def test_check_config_through_the_composed_config(compose_cfg):
    from embodirl.envs.registry import check_env_config

    cfg = compose_cfg("env=libero_10", "env.train.task_ids=[0,9]")
    check_env_config(cfg.env.train)
    with pytest.raises(ConfigError, match="task_ids"):
        check_env_config(compose_cfg("env=libero_10", "env.train.task_ids=[12]").env.train)


def test_suite_facts_match_the_package():
    from embodirl.envs.libero.suite import suite_info

    libero_paths.prepare()
    from libero.libero.benchmark.libero_suite_task_map import libero_task_map

    for suite, num_tasks in SUITE_NUM_TASKS.items():
        assert len(libero_task_map[suite]) == num_tasks
        info = suite_info(LiberoAdapter.check_config(libero_cfg(suite)))
        assert len(info.descriptions) == len(info.bddl_files) == len(info.num_init_states) == num_tasks
        assert all(path.is_file() for path in info.bddl_files)
        assert min(info.num_init_states) >= 50
    assert suite_info(LiberoAdapter.check_config(libero_cfg("libero_object"))).descriptions[SOUP_TASK] == \
        "pick up the alphabet soup and place it in the basket"


def test_eval_schedule_is_task_major_and_trial_k_uses_init_state_k():
    cfg = libero_cfg("libero_spatial")
    schedule = eval_schedule(LiberoAdapter.check_config(cfg))
    assert len(schedule) == 10 * 50
    assert schedule[:3] == [(0, 0), (0, 1), (0, 2)] and schedule[50] == (1, 0) and schedule[-1] == (9, 49)
    assert LiberoAdapter.eval_schedule({**cfg, "task_ids": [7, 2], "num_trials_per_task": 2}) == \
        [(7, 0), (7, 1), (2, 0), (2, 1)]
    assert LiberoAdapter.eval_schedule({**cfg, "task_ids": [4], "init_state_ids": [9, 3]}) == [(4, 9), (4, 3)]


def test_axis_angle_matches_the_rotation():
    rng = np.random.default_rng(1)
    for quat in [*rng.normal(size=(50, 4)), [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, -1.0], [1.0, 0.0, 0.0, 0.0]]:
        quat = np.asarray(quat) / np.linalg.norm(quat)                       # (x, y, z, w)
        axis_angle = quat_to_axis_angle(quat)
        if abs(quat[3]) == 1.0:
            np.testing.assert_array_equal(axis_angle, np.zeros(3))
            continue
        np.testing.assert_allclose(Rotation.from_rotvec(axis_angle).as_matrix(),
                                   Rotation.from_quat(quat).as_matrix(), atol=1e-9)
        assert np.linalg.norm(axis_angle) == pytest.approx(2.0 * np.arccos(quat[3]))   # OFT's angle in [0, 2pi]


# --------------------------------------------------------------------------------------------------
# one real scene
# --------------------------------------------------------------------------------------------------
def test_spec_and_reset_observation(object_env):
    env = object_env
    spec = env.spec
    assert spec.action_dim == 7 and spec.state_dim == 8 and spec.max_episode_steps == 280
    assert spec.camera_names == ["agentview", "wrist"] and spec.image_size == tuple(IMAGE_SIZE)
    assert len(spec.task_descriptions) == 10 and spec.num_init_states == [50] * 10
    assert spec.action_low == [-1.0] * 7 and spec.action_high == [1.0] * 7     # LIBERO's own actions
    obs = env.reset(SOUP_TASK, 4)
    assert (env.task_id, env.init_state_id, env.elapsed) == (SOUP_TASK, 4, 0)
    assert set(obs) == {"images", "state", "task_id"}
    assert obs["images"].shape == (2, 3, *IMAGE_SIZE) and obs["images"].dtype == np.uint8
    assert obs["task_id"].dtype == np.int64 and int(obs["task_id"]) == SOUP_TASK
    raw = env.last_raw_obs
    np.testing.assert_array_equal(obs["images"][0], raw["agentview_image"][::-1, ::-1].transpose(2, 0, 1))
    np.testing.assert_array_equal(obs["images"][1], raw["robot0_eye_in_hand_image"][::-1, ::-1].transpose(2, 0, 1))
    expected = np.concatenate([raw["robot0_eef_pos"], quat_to_axis_angle(raw["robot0_eef_quat"]),
                               raw["robot0_gripper_qpos"]]).astype(np.float32)
    np.testing.assert_array_equal(obs["state"], expected)
    assert env.render_frame().shape == (*IMAGE_SIZE, 3)


def test_orientation_and_proprio_against_direct_mujoco_reads(object_env, monkeypatch):
    env = object_env
    monkeypatch.setattr(env, "num_settle_steps", 0)        # the first observation is of the current state
    obs = env.reset(SOUP_TASK, 2)
    check_images_are_rotated_renders(env, obs["images"])
    check_proprio_matches_sim(env, obs["state"])


def test_render_at_decision_is_bit_identical_to_rendering_every_step(object_env):
    env = object_env
    chunks = random_chunks(seed=3, num_chunks=3)
    env.reset(SOUP_TASK, 3)
    fast = [env.step_chunk(chunk) for chunk in chunks]
    env.reset(SOUP_TASK, 3)
    slow = [env.step_chunk(chunk, render_all=True) for chunk in chunks]
    for a, b in zip(fast, slow):
        assert a.steps == b.steps == CHUNK and a.frames is None
        assert b.frames.shape == (CHUNK, 2, 3, *IMAGE_SIZE)
        np.testing.assert_array_equal(a.obs["images"], b.obs["images"])
        np.testing.assert_array_equal(a.obs["images"], b.frames[-1])
        np.testing.assert_array_equal(a.obs["state"], b.obs["state"])
    # the robot moved: consecutive decisions differ
    assert not np.array_equal(fast[0].obs["images"], fast[-1].obs["images"])


def test_scripted_success_is_detected_and_noop_is_not(object_env):
    env = object_env
    env.reset(SOUP_TASK, 0)
    for _ in range(4):                                       # a no-op episode start does not solve the task
        result = env.step_chunk(noop_chunk())
        assert not result.success and not result.terminated and not result.truncated
        np.testing.assert_array_equal(result.rewards, np.zeros(CHUNK, np.float32))
    drop_soup_into_basket(env)
    result = env.step_chunk(noop_chunk())
    assert result.success and result.terminated and not result.truncated
    assert 1 < result.steps < CHUNK                          # cut short after the solving step
    np.testing.assert_array_equal(result.rewards, np.r_[np.zeros(result.steps - 1), 1.0].astype(np.float32))
    # the terminal observation of the cut chunk equals the one rendering every step gives
    env.reset(SOUP_TASK, 0)
    for _ in range(4):
        env.step_chunk(noop_chunk(), render_all=True)
    drop_soup_into_basket(env)
    reference = env.step_chunk(noop_chunk(), render_all=True)
    assert reference.steps == result.steps and reference.success
    np.testing.assert_array_equal(result.obs["images"], reference.obs["images"])
    np.testing.assert_array_equal(result.obs["images"], reference.frames[-1])
    np.testing.assert_array_equal(result.obs["state"], reference.obs["state"])


def test_terminal_render_leaves_the_simulation_untouched(object_env, monkeypatch):
    # rendering a cut chunk's terminal image from the snapshot must not perturb the physics: going on
    # after it gives what one uncut chunk (ignore_terminations) gives
    env = object_env
    runs = []
    for stop_on_success in (True, False):
        monkeypatch.setattr(env, "stop_on_success", stop_on_success)
        env.reset(SOUP_TASK, 1)
        env.step_chunk(noop_chunk())
        drop_soup_into_basket(env)
        first = env.step_chunk(noop_chunk())
        monkeypatch.setattr(env, "stop_on_success", False)
        rest = env.step_chunk(noop_chunk()[: CHUNK - first.steps]) if first.steps < CHUNK else None
        runs.append((first, rest))
    (cut, cont), (whole, _) = runs
    assert cut.steps < CHUNK and cut.steps + cont.steps == CHUNK
    assert whole.steps == CHUNK and whole.success and whole.terminated
    assert whole.rewards[cut.steps - 1] == 1.0
    np.testing.assert_array_equal(cont.obs["images"], whole.obs["images"])
    np.testing.assert_array_equal(cont.obs["state"], whole.obs["state"])


def test_time_limit_truncates(object_env, monkeypatch):
    env = object_env
    monkeypatch.setattr(env, "max_episode_steps", CHUNK + 3)
    env.reset(SOUP_TASK, 0)
    first = env.step_chunk(noop_chunk())
    assert first.steps == CHUNK and not first.truncated
    second = env.step_chunk(noop_chunk())
    assert second.steps == 3 and second.truncated and not second.terminated
    assert second.obs["images"].shape == (2, 3, *IMAGE_SIZE)
    with pytest.raises(RuntimeError, match="reset"):
        env.step_chunk(noop_chunk())


@pytest.mark.parametrize("corrupt", ["nan_qpos", "huge_qvel"])
def test_unstable_state_raises_from_step_chunk(object_env, corrupt):
    env = object_env
    env.reset(SOUP_TASK, 0)
    data = env.libero_env.env.sim.data
    if corrupt == "nan_qpos":
        data.qpos[-3] = np.nan                               # an object's free joint
    else:
        data.qvel[:] = 1e12                                  # MuJoCo resets the data and counts a warning
    with pytest.raises(SimulationUnstable):
        env.step_chunk(noop_chunk())
    obs = env.reset(SOUP_TASK, 0)                            # the scene is usable again after a reset
    assert np.all(np.isfinite(obs["state"]))
    with pytest.raises(ValueError, match="non-finite"):
        env.step_chunk(np.full((CHUNK, 7), np.nan))


def test_cheap_reset_equals_the_oft_protocol_with_hard_reset(object_env):
    """The adapter (soft reset after another episode, gated cameras) against a stock OffScreenRenderEnv
    driven by hand the way OpenVLA-OFT's evaluation does (hard reset, cameras every step)."""
    from libero.libero.envs import OffScreenRenderEnv

    env = object_env
    task, init, chunks = SOUP_TASK, 7, random_chunks(seed=11, num_chunks=3)
    env.reset(SOUP_TASK, 5)                                 # leave the scene dirty: moved, gripper closing
    for chunk in random_chunks(seed=12, num_chunks=2):
        chunk[:, -1] = 1.0                                  # LIBERO's close
        env.step_chunk(chunk)
    ours = [env.reset(task, init)] + [env.step_chunk(chunk).obs for chunk in chunks]

    h, w = IMAGE_SIZE
    stock = OffScreenRenderEnv(bddl_file_name=str(env.suite.bddl_files[task]), camera_heights=h, camera_widths=w)
    try:
        assert stock.env.hard_reset
        np.random.seed(scene_seed(task, init))
        stock.reset()
        raw = stock.set_init_state(env.suite.init_states(task)[init])
        for _ in range(10):
            raw, _, _, _ = stock.step([0, 0, 0, 0, 0, 0, -1])
        reference = [raw]
        for chunk in chunks:
            for action in chunk:                            # LIBERO's own actions: as the adapter passes them
                raw, _, done, _ = stock.step(np.array(action).tolist())
                assert not done
            reference.append(raw)
    finally:
        stock.close()
    for obs, raw in zip(ours, reference):
        np.testing.assert_array_equal(obs["images"][0], raw["agentview_image"][::-1, ::-1].transpose(2, 0, 1))
        np.testing.assert_array_equal(obs["images"][1], raw["robot0_eye_in_hand_image"][::-1, ::-1].transpose(2, 0, 1))
        state = np.concatenate([raw["robot0_eef_pos"], quat_to_axis_angle(raw["robot0_eef_quat"]),
                                raw["robot0_gripper_qpos"]]).astype(np.float32)
        np.testing.assert_array_equal(obs["state"], state)


def test_unset_starts_come_from_the_pools(object_env, monkeypatch):
    env = object_env
    monkeypatch.setattr(env, "task_ids", [SOUP_TASK])
    monkeypatch.setattr(env, "_init_pool", [6, 8])
    picks = []
    for _ in range(4):
        env.reset()
        picks.append((env.task_id, env.init_state_id))
    assert {task for task, _ in picks} == {SOUP_TASK} and {init for _, init in picks} <= {6, 8}
    env.reset(seed=3)
    first = (env.task_id, env.init_state_id)
    env.reset(seed=3)
    assert (env.task_id, env.init_state_id) == first                 # a seed fixes the draw
    monkeypatch.setattr(env, "fixed_starts", True)                   # use_fixed_reset_state_ids
    env.reset(SOUP_TASK, 7)
    env.reset()                                                      # an auto-reset repeats the start
    assert (env.task_id, env.init_state_id) == (SOUP_TASK, 7)


def test_scene_is_a_function_of_the_init_state(object_env):
    env = object_env
    a = env.reset(SOUP_TASK, 9)
    other = env.reset(SOUP_TASK, 10)
    b = env.reset(SOUP_TASK, 9)
    assert int((a["images"] != other["images"]).sum()) > 1000     # another init state: another scene
    np.testing.assert_array_equal(a["state"], b["state"])
    np.testing.assert_array_equal(a["images"], b["images"])


def test_cached_scenes_each_render_with_their_own_gl_context(object_env, monkeypatch):
    """Two scenes in one process each own a GL context; robosuite renders with whichever is current,
    so an unguarded render of the first scene after building the second draws garbage. (The shared
    scene's env, given a cache of two: its second scene is closed again at the end.)"""
    env = object_env
    monkeypatch.setattr(env, "max_cached_tasks", 2)
    try:
        first = env.reset(SOUP_TASK, 3)
        env.reset(SOUP_TASK + 1, 3)                              # builds a second scene and context
        again = env.reset(SOUP_TASK, 3)
        assert len(env._scenes) == 2
        np.testing.assert_array_equal(first["images"], again["images"])
        assert first["images"].mean() > 20                       # a lit scene, not a blank buffer
    finally:
        for task in [t for t in env._scenes if t != SOUP_TASK]:
            env._scenes.pop(task).env.close()


def test_building_a_scene_renders_only_its_first_observation(object_env, monkeypatch):
    """robosuite renders every camera once when it creates the camera's observable, only to learn the image's shape,
    and throws the image away; the adapter gives it the shape (``patches.camera_shapes_without_rendering``). Building
    a scene and resetting it into its first observation then renders each camera once; the shape given is the one a
    render returns."""
    import robosuite.utils.binding_utils as binding

    env, task = object_env, SOUP_TASK + 1
    monkeypatch.setattr(env, "max_cached_tasks", 2)
    renders: list[int] = []
    real = binding.MjRenderContext.render

    def counted(context, *args, **kwargs):
        renders.append(1)
        return real(context, *args, **kwargs)

    monkeypatch.setattr(binding.MjRenderContext, "render", counted)
    try:
        obs = env.reset(task, 0)                                 # builds the scene, then its first observation
        assert len(renders) == len(env.camera_names) == 2, renders
        scene = env._scenes[task]
        for cam, image in zip(env._rs_cameras, obs["images"]):
            rendered = np.asarray(scene.gate._real[f"{cam}_image"]({}))          # robosuite's own sensor
            assert tuple(scene.env.env._observables[f"{cam}_image"]._data_shape) == (*image.shape[1:], 3) == rendered.shape
    finally:
        for other in [t for t in env._scenes if t != SOUP_TASK]:
            env._scenes.pop(other).env.close()


# --------------------------------------------------------------------------------------------------
# every task (slow)
# --------------------------------------------------------------------------------------------------
_SWEEP: dict = {}
SWEEP_IMAGE_SIZE = [64, 64]


def _sweep_task(suite: str, task_id: int) -> dict:
    """Build one task's scene, check the first observation against direct MuJoCo reads and renders, step
    a chunk. Keeps one scene alive (``_SWEEP``; the caller closes it)."""
    env = _SWEEP.get("env")
    if env is None or env.suite.name != suite:
        if env is not None:
            env.close()
        env = _SWEEP["env"] = LiberoSimEnv(libero_cfg(suite, image_size=SWEEP_IMAGE_SIZE, num_settle_steps=0,
                                                      max_cached_tasks=1), seed=0)
    obs = env.reset(task_id, 0)
    cameras = {env.libero_env.env.sim.model.camera(i).name for i in range(env.libero_env.env.sim.model.ncam)}
    missing = sorted(set(CAMERAS.values()) - cameras)
    check_images_are_rotated_renders(env, obs["images"])
    check_proprio_matches_sim(env, obs["state"])
    result = env.step_chunk(random_chunks(seed=task_id, num_chunks=1)[0] * 0.3)
    return dict(suite=suite, task_id=task_id, missing_cameras=missing, steps=result.steps,
                success=result.success, reward=float(result.rewards.sum()),
                images_shape=result.obs["images"].shape, state_finite=bool(np.all(np.isfinite(result.obs["state"]))),
                pid=os.getpid())


def _libero_90_sample() -> list[int]:
    """First and last task of each scene family (kitchen, living room, study) of libero_90."""
    libero_paths.prepare()
    from libero.libero.benchmark.libero_suite_task_map import libero_task_map

    names = libero_task_map["libero_90"]
    picks = []
    for family in ("KITCHEN", "LIVING_ROOM", "STUDY"):
        ids = [i for i, name in enumerate(names) if name.startswith(family)]
        picks += [ids[0], ids[-1]]
    return picks


@pytest.mark.slow
def test_every_task_builds_renders_and_steps():
    jobs = [(suite, t) for suite in ("libero_spatial", "libero_object", "libero_goal", "libero_10") for t in range(10)]
    jobs += [("libero_90", t) for t in _libero_90_sample()]
    # task after task in one scene slot, in this process: worker processes would each pay the imports and
    # robosuite's first-scene set-up again (about 6 CPU-s each), and under xdist the other core is busy anyway
    try:
        results = [_sweep_task(suite, task_id) for suite, task_id in jobs]
    finally:
        env = _SWEEP.pop("env", None)
        if env is not None:
            env.close()
    assert len(results) == len(jobs) == 46
    for res in results:
        where = f"{res['suite']} task {res['task_id']}"
        assert res["missing_cameras"] == [], where
        assert res["steps"] == CHUNK and not res["success"] and res["reward"] == 0.0, where
        assert res["images_shape"] == (2, 3, *SWEEP_IMAGE_SIZE) and res["state_finite"], where
    assert len({res["pid"] for res in results}) <= 2


@pytest.mark.slow
def test_make_builds_a_process_vector_env():
    from embodirl.envs.registry import make_env

    cfg = libero_cfg("libero_spatial", image_size=[64, 64], task_ids=[0, 1], num_envs=2)
    venv = make_env(cfg, num_envs=2, seed=0)
    try:
        assert venv.num_envs == 2 and venv.spec.name == "libero_spatial"
        assert len({pid for pid in venv.pids}) == 2
        obs, info = venv.reset(task_ids=np.array([0, 1]), init_state_ids=np.array([0, 5]))
        assert obs["images"].shape == (2, 2, 3, 64, 64) and obs["state"].shape == (2, 8)
        np.testing.assert_array_equal(obs["task_id"], [0, 1])
        np.testing.assert_array_equal(info["init_state_id"], [0, 5])
        actions = np.zeros((2, CHUNK, 7), np.float32)
        actions[..., -1] = 1.0
        obs, reward, terminated, truncated, info = venv.step(actions)
        assert reward.shape == (2,) and not terminated.any() and not truncated.any()
        assert not info["success"].any() and not info["restarted"].any()
        np.testing.assert_array_equal(info["steps"], [CHUNK, CHUNK])
        # the adapter picks a task of the pool and an init state when told none
        obs, info = venv.reset()
        assert set(info["task_id"].tolist()) <= {0, 1} and (info["init_state_id"] >= 0).all()
    finally:
        venv.close()


@pytest.mark.slow
def test_opening_the_drawer_solves_the_goal_task():
    cfg = libero_cfg("libero_goal", image_size=[64, 64])
    env = LiberoSimEnv(cfg, seed=0)
    try:
        task = env.spec.task_descriptions.index("open the middle drawer of the cabinet")
        env.reset(task, 0)
        assert not env.step_chunk(noop_chunk()).success
        inner = env.libero_env.env
        cabinet = inner.get_object("wooden_cabinet_1")
        joint = next(j for j in cabinet.joints if "middle" in j)
        open_range = cabinet.object_properties["articulation"]["default_open_ranges"]
        inner.sim.data.set_joint_qpos(joint, min(open_range))
        inner.sim.forward()
        result = env.step_chunk(noop_chunk())
        assert result.success and result.terminated and result.rewards[-1] == 1.0
    finally:
        env.close()
