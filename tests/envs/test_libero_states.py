"""The held-out LIBERO training states (embodirl/envs/libero/states.py) on the real package: sampled as LIBERO made its
init files, reproducibly, never near an official state, cached, and a state file that copies official states refused.

Samplers build the task's env without a renderer (about a second) and check about 0.5 s per candidate, so each test
samples a few states of libero_spatial task 0 (the task where LIBERO's own dropped states show its settle rule)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embodirl.config import compose
from embodirl.envs.base import TRAIN_INIT_STATE_BASE
from embodirl.envs.libero import states
from embodirl.envs.libero.simulator import LiberoAdapter
from embodirl.envs.libero.suite import suite_info
from embodirl.envs.registry import env_config
from embodirl.errors import ConfigError

TASK = 0                    # libero_spatial: 'pick up the black bowl between the plate and the ramekin ...'
ON_CABINET = 9              # libero_spatial: the bowl starts on a fixture (placed relative to the cabinet's pose)
ROBOT_JOINTS = slice(1, 8)  # the Panda's seven arm joints in a flattened state (after the time entry)


def spatial(*overrides):
    return env_config(compose(["env=libero_spatial", *overrides]).env.train, "env.train")


@pytest.fixture(scope="module")
def info():
    return suite_info(spatial())


@pytest.fixture(scope="module")
def sampled(info):
    """Four states of set 0 of TASK."""
    return states.sample_states(info.bddl_files[TASK], info.init_states(TASK), task_id=TASK, seed=0, n=4)


def test_states_are_reproducible_and_the_first_k_do_not_depend_on_n(info, sampled):
    again = states.sample_states(info.bddl_files[TASK], info.init_states(TASK), task_id=TASK, seed=0, n=2)
    np.testing.assert_array_equal(again.states, sampled.states[:2])          # bit for bit
    np.testing.assert_array_equal(again.positions, sampled.positions)
    other = states.sample_states(info.bddl_files[TASK], info.init_states(TASK), task_id=TASK, seed=1, n=2)
    assert np.abs(other.states[:, None] - sampled.states[None]).max(-1).min() > 1e-3     # another seed, other states


def test_states_are_made_as_libero_made_its_own_and_none_is_near_an_official_one(info, sampled):
    official = info.init_states(TASK)                                          # (50, D)
    assert sampled.states.shape == (4, official.shape[1]) and len(sampled.positions) == 5   # bowls, plate, ...
    # saved right after the reset, as LIBERO's: time 0, at rest
    nq = (official.shape[1] - 1 + len(sampled.positions)) // 2                 # a free joint: 7 qpos, 6 qvel entries
    assert (sampled.states[:, 0] == 0).all() and (official[:, 0] == 0).all()
    assert (sampled.states[:, 1 + nq:] == 0).all() and (official[:, 1 + nq:] == 0).all()
    # the robot's joints carry robosuite's default initialisation noise, as the official states' (0.02 rad)
    offsets = sampled.states[:, ROBOT_JOINTS] - official[:, ROBOT_JOINTS].mean(0)
    assert 0.003 < np.abs(offsets).mean() < 0.05, offsets
    # objects start where the official ones do, within the placement boxes, never within 1 cm of an official state
    mine, theirs = sampled.object_positions(), sampled.object_positions(official)     # (4, M, 3), (50, M, 3)
    assert (mine.min(0) > theirs.min(0) - 0.01).all() and (mine.max(0) < theirs.max(0) + 0.01).all()
    nearest = states.nearest_distance(mine, theirs)
    assert (nearest >= states.NEAR_M).all(), nearest


def test_a_candidate_near_an_official_state_is_rejected(info, sampled):
    # pretend that an official state lies 5 mm from the first state the sampler keeps: it must keep the next one
    near = sampled.states[0].copy()
    near[1 + sampled.positions[:, 0]] += 0.005                                  # every object 5 mm along x
    official = np.concatenate([info.init_states(TASK), near[None]])
    kept = states.sample_states(info.bddl_files[TASK], official, task_id=TASK, seed=0, n=1)
    np.testing.assert_array_equal(kept.states[0], sampled.states[1])


def test_the_settle_check_keeps_official_states_and_rejects_most_that_libero_dropped(info):
    """LIBERO's .init file of this task holds the official states and, among its first 62 rows, 12 it dropped: the
    bowl starts inside the plate and is pushed out. The settle check keeps the official states whose objects move most
    and rejects at least 10 of the dropped ones."""
    import torch

    from embodirl.envs.libero import paths as libero_paths

    bddl = info.bddl_files[TASK]                                  # <bddl_files>/<suite>/<task>.bddl
    root = Path(libero_paths.prepare().get_libero_path("init_states")) / bddl.parent.name
    rows = np.asarray(torch.load(root / f"{bddl.stem}.init", weights_only=False))
    official = info.init_states(TASK)
    kept = [int(np.abs(rows - s).max(1).argmin()) for s in official]
    dropped = sorted(set(range(max(kept) + 1)) - set(kept))
    assert len(dropped) == 12
    sampler = states.Sampler(info.bddl_files[TASK])
    try:
        # the official states whose bowl starts inside the plate (it moves most while settling)
        moving = [k for k in (2, 5, 10, 13, 15, 19, 29, 31, 32, 53) if k in kept]
        assert all(sampler.valid(rows[k]) for k in moving)
        rejected = [k for k in dropped if not sampler.valid(rows[k])]
        assert len(rejected) >= 10, rejected
    finally:
        sampler.close()


def test_soft_resets_sample_as_a_hard_reset_does(info):
    """The sampler resets softly (fast) with the fixtures put back where the model file has them: objects placed
    relative to a fixture (the bowl on the cabinet) land where a hard reset of a fresh env puts them, bit for bit."""
    from libero.libero.envs.env_wrapper import ControlEnv

    from embodirl.envs.libero.patches import global_numpy_seed

    sampler = states.Sampler(info.bddl_files[ON_CABINET])
    hard = ControlEnv(bddl_file_name=str(info.bddl_files[ON_CABINET]), has_offscreen_renderer=False,
                      use_camera_obs=False, ignore_done=True, hard_reset=True,
                      initialization_noise=states.ROBOT_INIT_NOISE)
    try:
        for attempt in range(2):
            seed = states.candidate_seed(0, ON_CABINET, attempt)
            with global_numpy_seed(seed):
                hard.reset()
            np.testing.assert_array_equal(sampler.reset(seed), hard.get_sim_state())
    finally:
        sampler.close()
        hard.close()


def test_held_out_sets_are_cached_under_their_identity(info, sampled, tmp_path, monkeypatch):
    monkeypatch.setenv("EMBODIRL_HOME", str(tmp_path))
    env = spatial("env.train.num_init_states=2", "env.train.init_states_seed=0")
    path = states.cache_file(env, info, TASK)
    assert path.parent == tmp_path / "libero_states" / "libero_spatial"
    assert path.name.startswith(f"task{TASK}_seed0_n2_") and path.suffix == ".npz"
    first = states.heldout_set(env, info, TASK)
    np.testing.assert_array_equal(first.states, sampled.states[:2])
    monkeypatch.setattr(states, "sample_states", lambda *a, **k: pytest.fail("sampled again instead of reading"))
    np.testing.assert_array_equal(states.heldout_set(env, info, TASK).states, first.states)
    # the simulators' view: id 2**30 + j is state j, ids below are the official ones
    starts = states.StartStates(env, info)
    assert starts.training_ids(TASK) == range(TRAIN_INIT_STATE_BASE, TRAIN_INIT_STATE_BASE + 2)
    np.testing.assert_array_equal(starts.state(TASK, TRAIN_INIT_STATE_BASE + 1), sampled.states[1])
    np.testing.assert_array_equal(starts.state(TASK, 7), info.init_states(TASK)[7])
    with pytest.raises(ValueError, match=r"init states 0\.\.49 or training states 1073741824\.\.1073741825"):
        starts.state(TASK, TRAIN_INIT_STATE_BASE + 2)


SHIPPED = Path(__file__).with_name("fixtures") / "libero_states"


def test_the_suites_shipped_sets_carry_their_current_names(sampled):
    """tests/conftest.py copies these sets into the cache so that a clean clone's runs need not sample them: each
    must still be named as states.cache_file names its set today (else no run reads it, and the suite samples again:
    sample the set by running its test, then copy the new file from ~/.cache/embodirl/libero_states over the old),
    and hold what the sampler makes: the 3-state set of libero_spatial task 0 is the first 3 of its 50-state set and
    of the 4 sampled here (to rounding: another CPU may round MuJoCo's settling differently)."""
    files = sorted(SHIPPED.glob("*/*.npz"))
    assert {f.parent.name for f in files} == {"libero_spatial", "libero_10"} and len(files) == 6
    for path in files:
        suite, rest = path.parent.name, path.stem.split("_")
        task, seed, n = int(rest[0][4:]), int(rest[1][4:]), int(rest[2][1:])
        env = env_config(compose([f"env={suite}", f"env.train.num_init_states={n}",
                                  f"env.train.init_states_seed={seed}"]).env.train, "env.train")
        assert states.cache_file(env, suite_info(env), task).name == path.name, f"{path} is stale"
        found_suite, sets = states.read_state_file(path)
        assert found_suite == suite and list(sets) == [task] and len(sets[task].states) == n
    (small_file,) = SHIPPED.glob(f"libero_spatial/task{TASK}_seed0_n3_*.npz")
    (large_file,) = SHIPPED.glob(f"libero_spatial/task{TASK}_seed0_n50_*.npz")
    small, large = states.read_state_file(small_file)[1][TASK], states.read_state_file(large_file)[1][TASK]
    np.testing.assert_array_equal(small.states, large.states[:3])
    np.testing.assert_allclose(small.states, sampled.states[:3], rtol=0, atol=1e-6)


def test_a_state_file_is_checked_and_one_holding_official_states_overlaps(info, sampled, tmp_path):
    good = states.save_state_file(tmp_path / "mine.npz", "libero_spatial", {TASK: sampled})
    env = spatial("env.train.task_ids=[0]", f"env.train.train_init_states={good}")
    LiberoAdapter.check_config(env)
    assert LiberoAdapter.training_states(env, env).shared == []
    # a copy of official state 3 (shifted by 2 mm) under a training id of its own: near, so it overlaps
    copy = info.init_states(TASK)[3].copy()
    copy[1 + sampled.positions[:, 1]] += 0.002
    bad = states.save_state_file(tmp_path / "copied.npz", "libero_spatial",
                                 {TASK: states.StateSet(np.stack([sampled.states[0], copy]), sampled.positions)})
    env = spatial("env.train.task_ids=[0]", f"env.train.train_init_states={bad}")
    found = LiberoAdapter.training_states(env, env)
    # state 3 and any official state within 1 cm of the copy (official states 3 and 47 lie 0.9 cm apart)
    assert (TASK, 3) in found.shared and found.key == "env.train.train_init_states" and not found.on_purpose
    other = spatial("env.train.task_ids=[1]", f"env.train.train_init_states={good}")
    LiberoAdapter.check_config(other)       # an evaluation group takes env.train's file, whatever its tasks
    with pytest.raises(ConfigError, match="holds no states of libero_spatial task 1, which env.train trains on"):
        LiberoAdapter.training_states(other, other)
    with pytest.raises(ConfigError, match="must be heldout, official or the path of an existing .npz"):
        LiberoAdapter.check_config(spatial("env.train.train_init_states=somewhere"))
