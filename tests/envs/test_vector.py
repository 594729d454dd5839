"""ProcessVectorEnv: episode semantics on the toy task (in-process and sub-processes), faults, cleanup.

The real-simulator fault test (SIGKILL of a LIBERO / ManiSkill sub-process mid-rollout) is at the end.
"""

from __future__ import annotations

import functools
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

from embodirl.envs.toy import ToySimEnv, init_position, oracle_actions
from embodirl.envs.vector.recovery import SubEnvCrashed
from embodirl.envs.vector.vector_env import ProcessVectorEnv
from embodirl.errors import ConfigError
from tests.env_options import env_option

H = 4            # chunk length used throughout
STEP = 0.08


def toy_cfg(**overrides) -> dict:
    cfg = env_option("toy_reach")
    cfg.update(state_obs=True, step_size=STEP)
    cfg.update(overrides)
    return cfg


def make_venv(n=4, *, processes=False, cfg=None, **kwargs) -> ProcessVectorEnv:
    cfg = cfg or toy_cfg()
    return ProcessVectorEnv([functools.partial(ToySimEnv, cfg, seed=i) for i in range(n)],
                            processes=processes, **kwargs)


def still_actions(n, h=H, a=7):
    return np.zeros((n, h, a), np.float32)


def away_actions(obs, h=H, a=7):
    """Move towards the side opposite the goal (never succeeds)."""
    direction = -np.sign(obs["state"][:, 2:4])                              # (B, 2)
    actions = np.zeros((len(direction), h, a), np.float32)
    actions[:, :, :2] = direction[:, None, :]
    return actions


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_dead(pids, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


# --- episode semantics -----------------------------------------------------------------------------
@pytest.mark.parametrize("reward_type", ["chunk_level", "action_level"])
def test_reward_coef_and_reward_shapes(reward_type):
    with make_venv(3, reward_coef=2.5, reward_type=reward_type) as venv:
        obs, _ = venv.reset(seed=0)
        obs, reward, terminated, truncated, info = venv.step(oracle_actions(obs, 12, 7, STEP))
        assert terminated.all() and not truncated.any() and info["success"].all()
        steps = info["steps"]
        assert (steps < 12).all()          # the chunk stopped at success
        if reward_type == "chunk_level":
            assert reward.shape == (3,) and reward.dtype == np.float32
            np.testing.assert_allclose(reward, 2.5)
        else:
            assert reward.shape == (3, 12)
            for b in range(3):               # success reward on the last executed step, zero padding after
                expected = np.zeros(12, np.float32)
                expected[steps[b] - 1] = 2.5
                np.testing.assert_allclose(reward[b], expected)
        np.testing.assert_allclose(info["episode_return"], 2.5)
        np.testing.assert_array_equal(info["episode_length"], steps)


def test_truncation_mid_chunk_and_ended_env_stays_ended():
    with make_venv(2, cfg=toy_cfg(max_episode_steps=10), reward_type="action_level") as venv:
        obs, _ = venv.reset(seed=0)
        lengths = []
        for _ in range(3):
            obs, reward, terminated, truncated, info = venv.step(still_actions(2))
            lengths.append(info["steps"].copy())
        # 10 = 4 + 4 + 2: the third chunk is cut after two steps and reports the time limit
        np.testing.assert_array_equal(np.stack(lengths), [[4, 4], [4, 4], [2, 2]])
        assert truncated.all() and not terminated.any()
        np.testing.assert_array_equal(info["episode_length"], [10, 10])
        assert reward.shape == (2, H)
        # without auto-reset the ended env is not stepped again: same obs, no reward, same flags
        before = obs["state"].copy()
        obs, reward, terminated, truncated, info = venv.step(np.ones((2, H, 7), np.float32))
        np.testing.assert_array_equal(info["steps"], [0, 0])
        np.testing.assert_array_equal(obs["state"], before)
        assert truncated.all() and not reward.any()
        # reset starts a new episode
        obs, info = venv.reset(seed=1)
        obs, _, _, truncated, info = venv.step(still_actions(2))
        assert not truncated.any() and (info["steps"] == H).all()


def test_auto_reset_same_step():
    with make_venv(4, auto_reset=True) as venv:
        obs, info = venv.reset(seed=0, init_state_ids=[0, 1, 2, 3])
        start_tasks = info["task_id"].copy()
        obs, reward, terminated, truncated, info = venv.step(oracle_actions(obs, 12, 7, STEP))
        assert terminated.all() and info["_final_obs"].all()
        final_state = info["final_obs"]["state"]                                 # (B, 4)
        # the final observation shows the point inside its goal square ...
        assert (np.abs(final_state[:, :2] - final_state[:, 2:]).max(axis=1) < 0.15).all()
        # ... and obs is the first observation of a new episode
        for b in range(4):
            np.testing.assert_allclose(obs["state"][b, :2], init_position(info["init_state_id"][b]), atol=1e-6)
        np.testing.assert_array_equal(info["final_task_id"], start_tasks)
        np.testing.assert_array_equal(info["final_init_state_id"], [0, 1, 2, 3])
        np.testing.assert_array_equal(info["task_id"], obs["task_id"])
        assert info["success"].all() and (info["episode_length"] > 0).all()
        # envs that did not end have final_obs == obs and are not flagged
        obs, _, terminated, truncated, info = venv.step(still_actions(4))
        assert not info["_final_obs"].any()
        np.testing.assert_array_equal(info["final_obs"]["state"], obs["state"])


def test_ignore_terminations_runs_to_the_time_limit():
    cfg = toy_cfg(max_episode_steps=12)
    with make_venv(2, cfg=cfg, ignore_terminations=True, reward_type="action_level") as venv:
        obs, _ = venv.reset(seed=0, init_state_ids=[0, 0], task_ids=[1, 1])
        obs, reward, terminated, truncated, info = venv.step(oracle_actions(obs, 2 * H, 7, STEP))
        first_success = info["success"].copy()
        # the whole chunk executed although the goal was reached inside it (the success reward shows where)
        np.testing.assert_array_equal(info["steps"], [2 * H, 2 * H])
        assert (reward[:, : 2 * H - 1] > 0).any(axis=1).all()
        assert not terminated.any()
        # leave the goal: success stays "succeeded at some step so far"
        obs, reward, terminated, truncated, info = venv.step(away_actions(obs))
        assert first_success.all() and info["success"].all()
        inside = np.abs(obs["state"][:, :2] - obs["state"][:, 2:]).max(axis=1) < 0.15
        assert not inside.any()
        assert truncated.all() and not terminated.any()
        np.testing.assert_array_equal(info["episode_length"], [12, 12])


def test_relative_reward_is_the_difference_of_step_rewards():
    cfg = toy_cfg(reward_mode="dense", max_episode_steps=8)
    outs = {}
    for rel in (False, True):
        with make_venv(2, cfg=cfg, use_rel_reward=rel, reward_coef=3.0, reward_type="action_level") as venv:
            obs, _ = venv.reset(seed=5, init_state_ids=[3, 4], task_ids=[0, 2])
            rng = np.random.default_rng(0)
            rows = []
            for _ in range(2):
                obs, reward, *_ = venv.step(rng.uniform(-1, 1, (2, H, 7)).astype(np.float32))
                rows.append(reward)
            outs[rel] = np.concatenate(rows, axis=1)                              # (B, 8)
    absolute, relative = outs[False], outs[True]
    previous = np.concatenate([np.zeros((2, 1)), absolute[:, :-1]], axis=1)
    np.testing.assert_allclose(relative, absolute - previous, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(relative.sum(axis=1), absolute[:, -1], rtol=1e-5, atol=1e-6)


def test_reset_forwards_tasks_and_init_states_per_env():
    with make_venv(4) as venv:
        obs, info = venv.reset(seed=0)
        untouched = obs["state"][[0, 2]].copy()
        obs, info = venv.reset(env_ids=[1, 3], task_ids=[2, 0], init_state_ids=[5, 7])
        np.testing.assert_array_equal(info["task_id"][[1, 3]], [2, 0])
        np.testing.assert_array_equal(info["init_state_id"][[1, 3]], [5, 7])
        np.testing.assert_array_equal(obs["task_id"][[1, 3]], [2, 0])
        np.testing.assert_allclose(obs["state"][1, :2], init_position(5), atol=1e-6)
        np.testing.assert_allclose(obs["state"][3, :2], init_position(7), atol=1e-6)
        np.testing.assert_array_equal(obs["state"][[0, 2]], untouched)
        # the adapter's own choice of init state is reported too
        assert (info["init_state_id"] >= 0).all()
        with pytest.raises(ValueError, match="task_ids has 1 entries for 2 envs"):
            venv.reset(env_ids=[0, 1], task_ids=[1])


def test_actions_shape_is_checked():
    with make_venv(2) as venv:
        venv.reset(seed=0)
        with pytest.raises(ValueError, match=r"\[B=2, H, A=7\]"):
            venv.step(np.zeros((2, H, 3)))


def test_in_process_equals_sub_processes():
    runs = []
    for processes in (False, True):
        with make_venv(3, processes=processes, auto_reset=True, reward_type="action_level",
                       cfg=toy_cfg(reward_mode="dense", max_episode_steps=10)) as venv:
            obs, info = venv.reset(seed=11)
            rng = np.random.default_rng(3)
            trace = [obs, info["task_id"], info["init_state_id"]]
            for t in range(8):
                actions = oracle_actions(obs, H, 7, STEP) if t % 3 == 2 else rng.uniform(-1, 1, (3, H, 7))
                obs, reward, terminated, truncated, info = venv.step(actions)
                trace += [obs, reward, terminated, truncated, info["success"], info["task_id"], info["final_obs"]]
            runs.append(trace)
    for a, b in zip(*runs):
        if isinstance(a, dict):
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])
        else:
            np.testing.assert_array_equal(a, b)


def test_recorded_envs_return_every_frame():
    cfg = toy_cfg(image_size=[32, 32])
    with make_venv(3, cfg=cfg, record_env_ids=[1], auto_reset=True) as venv:
        obs, info = venv.reset(seed=0)
        assert info["frames"][0] is None and len(info["frames"][1]) == 1
        assert info["frames"][1][0].shape == (32, 32, 3)
        np.testing.assert_array_equal(info["frames"][1][0], obs["images"][1, 0].transpose(1, 2, 0))
        obs, reward, terminated, truncated, info = venv.step(oracle_actions(obs, 12, 7, STEP))
        frames = info["frames"][1]
        assert len(frames) == info["steps"][1] and info["frames"][0] is None
        # the last executed step's frame is the final observation; the reset frame the new one
        np.testing.assert_array_equal(frames[-1], info["final_obs"]["images"][1, 0].transpose(1, 2, 0))
        np.testing.assert_array_equal(info["reset_frames"][1][0], obs["images"][1, 0].transpose(1, 2, 0))


def test_construction_errors_propagate_with_the_adapters_message():
    bad = toy_cfg(num_tasks=99)
    with pytest.raises(ConfigError, match=r"env.num_tasks: must be in \[1, 8\], got 99") as exc:
        ProcessVectorEnv([functools.partial(ToySimEnv, bad)] * 2, processes=True)
    assert exc.value.key == "env.num_tasks"


# --- faults ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("processes", [False, True])
def test_non_finite_state_restarts_only_that_env(processes):
    with make_venv(3, processes=processes) as venv:
        obs, info = venv.reset(seed=0, task_ids=[0, 1, 2], init_state_ids=[4, 5, 6])
        pids = venv.pids
        actions = away_actions(obs)
        actions[1, 1, 0] = np.nan                     # blows up env 1's state (a MuJoCo-like NaN)
        obs, reward, terminated, truncated, info = venv.step(actions)
        np.testing.assert_array_equal(info["restarted"], [False, True, False])
        assert venv.num_restarts == 1 and info["num_restarts"] == 1
        np.testing.assert_array_equal(info["steps"], [H, 0, H])
        # env 1 is back at the start of the same task / init state; the others moved on
        np.testing.assert_allclose(obs["state"][1, :2], init_position(5), atol=1e-6)
        assert obs["task_id"][1] == 1 and info["init_state_id"][1] == 5
        assert not np.allclose(obs["state"][0, :2], init_position(4))
        if processes:
            assert venv.pids[1] != pids[1] and venv.pids[0] == pids[0]
            assert wait_dead([pids[1]])
        obs, reward, terminated, truncated, info = venv.step(away_actions(obs))
        assert not info["restarted"].any()


def test_repeated_failures_raise_after_max_restarts():
    with make_venv(2, max_restarts=2) as venv:
        obs, _ = venv.reset(seed=0)
        nan = away_actions(obs)
        nan[0, 0, 0] = np.nan
        for _ in range(2):
            _, _, _, _, info = venv.step(nan)
            assert info["restarted"][0]
        with pytest.raises(SubEnvCrashed, match="sub-environment 0 failed 3 times in a row"):
            venv.step(nan)


def test_sigkilled_sub_process_is_replaced():
    with make_venv(3, processes=True) as venv:
        obs, _ = venv.reset(seed=0, init_state_ids=[1, 2, 3])
        obs, *_ = venv.step(away_actions(obs))
        victim = venv.pids[2]
        os.kill(victim, signal.SIGKILL)
        obs, reward, terminated, truncated, info = venv.step(away_actions(obs))
        np.testing.assert_array_equal(info["restarted"], [False, False, True])
        np.testing.assert_allclose(obs["state"][2, :2], init_position(3), atol=1e-6)
        np.testing.assert_array_equal(info["episode_length"], [2 * H, 2 * H, 0])
        assert venv.pids[2] != victim


class HangingToy(ToySimEnv):
    """Fault injection: a toy scene whose simulator hangs when action dim 2 is positive."""

    def step_chunk(self, actions, render_all=False):
        if actions[0, 2] > 0:
            time.sleep(120)
        return super().step_chunk(actions, render_all)


def test_hung_sub_process_is_restarted_after_step_timeout():
    cfg = toy_cfg()
    venv = ProcessVectorEnv([functools.partial(HangingToy, cfg, seed=i) for i in range(2)], processes=True,
                            step_timeout=3.0)
    with venv:
        obs, _ = venv.reset(seed=0)
        actions = still_actions(2)
        actions[0, 0, 2] = 1.0
        start = time.monotonic()
        _, _, _, _, info = venv.step(actions)
        assert time.monotonic() - start < 60
        np.testing.assert_array_equal(info["restarted"], [True, False])


# --- process cleanup ------------------------------------------------------------------------------
def test_close_and_garbage_collection_end_the_processes():
    venv = make_venv(2, processes=True)
    pids = venv.pids
    assert all(alive(p) for p in pids)
    venv.close()
    assert wait_dead(pids)
    venv.close()    # idempotent
    venv = make_venv(2, processes=True)
    pids = venv.pids
    del venv
    gc.collect()
    assert wait_dead(pids)


_CHILD_SCRIPT = textwrap.dedent("""
    import functools, sys, threading, time
    import numpy as np
    from omegaconf import OmegaConf
    from embodirl.config import compose
    from embodirl.envs.toy import ToySimEnv
    from embodirl.envs.vector.vector_env import ProcessVectorEnv

    class Busy(ToySimEnv):
        def step_chunk(self, actions, render_all=False):
            time.sleep(600)

    if __name__ == "__main__":
        cfg = OmegaConf.to_container(compose(["env=toy_reach"]).env.train, resolve=True)
        venv = ProcessVectorEnv([functools.partial(Busy, cfg, seed=i) for i in range(2)])
        venv.reset(seed=0)
        if sys.argv[1] == "busy":   # the sub-processes are inside step_chunk when the parent dies
            threading.Thread(target=venv.step, args=(np.zeros((2, 4, 7)),), daemon=True).start()
            time.sleep(1.0)
        print(" ".join(str(p) for p in venv.pids), flush=True)
        if sys.argv[1] != "exit":
            time.sleep(600)
        # "exit": leave without close(): the atexit hook must end the sub-processes
""")


@pytest.mark.parametrize("how", ["exit", "sigkill_idle", "sigkill_busy"])
def test_no_orphans_when_the_parent_exits_or_is_killed(tmp_path, how):
    script = tmp_path / "parent.py"
    script.write_text(_CHILD_SCRIPT)
    mode = {"exit": "exit", "sigkill_idle": "idle", "sigkill_busy": "busy"}[how]
    proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    if how != "exit":
        assert all(alive(p) for p in pids)
        proc.kill()
    proc.wait(60)
    assert wait_dead(pids), f"sub-processes {pids} outlived their parent ({how})"


# --- real simulators -------------------------------------------------------------------------------
REAL_SIMULATORS = {
    # small scenes so that three sub-processes build quickly on a 2-core machine
    "libero": ["env=libero_spatial", "env.train.image_size=[64,64]", "env.train.max_episode_steps=24",
               "env.train.num_settle_steps=2", "env.train.task_ids=[0]", "++env.train.max_cached_tasks=1"],
    "maniskill": ["env=maniskill_pickcube", "env.train.max_episode_steps=24", "env.train.sim_backend=physx_cpu"],
}


@pytest.mark.slow
@pytest.mark.parametrize("simulator", sorted(REAL_SIMULATORS))
def test_real_simulator_survives_sigkill_and_raising_steps(compose_cfg, simulator, own_forkserver):
    from omegaconf import OmegaConf

    from embodirl.envs.registry import make_env

    cfg = OmegaConf.to_container(compose_cfg(*REAL_SIMULATORS[simulator]).env.train, resolve=True)
    cfg.update(auto_reset=False, reward_type="action_level")
    with make_env(cfg, num_envs=2, seed=0) as venv:
        assert all(pid is not None for pid in venv.pids)
        obs, info = venv.reset(task_ids=[0, 0], init_state_ids=[0, 1])
        first = {k: v.copy() for k, v in obs.items()}
        actions = np.zeros((2, H, venv.spec.action_dim), np.float32)
        actions[:, :, -1] = 1.0          # the gripper's command (LIBERO: close, ManiSkill: open): any will do
        obs, reward, terminated, truncated, info = venv.step(actions)
        np.testing.assert_array_equal(info["steps"], [H, H])

        # SIGKILL one simulator mid-rollout: the other continues, it is replaced and flagged
        victim = venv.pids[1]
        os.kill(victim, signal.SIGKILL)
        obs, reward, terminated, truncated, info = venv.step(actions)
        np.testing.assert_array_equal(info["restarted"], [False, True])
        np.testing.assert_array_equal(info["episode_length"], [2 * H, 0])
        assert venv.pids[1] != victim and not alive(victim)
        # the new simulator restarted the same task / init state: the same first observation
        assert info["init_state_id"][1] == 1
        for key in obs:
            np.testing.assert_array_equal(obs[key][1], first[key][1])
        assert not np.array_equal(obs["state"][0], first["state"][0])   # env 0 kept its episode

        # a simulator that raises (the adapter rejects non-finite actions) is replaced the same way
        bad = actions.copy()
        bad[0, 0, 0] = np.nan
        obs, reward, terminated, truncated, info = venv.step(bad)
        np.testing.assert_array_equal(info["restarted"], [True, False])
        np.testing.assert_array_equal(info["episode_length"], [0, H])
        assert venv.num_restarts == 2
        for key in obs:
            np.testing.assert_array_equal(obs[key][0], first[key][0])
        pids = venv.pids
    assert wait_dead(pids)
