"""Whole episodes of the stock LIBERO env driven exactly as OpenVLA-OFT's evaluation drives it, next to the
adapter with ``scene_seeding: oft`` fed the same actions: images and robot states bit-identical at every
decision, across consecutive trials of a task (OFT's seeding: ``env.seed(0)`` once per task, trials in
init-state order, so trial 1's fixture placement depends on trial 0's reset).

The stock side follows moojink/openvla-oft ``experiments/robot/libero/run_libero_eval.py`` (``run_task`` /
``run_episode``) and ``libero_utils.py`` (``get_libero_env``, ``get_libero_image``): an ``OffScreenRenderEnv``
at 256 px seeded 0, per trial ``reset`` + ``set_init_state``, 10 dummy steps, then one env step per action
with the gripper normalised and inverted, stopping at ``done``; a decision sees the 180-degree-rotated
images and the 8-D state (eef position, axis-angle, finger positions). The adapter takes LIBERO's own actions: the
same OFT-convention chunks reach it through the conversion a run applies to OpenVLA-OFT's actions
(:mod:`embodirl.envs.conventions`), so the comparison also holds that conversion to OFT's own.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from embodirl import runtime
from embodirl.envs.libero.simulator import LiberoAdapter, LiberoSimEnv, quat_to_axis_angle
from embodirl.envs.libero.suite import suite_info
from tests.envs.test_libero import CHUNK, libero_cfg

SIZE = 256
SETTLE_STEPS = 10
DUMMY_ACTION = [0, 0, 0, 0, 0, 0, -1]


def small_chunks(seed: int, num_chunks: int) -> np.ndarray:
    """Policy-convention chunks ``[num_chunks, H, 7]`` gentle enough for a whole episode of random motion."""
    rng = np.random.default_rng(seed)
    chunks = rng.uniform(-0.3, 0.3, size=(num_chunks, CHUNK, 7))
    chunks[..., -1] = rng.choice([0.2, 0.8], size=(num_chunks, CHUNK))
    return chunks


def oft_decision(raw) -> tuple[np.ndarray, np.ndarray]:
    """What OFT's policy sees: both cameras rotated 180 degrees ([V, 3, h, w]) and the 8-D proprio."""
    images = np.stack([raw[k][::-1, ::-1].transpose(2, 0, 1) for k in ("agentview_image", "robot0_eye_in_hand_image")])
    state = np.concatenate([raw["robot0_eef_pos"], quat_to_axis_angle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]])
    return images, state.astype(np.float32)


def stock_oft_episodes(bddl_file, init_states, trials: dict[int, np.ndarray], size: int = SIZE, *,
                       every_frame: bool = True) -> dict[int, list]:
    """``trials``: init-state index -> chunks, in run order. Returns the decisions of each trial. ``every_frame``:
    the cameras render at every low-level step, as the stock env does; else only at the steps whose observation a
    decision reads (:func:`frames_at_decisions_only`)."""
    runtime.configure()                     # what LiberoSimEnv does first: the same GL backend whoever runs first
    from libero.libero.envs import OffScreenRenderEnv

    env = OffScreenRenderEnv(bddl_file_name=str(bddl_file), camera_heights=size, camera_widths=size)
    env.seed(0)
    out = {}
    try:
        for k, chunks in trials.items():
            env.reset()
            draw = (lambda on: None) if every_frame else frames_at_decisions_only(env)
            raw = env.set_init_state(init_states[k])
            for i in range(SETTLE_STEPS):
                draw(i == SETTLE_STEPS - 1)
                raw, _, _, _ = env.step(DUMMY_ACTION)
            decisions, done = [oft_decision(raw)], False
            for chunk in chunks:
                for i, action in enumerate(chunk):
                    action = np.array(action)
                    action[-1] = -np.sign(2.0 * action[-1] - 1.0)   # normalize_gripper_action + invert
                    draw(i == len(chunk) - 1)
                    raw, _, done, _ = env.step(action.tolist())
                    if done:
                        assert every_frame or i == len(chunk) - 1, "success inside a chunk: its frame was not drawn"
                        break
                decisions.append(oft_decision(raw))
                if done:
                    break
            out[k] = decisions
    finally:
        env.close()
    return out


def frames_at_decisions_only(env):
    """Let the stock env's cameras draw a frame only when told (``draw(True)`` before the step whose observation a
    decision reads); any other step returns the last frame drawn, which nothing reads. Rendering both cameras is
    ~90 % of the stock env's time on the CPU (about 85 ms a frame whatever the size) and reads the simulation
    without changing it. The swap goes through robosuite's own ``modify_observable``; a hard reset puts its sensors
    back, so it is made again after every ``reset``. Returns ``draw``."""
    robosuite_env, wanted = env.env, {"on": True}
    for name in ("agentview_image", "robot0_eye_in_hand_image"):
        sensor, last = robosuite_env._observables[name]._sensor, {}

        def gated(obs_cache, sensor=sensor, last=last):
            if wanted["on"] or "frame" not in last:
                last["frame"] = sensor(obs_cache)
            return last["frame"]

        gated.__modality__ = sensor.__modality__
        robosuite_env.modify_observable(name, "sensor", gated)
    return lambda on: wanted.__setitem__("on", on)


# (suite, task, ((trial, chunk seed, num chunks), ...), size) -> the stock decisions. The stock run is a pure
# function of these (a fresh env seeded 0 per call, no state outside it), and several tests compare against the same
# libero_goal task 0 run: it is computed once per test process (the file runs on one xdist worker).
TrialsKey = tuple[tuple[int, int, int], ...]
GOAL_TRIALS: TrialsKey = ((0, 10, 4), (1, 11, 2))     # test_whole_episode_equals_ofts_evaluation[libero_goal]'s trials


def trial_chunks(key: TrialsKey) -> dict[int, np.ndarray]:
    """``((trial, seed, num_chunks), ...)`` -> init-state index -> :func:`small_chunks`, in run order."""
    return {k: small_chunks(seed, n) for k, seed, n in key}


@functools.cache
def stock_reference(suite: str, task: int, key: TrialsKey, size: int, every_frame: bool) -> dict[int, list]:
    """:func:`stock_oft_episodes` of ``task`` for the trials ``key`` names, computed once per process (the cache keys
    on the arguments as passed: every caller passes all five, positionally)."""
    info = suite_info(LiberoAdapter.check_config(libero_cfg(suite)))
    return stock_oft_episodes(info.bddl_files[task], info.init_states(task), trial_chunks(key), size,
                              every_frame=every_frame)


@functools.cache
def oft_conversion():
    """What a run hands LIBERO for OpenVLA-OFT's actions (the driver's check, as the env worker gets it)."""
    from embodirl.config import compose, validate
    from embodirl.schema.envs import action_conversion

    run = validate(compose(["env=libero_goal", "model=openvla_oft_tiny"]), check_envs=False, num_devices=2,
                   accelerator="cpu")
    return action_conversion(run, "env.train")


def adapter_episodes(env: LiberoSimEnv, task: int, trials: dict[int, np.ndarray]) -> dict[int, list]:
    """``trials``' OFT-convention chunks through the run's conversion into the adapter."""
    out = {}
    for k, chunks in trials.items():
        obs = env.reset(task, k)
        decisions = [(obs["images"], obs["state"])]
        for chunk in chunks:
            result = env.step_chunk(oft_conversion().to_env(chunk))
            decisions.append((result.obs["images"], result.obs["state"]))
            if result.terminated or result.truncated:
                break
        out[k] = decisions
    return out


def check_same_episodes(suite: str, task: int, key: TrialsKey, *, warm_up_trial: int | None = None,
                        size: int = SIZE, every_frame: bool = True):
    trials = trial_chunks(key)
    env = LiberoSimEnv(libero_cfg(suite, image_size=[size, size], scene_seeding="oft",
                                  max_episode_steps=sum(len(c) for c in trials.values()) * CHUNK), seed=0)
    try:
        if warm_up_trial is not None:   # another task's or a later trial's episode first: order must not leak
            env.reset(task, warm_up_trial)
        ours = adapter_episodes(env, task, trials)
    finally:
        env.close()
    reference = stock_reference(suite, task, key, size, every_frame)
    for k in trials:
        assert len(ours[k]) == len(reference[k])
        for t, ((images, state), (ref_images, ref_state)) in enumerate(zip(ours[k], reference[k])):
            assert all(image.std() > 5.0 for image in images), "a blank render would make the comparison vacuous"
            assert np.array_equal(images, ref_images), f"{suite} task {task} trial {k}: images differ at decision {t}"
            assert np.array_equal(state, ref_state), f"{suite} task {task} trial {k}: state differs at decision {t}"


def test_oft_seeding_reproduces_consecutive_trials():
    """The CI variant: libero_goal task 0 (fixtures on the table: placement matters), trial 0 for four decisions
    and trial 1 for two, after the simulator has already run trial 2 (its catch-up replays trials 0-1). The
    trials and actions are those of ``test_whole_episode_equals_ofts_evaluation[libero_goal]``, so the two tests
    compare against one stock run (:func:`stock_reference`); the adapter runs differ (this one warms up first)."""
    check_same_episodes("libero_goal", 0, GOAL_TRIALS, warm_up_trial=2)


@pytest.mark.slow
def test_per_start_seeding_differs_from_ofts_order():
    """Without OFT's seeding the same trial starts from another fixture placement (the test above would fail).
    The reference is OFT's trial 1 as the tests above run it (after trial 0's episode, :data:`GOAL_TRIALS`): the
    first decision of trial 1, whose fixture placement its reset drew after trial 0's."""
    env = LiberoSimEnv(libero_cfg("libero_goal", image_size=[SIZE, SIZE]), seed=0)
    try:
        ours = adapter_episodes(env, 0, {1: small_chunks(1, 0)})
    finally:
        env.close()
    reference = stock_reference("libero_goal", 0, GOAL_TRIALS, SIZE, True)
    assert not np.array_equal(ours[1][0][0], reference[1][0][0])


@pytest.mark.slow
@pytest.mark.parametrize("suite, steps", [("libero_spatial", 4 * CHUNK), ("libero_object", 4 * CHUNK),
                                         ("libero_goal", 4 * CHUNK), ("libero_10", 520)])
def test_whole_episode_equals_ofts_evaluation(suite, steps):
    """One task per suite at OFT's 256 px: trial 0 for ``steps`` low-level steps, then trial 1 for a few decisions.
    LIBERO-10 runs its whole 520-step episode (the longest suite: drift would show there first); the other suites
    run their first 4 decisions (their task and fixtures differ, the stepping code is the same: what they add is
    their scene, which every decision shows), which keeps the suite's time down (their whole episodes took 35-50 s
    each; each decision costs both sides about 2 CPU-s). The short episodes run the stock env as it is, both
    cameras rendering at every low-level step, so they also show that the adapter's rendering at decisions only
    changes nothing; the long one has the stock env draw only the frames a decision reads
    (:func:`frames_at_decisions_only`: 28 CPU-s instead of 103 for its stock run, 2026-12-07), so it can afford
    256 px instead of the 64 it ran at before. libero_goal's trials are :data:`GOAL_TRIALS`: its stock run is the
    one the two tests above compare against (computed once per process)."""
    key = ((0, 10, steps // CHUNK), (1, 11, 2))
    assert suite != "libero_goal" or key == GOAL_TRIALS       # the stock run shared with the tests above
    check_same_episodes(suite, 0, key, every_frame=steps <= 4 * CHUNK)


def test_eval_protocol_oft_switches_the_evaluation_env_only():
    from embodirl.config import compose, validate
    from embodirl.errors import ConfigError
    from embodirl.runner.evaluation import eval_env_cfg

    cfg = compose(["env=libero_goal", "runner.eval_protocol=oft"])
    validate(cfg, check_envs=False, num_devices=2, accelerator="cpu")
    assert eval_env_cfg(cfg).scene_seeding == "oft"
    assert cfg.env.train.scene_seeding == cfg.env.eval.scene_seeding == "per_start"
    assert eval_env_cfg(compose(["env=libero_goal"])).scene_seeding == "per_start"
    with pytest.raises(ConfigError, match="runner.eval_protocol: oft reproduces OpenVLA-OFT's LIBERO"):
        validate(compose(["runner.eval_protocol=oft"]), check_envs=False, num_devices=2, accelerator="cpu")
    with pytest.raises(ConfigError, match="runner.eval_protocol: 'fast' is not one of parallel, oft"):
        validate(compose(["env=libero_goal", "runner.eval_protocol=fast"]), check_envs=False, num_devices=0,
                 accelerator="cpu")
