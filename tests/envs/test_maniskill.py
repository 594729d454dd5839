"""ManiSkill 3 adapter on the real simulator (PhysX-CPU, software Vulkan): config checks, shapes,
scripted successes, fixed init states, render skipping, and the batched (GPU-backend) bookkeeping run
on CPU against ProcessVectorEnv."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from embodirl.config import compose
from embodirl.envs.base import TRAIN_INIT_STATE_BASE
from embodirl.envs.maniskill.gpu import ManiSkillGPUEnv, end_flags, group_by_init_state, transform_rewards
from embodirl.envs.maniskill.simulator import ManiSkillSimEnv, check_config, make_sim_env
from embodirl.envs.maniskill.tasks import instruction
from embodirl.envs.registry import check_env_config, env_config, make_env
from embodirl.envs.vector.vector_env import ProcessVectorEnv
from embodirl.errors import AssetsMissing, ConfigError

MAX_EE_DELTA = 0.1           # m: pd_ee_delta_pos maps an action of 1 to this end-effector step
GRIPPER_OPEN, GRIPPER_CLOSED = 1.0, -1.0
CUBE_HALF_SIZE = 0.02        # PickCube / PushCube cube half size (m)
WAYPOINT_TOL = 0.01          # m
MAX_CHUNKS_PER_WAYPOINT = 12

# ManiSkill's controllers call np.isnan on torch tensors (NumPy 2 deprecation, not ours)
pytestmark = pytest.mark.filterwarnings("ignore:__array_wrap__ must accept context:DeprecationWarning")


@functools.cache
def _composed(env: str) -> dict:
    # the env option as its YAML writes it: model=state_mlp's recipe for PushCube (the default job) switches it
    # to joint control, and these tests drive the option's own end-effector actions
    return OmegaConf.to_container(compose([f"env={env}", "model=openvla_oft_tiny"]).env.train, resolve=True)


def ms_cfg(env: str = "maniskill_pickcube", **overrides) -> dict:
    cfg = dict(_composed(env))
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module", autouse=True)
def _renderer_kept_alive():
    """SAPIEN frees its compiled shaders with the last live scene of the process, and compiling them
    again costs seconds per env on software Vulkan; one env held for the module keeps them."""
    env = ManiSkillSimEnv(ms_cfg("maniskill_pickcube", obs_mode="rgb", image_size=[32, 32]), seed=0)
    env.render_frame()
    yield
    env.close()


# --------------------------------------------------------------------------------------------------
# scripted pd_ee_delta_pos controllers (privileged simulator state), one chunk at a time
# --------------------------------------------------------------------------------------------------
def _tcp(base) -> np.ndarray:
    return base.agent.tcp.pose.p[0].cpu().numpy()


def toward(base, target, gripper: float, H: int) -> np.ndarray:
    """A chunk ``[H, 4]`` that moves the TCP towards ``target`` (proportional, clipped to [-1, 1])."""
    delta = 2.0 * (np.asarray(target) - _tcp(base)) / (H * MAX_EE_DELTA)
    action = np.concatenate([np.clip(delta, -1, 1), [gripper]]).astype(np.float32)
    return np.repeat(action[None], H, axis=0)


def follow(step, base, waypoints, H: int):
    """Drive through ``(target, gripper, hold_chunks)`` waypoints with ``step(chunk)``; yields each
    result and stops at the episode's end. ``hold_chunks=0``: until the TCP reaches the target."""
    for target, gripper, hold in waypoints:
        for n in range(1, MAX_CHUNKS_PER_WAYPOINT + 1):
            result = step(toward(base, target, gripper, H))
            yield result
            if result.terminated or result.truncated:
                return
            if (hold and n >= hold) or (not hold and np.linalg.norm(_tcp(base) - target) < WAYPOINT_TOL):
                break


def push_cube_waypoints(base):
    cube = base.obj.pose.p[0].cpu().numpy().copy()
    goal = base.goal_region.pose.p[0].cpu().numpy().copy()
    low = CUBE_HALF_SIZE * 0.75
    return [([cube[0] - 0.06, cube[1], 0.06], GRIPPER_CLOSED, 0),
            ([cube[0] - 0.05, cube[1], low], GRIPPER_CLOSED, 0),
            ([goal[0] - CUBE_HALF_SIZE - 0.01, goal[1], low], GRIPPER_CLOSED, 0)]


def pick_cube_waypoints(base):
    cube = base.cube.pose.p[0].cpu().numpy().copy()
    goal = base.goal_site.pose.p[0].cpu().numpy().copy()
    return [(cube + [0, 0, 0.05], GRIPPER_OPEN, 0), (cube, GRIPPER_OPEN, 0), (cube, GRIPPER_CLOSED, 3),
            (goal, GRIPPER_CLOSED, 0), (goal, GRIPPER_CLOSED, 4)]


def run_scripted(env: ManiSkillSimEnv, waypoints, H: int = 2):
    return list(follow(env.step_chunk, env.unwrapped, waypoints, H))


# --------------------------------------------------------------------------------------------------
# configuration checks
# --------------------------------------------------------------------------------------------------
def test_unknown_task_rejected_with_close_matches_or_choices():
    with pytest.raises(ConfigError, match=r"env\.task: unknown ManiSkill task 'PickCub-v1'; did you mean PickCube-v1"):
        check_config(ms_cfg(task="PickCub-v1"))
    with pytest.raises(ConfigError, match=r"available: .*PegInsertionSide-v1.*PushCube-v1.*StackCube-v1"):
        check_env_config(ms_cfg(task="NoSuchTask"))


@pytest.mark.parametrize("overrides, key, choices", [
    (dict(obs_mode="depth"), "obs_mode", "state, rgb"),
    (dict(reward_mode="shaped"), "reward_mode", "dense, normalized_dense, sparse, none"),
    (dict(task="PlugCharger-v1"), "reward_mode", "none, sparse"),           # task without dense rewards
    (dict(control_mode="pd_teleport"), "control_mode", "pd_ee_delta_pos"),
    (dict(obs_mode="rgb", cameras=["hand_camera"]), "cameras", "available: base_camera"),
    (dict(sim_backend="bullet"), "sim_backend", "auto, physx_cpu, physx_cuda"),
    (dict(num_init_states=0), "num_init_states", "null"),
    (dict(task="TwoRobotPickCube-v1", control_mode=None), "task", "one flat action vector"),
])
def test_bad_settings_rejected_with_choices(overrides, key, choices):
    with pytest.raises(ConfigError) as err:
        check_config(ms_cfg(**overrides))
    assert err.value.key == f"env.{key}"
    assert choices in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_gpu_backend_without_cuda_rejected():
    with pytest.raises(ConfigError, match="physx_cuda needs a CUDA GPU"):
        check_config(ms_cfg(sim_backend="physx_cuda"))


def test_put_carrot_fails_at_start_with_assets_missing_sentence():
    expected = (r"assets missing: bridge_v2_real2sim \(expected at "
                r".*tasks/bridge_v2_real2sim_dataset\) for ManiSkill task PutCarrotOnPlateInScene-v1; "
                r"run python -m mani_skill\.utils\.download_asset bridge_v2_real2sim$")
    cfg = ms_cfg("maniskill_putcarrot")
    with pytest.raises(AssetsMissing, match=expected):
        check_env_config(cfg)
    with pytest.raises(AssetsMissing, match=expected):        # make() checks before starting processes
        make_env(cfg, num_envs=2)
    with pytest.raises(AssetsMissing, match=expected):        # and ManiSkill's stdin prompt never runs
        ManiSkillSimEnv(cfg)


def test_missing_robot_assets_reported_with_command():
    # the robot is chosen inside the task's constructor: found by the construction guard
    expected = r"assets missing: widowxai .*; run python -m mani_skill\.utils\.download_asset widowxai$"
    with pytest.raises(AssetsMissing, match=expected):
        check_config(ms_cfg(task="PickCubeWidowXAI-v1", control_mode="pd_joint_delta_pos"))


def test_instructions():
    assert instruction("PickCube-v1") == "pick up the red cube and move it to the goal"
    assert instruction("PutCarrotOnPlateInScene-v1") == "put carrot on plate"
    assert instruction("MS-CartpoleSwingUp-v1") == "cartpole swing up"
    assert instruction("RotateValveLevel2-v1") == "rotate valve level 2"


# --------------------------------------------------------------------------------------------------
# one simulator
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("obs_mode", ["state", "rgb"])
@pytest.mark.parametrize("env_name, task", [("maniskill_pickcube", "PickCube-v1"),
                                            ("maniskill_pushcube", "PushCube-v1"),
                                            ("maniskill_stackcube", "StackCube-v1")])
def test_build_reset_step_shapes(env_name, task, obs_mode):
    env = ManiSkillSimEnv(ms_cfg(env_name, obs_mode=obs_mode, image_size=[64, 80]), seed=0)
    try:
        spec = env.spec
        assert spec.name == task and spec.task_descriptions == [instruction(task)]
        assert spec.action_dim == 4 and spec.action_low == [-1.0] * 4 and spec.action_high == [1.0] * 4
        assert spec.max_episode_steps == 50 and spec.num_init_states == [1000]
        obs = env.reset(init_state_id=3)
        assert env.init_state_id == 3
        assert obs["state"].dtype == np.float32 and obs["state"].shape == (spec.state_dim,) and spec.state_dim > 0
        assert obs["task_id"].dtype == np.int64 and obs["task_id"].shape == () and int(obs["task_id"]) == 0
        if obs_mode == "rgb":
            V = len(spec.camera_names)
            assert V >= 1 and spec.image_size == (64, 80)
            assert obs["images"].dtype == np.uint8 and obs["images"].shape == (V, 3, 64, 80)
            assert obs["images"].std() > 0                       # a rendered scene, not a blank buffer
        else:
            assert "images" not in obs and spec.camera_names == [] and spec.image_size is None
        res = env.step_chunk(np.zeros((5, 4), np.float32))
        assert res.steps == 5 and res.rewards.shape == (5,) and res.rewards.dtype == np.float32
        assert not (res.terminated or res.truncated or res.success)
        assert res.frames is None and res.info["elapsed_steps"] == 5
        assert {k: (v.shape, v.dtype) for k, v in res.obs.items()} == {k: (v.shape, v.dtype) for k, v in obs.items()}
        frame = env.render_frame()
        assert frame.dtype == np.uint8 and frame.shape[2] == 3
    finally:
        env.close()


@pytest.fixture(scope="module")
def push_env():
    # the option trains with ignore_terminations=true (the default job); these tests check termination
    env = ManiSkillSimEnv(ms_cfg("maniskill_pushcube", ignore_terminations=False), seed=0)
    yield env
    env.close()


def test_the_simulator_computes_without_autograd(push_env):
    """ManiSkillSimEnv runs ManiSkill under ``torch.inference_mode`` (a CPU step without autograd's bookkeeping): the
    scene's state tensors are inference tensors, which an in-place update outside inference mode is refused on, and
    the caller's mode is its own again after each call. That the numbers are those of ManiSkill with autograd on is
    test_batched_backend_matches_process_vector_env's comparison (ManiSkillGPUEnv steps ManiSkill without it)."""
    push_env.reset(init_state_id=1)
    push_env.step_chunk(np.zeros((2, 4), np.float32))
    elapsed = push_env.unwrapped._elapsed_steps             # ManiSkill's step counter, updated in place each step
    assert elapsed.is_inference() and int(elapsed[0]) == 2
    assert not torch.is_inference_mode_enabled()
    with pytest.raises(RuntimeError, match="[Ii]nference tensor"):
        elapsed += 1


def test_a_chunk_computes_the_state_observation_once_and_a_reward_reading_it_gets_it(push_env, monkeypatch):
    """ManiSkill passes the state observation to every reward function; none of its tasks reads it, so a chunk
    computes it once, for the observation after its last step, not at every step for the reward. A task whose reward
    does read it gets, at each step, what ManiSkill would have passed. That the rewards are ManiSkill's own is
    test_render_skipping_matches_stepping_every_step's comparison with its ``env.step``."""
    base = push_env.unwrapped
    calls = []
    compute = base._get_obs_state_dict
    monkeypatch.setattr(base, "_get_obs_state_dict", lambda info: calls.append(1) or compute(info))
    push_env.reset(init_state_id=1)
    calls.clear()
    actions = np.random.default_rng(3).uniform(-1, 1, (4, 4)).astype(np.float32)
    result = push_env.step_chunk(actions)
    assert result.steps == 4 and len(calls) == 1

    # the same chunk with a reward that reads the observation: each step's reading is the eager one's
    reward = base.compute_normalized_dense_reward
    seen = []

    def reading_reward(obs, action, info):
        eager = compute(info)["extra"]
        seen.append(all(torch.equal(obs["extra"][key], value) for key, value in eager.items()) and len(eager) > 0)
        return reward(obs=obs, action=action, info=info)

    monkeypatch.setattr(base, "compute_normalized_dense_reward", reading_reward)
    push_env.reset(init_state_id=1)
    calls.clear()
    again = push_env.step_chunk(actions)
    assert seen == [True] * 4 and len(calls) == 4 + 1
    np.testing.assert_array_equal(again.rewards, result.rewards)


def test_scripted_push_is_success_and_noop_is_not(push_env):
    for init_state_id in (0, 1, 2):
        push_env.reset(init_state_id=init_state_id)
        results = run_scripted(push_env, push_cube_waypoints(push_env.unwrapped))
        assert results[-1].success and results[-1].terminated and not results[-1].truncated
        assert not any(r.success for r in results[:-1])
    # the same chunk once more: the held success ends it after one step
    again = push_env.step_chunk(np.zeros((4, 4), np.float32))
    assert again.steps == 1 and again.terminated and again.success

    push_env.reset(init_state_id=0)
    results = [push_env.step_chunk(np.zeros((8, 4), np.float32)) for _ in range(7)]
    assert [r.steps for r in results] == [8] * 6 + [2]        # cut at max_episode_steps = 50
    assert results[-1].truncated and not results[-1].terminated
    assert not any(r.success for r in results)


def test_scripted_pick_is_success():
    env = ManiSkillSimEnv(ms_cfg("maniskill_pickcube"), seed=0)
    try:
        for init_state_id in (0, 1):
            env.reset(init_state_id=init_state_id)
            results = run_scripted(env, pick_cube_waypoints(env.unwrapped))
            assert results[-1].success and results[-1].terminated
            assert sum(r.steps for r in results) < env.spec.max_episode_steps
    finally:
        env.close()


def test_ignore_terminations_runs_through_success():
    env = ManiSkillSimEnv(ms_cfg("maniskill_pushcube", ignore_terminations=True), seed=0)
    try:
        env.reset(init_state_id=0)
        run_scripted(env, push_cube_waypoints(env.unwrapped))
        res = env.step_chunk(np.zeros((4, 4), np.float32))
        assert res.steps == 4 and res.success                 # not cut at the (held) success
    finally:
        env.close()


def test_time_limit_and_action_clipping():
    cfg = ms_cfg("maniskill_pickcube", max_episode_steps=7)
    a, b = ManiSkillSimEnv(cfg, seed=0), ManiSkillSimEnv(cfg, seed=1)
    try:
        assert a.spec.max_episode_steps == 7
        actions = np.random.default_rng(0).uniform(-1, 1, (5, 4)).astype(np.float32)
        a.reset(init_state_id=11)
        b.reset(init_state_id=11)
        big = actions * 10.0                                  # out of bounds: clipped to [-1, 1]
        ra = a.step_chunk(np.clip(big, -1.0, 1.0))
        rb = b.step_chunk(big)
        np.testing.assert_array_equal(ra.obs["state"], rb.obs["state"])
        np.testing.assert_array_equal(ra.rewards, rb.rewards)
        assert not np.array_equal(ra.obs["state"], a.reset(init_state_id=11)["state"])   # it moved
        a.step_chunk(actions)
        second = a.step_chunk(actions)
        assert second.steps == 2 and second.truncated and not ra.truncated
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("obs_mode", ["state", "rgb"])
def test_same_init_state_gives_identical_initial_scene(obs_mode):
    cfg = ms_cfg("maniskill_pickcube", obs_mode=obs_mode)
    a, b = ManiSkillSimEnv(cfg, seed=0), ManiSkillSimEnv(cfg, seed=123)
    try:
        first = a.reset(init_state_id=7)
        a.step_chunk(np.random.default_rng(1).uniform(-1, 1, (10, 4)).astype(np.float32))
        for obs in (a.reset(init_state_id=7), b.reset(init_state_id=7)):
            for key in first:
                np.testing.assert_array_equal(obs[key], first[key])
        other = b.reset(init_state_id=8)
        assert not np.array_equal(other["state"], first["state"])
        # without an id, each env draws one of its training states (held out: seeds from 2**30) from its own RNG
        # (seeded by reset's seed)
        a.reset(seed=5)
        b.reset(seed=5)
        assert a.init_state_id == b.init_state_id and TRAIN_INIT_STATE_BASE <= a.init_state_id < TRAIN_INIT_STATE_BASE + 1000
    finally:
        a.close()
        b.close()


def test_render_skipping_matches_stepping_every_step():
    env = ManiSkillSimEnv(ms_cfg("maniskill_pickcube", obs_mode="rgb"), seed=0)
    try:
        actions = np.random.default_rng(2).uniform(-1, 1, (8, 4)).astype(np.float32)
        env.reset(init_state_id=4)
        skipped = env.step_chunk(actions)
        # ManiSkill's own step (observation computed and rendered at every step) from the same state
        env.reset(init_state_id=4)
        rewards = []
        with torch.inference_mode():           # the env's tensors are inference tensors (it computes without autograd)
            for action in actions:
                raw, reward, *_ = env._env.step(torch.from_numpy(action[None]))
                rewards.append(float(reward[0]))
        stepped = env._unbatch(env._convert(raw))
        for key in stepped:
            np.testing.assert_array_equal(skipped.obs[key], stepped[key])
        np.testing.assert_array_equal(skipped.rewards, np.asarray(rewards, np.float32))
        # render_all: one frame per step, the last one is the final observation
        env.reset(init_state_id=4)
        every = env.step_chunk(actions, render_all=True)
        assert every.frames.shape == (8, *stepped["images"].shape)
        np.testing.assert_array_equal(every.frames[-1], stepped["images"])
        np.testing.assert_array_equal(every.obs["state"], stepped["state"])
    finally:
        env.close()


# --------------------------------------------------------------------------------------------------
# the batch: adapter make (sub-processes) and the GPU backend's bookkeeping run on CPU
# --------------------------------------------------------------------------------------------------
def test_make_env_runs_one_process_per_scene_with_shared_init_states(own_forkserver):
    venv = make_env(ms_cfg("maniskill_pickcube", num_envs=2), seed=0)
    try:
        assert isinstance(venv, ProcessVectorEnv) and all(pid is not None for pid in venv.pids)
        obs, info = venv.reset(init_state_ids=np.array([3, 3]))
        np.testing.assert_array_equal(obs["state"][0], obs["state"][1])    # a GRPO group: one scene
        assert info["init_state_id"].tolist() == [3, 3]
        actions = np.zeros((2, 4, venv.spec.action_dim), np.float32)
        obs, reward, terminated, truncated, info = venv.step(actions)
        assert obs["state"].shape == (2, venv.spec.state_dim) and reward.shape == (2,)
        assert info["steps"].tolist() == [4, 4] and not terminated.any() and not truncated.any()
    finally:
        venv.close()


def test_transform_rewards_matches_per_env_loop():
    rng = np.random.default_rng(0)
    B, H = 6, 5
    for rel in (False, True):
        raw = rng.normal(size=(B, H)).astype(np.float32)
        steps = np.array([5, 0, 3, 1, 5, 2])
        prev = rng.normal(size=B).astype(np.float32)
        rewards, new_prev = transform_rewards(raw, steps, prev, 0.5, rel)
        for b in range(B):
            scaled = 0.5 * raw[b, : steps[b]]
            expect = scaled - np.concatenate([[prev[b]], scaled[:-1]]) if rel else scaled
            np.testing.assert_allclose(rewards[b, : steps[b]], expect, rtol=1e-6)
            assert not rewards[b, steps[b]:].any()
            want_prev = scaled[-1] if rel and steps[b] else prev[b]
            assert new_prev[b] == pytest.approx(want_prev)


def test_end_flags_and_groups():
    success = np.array([True, True, False, True])
    fail = np.array([False, False, True, False])
    elapsed = np.array([3, 10, 4, 2])
    running = np.array([True, True, True, False])
    term, trunc = end_flags(success, fail, elapsed, running, 10, False)
    assert term.tolist() == [True, False, True, False] and trunc.tolist() == [False, True, False, False]
    term, trunc = end_flags(success, fail, elapsed, running, 10, True)
    assert not term.any() and trunc.tolist() == [False, True, False, False]
    groups = group_by_init_state(np.array([4, 1, 2, 0]), np.array([7, 7, 3, 7]))
    assert {k: v.tolist() for k, v in groups.items()} == {7: [0, 1, 4], 3: [2]}


def _compare_batches(gpu_out, ref_out):
    obs_g, rew_g, term_g, trunc_g, info_g = gpu_out
    obs_r, rew_r, term_r, trunc_r, info_r = ref_out
    for key in obs_r:
        np.testing.assert_array_equal(obs_g[key], obs_r[key])
    np.testing.assert_allclose(rew_g, rew_r, rtol=1e-6, atol=1e-7)
    assert term_g.tolist() == term_r.tolist() and trunc_g.tolist() == trunc_r.tolist()
    for key in ("success", "steps", "episode_length", "task_id", "init_state_id", "restarted"):
        assert info_g[key].tolist() == info_r[key].tolist(), key
    np.testing.assert_allclose(info_g["episode_return"], info_r["episode_return"], rtol=1e-6, atol=1e-6)
    for key in ("frames", "reset_frames"):
        for got, want in zip(info_g[key], info_r[key]):
            assert (got is None) == (want is None), key
            if want is not None:
                assert len(got) == len(want), key
                for frame_g, frame_r in zip(got, want):
                    np.testing.assert_array_equal(frame_g, frame_r)
    if "final_obs" in info_r:
        assert info_g["_final_obs"].tolist() == info_r["_final_obs"].tolist()
        assert info_g["final_init_state_id"].tolist() == info_r["final_init_state_id"].tolist()
        for key in info_r["final_obs"]:
            np.testing.assert_array_equal(info_g["final_obs"][key], info_r["final_obs"][key])


@pytest.mark.parametrize("overrides", [
    dict(auto_reset=True, ignore_terminations=False, use_rel_reward=True, reward_type="action_level",
         max_episode_steps=30,
         video=dict(enabled=True, env_ids=[0], fps=20, overlay=True)),
    dict(auto_reset=False, ignore_terminations=True, reward_coef=2.0, max_episode_steps=40),
])
def test_batched_backend_matches_process_vector_env(overrides):
    """ManiSkillGPUEnv's chunk/episode bookkeeping, partial resets and render skipping, run on
    PhysX-CPU with B=1, against ProcessVectorEnv + ManiSkillSimEnv on the same scripted actions."""
    cfg = ms_cfg("maniskill_pushcube", obs_mode="rgb", image_size=[48, 48], **overrides)
    gpu = ManiSkillGPUEnv(cfg, num_envs=1, seed=3, sim_backend="physx_cpu")
    ref = ProcessVectorEnv.from_config([functools.partial(make_sim_env, cfg, 3)], env_config(cfg), processes=False)
    try:
        assert gpu.spec == ref.spec
        obs_g, info_g = gpu.reset(init_state_ids=np.array([2]))
        obs_r, info_r = ref.reset(init_state_ids=np.array([2]))
        for key in obs_r:
            np.testing.assert_array_equal(obs_g[key], obs_r[key])
        H = 3
        seen = []

        def step_both(chunk):
            out_g, out_r = gpu.step(chunk[None]), ref.step(chunk[None])
            _compare_batches(out_g, out_r)
            seen.append(out_r)
            return SimpleNamespace(terminated=bool(out_r[2][0]), truncated=bool(out_r[3][0]))

        for _ in range(2 if overrides["auto_reset"] else 1):   # auto-reset: a second episode
            results = list(follow(step_both, gpu._base, push_cube_waypoints(gpu._base), H))
            while not (results[-1].terminated or results[-1].truncated):
                results.append(step_both(np.zeros((H, 4), np.float32)))
        assert any(out[4]["success"][0] for out in seen)
        if overrides["auto_reset"]:
            assert sum(out[4]["_final_obs"][0] for out in seen) == 2
            assert all(len(out[4]["frames"][0]) == out[4]["steps"][0] for out in seen)   # video: every step
        else:                                                   # ended: later steps do nothing
            out_g, out_r = gpu.step(np.zeros((1, H, 4), np.float32)), ref.step(np.zeros((1, H, 4), np.float32))
            _compare_batches(out_g, out_r)
            assert out_r[4]["steps"][0] == 0 and out_r[3][0]
        # partial reset of env 0 with a drawn init state
        obs_g, info_g = gpu.reset(env_ids=np.array([0]), seed=9)
        obs_r, info_r = ref.reset(env_ids=np.array([0]), seed=9)
        assert info_g["init_state_id"].tolist() == info_r["init_state_id"].tolist()
        np.testing.assert_array_equal(obs_g["images"], obs_r["images"])
    finally:
        gpu.close()
        ref.close()


def test_simulator_processes_fork_from_a_forkserver_that_imported_maniskill_once(tmp_path):
    """The adapter's preload: the processes are children of the forkserver, which already mapped SAPIEN
    (imported once there) before forking them - so no process imports ManiSkill itself. In a fresh process:
    a process's first vector env starts its forkserver, and the preload applies from then on. What the server
    imported is frozen (embodirl/envs/vector/frozen_heap.py): a process it forks starts with every object it
    inherits in the collector's permanent generation, so its collections neither walk nor copy them."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import gc, multiprocessing as mp, numpy as np, psutil\n"
        "from embodirl.config import compose\n"
        "from embodirl.envs.registry import make_env\n"
        "def heap(queue):\n"
        "    queue.put((gc.get_freeze_count(), len(gc.get_objects())))\n"
        "if __name__ == '__main__':\n"
        "    env = make_env(compose(['env.train.num_envs=2']).env.train, num_envs=2, seed=0)\n"
        "    me = psutil.Process()\n"
        "    parents = {p.ppid() for p in me.children(recursive=True) if p.ppid() != me.pid}\n"
        "    maps = ''.join(open(f'/proc/{pid}/maps').read() for pid in parents)\n"
        "    obs, _ = env.reset(seed=0)\n"
        "    ctx = mp.get_context('forkserver')   # the server the vector env started: its next child reports\n"
        "    queue = ctx.Queue()\n"
        "    child = ctx.Process(target=heap, args=(queue,))\n"
        "    child.start()\n"
        "    frozen, unfrozen = queue.get(timeout=120)\n"
        "    child.join()\n"
        "    print(len(parents), 'sapien' in maps, bool(np.isfinite(np.asarray(obs['state'])).all()), frozen, unfrozen)\n"
        "    env.close()\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    servers, preloaded, finite, frozen, unfrozen = proc.stdout.split()[-5:]
    assert int(servers) >= 1, "the simulator processes are not forked from a server process"
    assert preloaded == "True", "the forkserver did not import ManiSkill/SAPIEN before forking"
    assert finite == "True"
    # ManiSkill, SAPIEN and torch are ~300k tracked objects; what the child made itself before reporting is few
    assert int(frozen) > 100_000 and int(unfrozen) < int(frozen) // 10, (frozen, unfrozen)
