"""Training rollouts start only from held-out states, on the path a run takes: the in-process worker groups (env
workers, simulator processes, the collector, GRPO's planned starts and the simulators' own draws) on real LIBERO and
ManiSkill, with the tiny OpenVLA-OFT and the state MLP. The simulators report the init state each episode started from;
those ids are checked, and that each names the state the simulator used (a replay from the reported ids gives the same
first observations)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodirl import data as D
from embodirl.config import compose, validate
from embodirl.envs.base import TRAIN_INIT_STATE_BASE
from embodirl.envs.libero import states
from embodirl.envs.libero.suite import suite_info
from embodirl.rollout.starts import EpisodeStarts
from embodirl.runner.evaluation import eval_env_cfg, eval_schedule
from embodirl.runner.loop import worker_config
from embodirl.workers.groups import WorkerGroups

N_HELD_OUT = 3       # held-out states per task (sampled by the first simulator that needs them, then cached)
LIBERO = ["env=libero_spatial", "model=openvla_oft_tiny", "algorithm=grpo", "algorithm.group_size=2",
          "env.train.num_envs=2", "env.train.task_ids=[0]", "env.train.use_fixed_reset_state_ids=true",
          f"env.train.num_init_states={N_HELD_OUT}", "env.train.max_episode_steps=8", "env.train.image_size=[64,64]",
          "cluster.use_ray=false"]


pytestmark = pytest.mark.usefixtures("own_forkserver")   # each test's simulators fork as a run's do


def _collect(groups, starts=None, seed=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(task ids, init state ids, first observed state) of every slot of one training rollout."""
    traj = groups.collect(starts, seed=seed)
    return (traj[D.TASK_ID][:, 0].numpy().copy(), traj[D.INIT_STATE_ID][:, 0].numpy().copy(),
            traj[D.STATE][:, 0].numpy().copy())


def _starts_used(groups) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Rollouts from GRPO's planned starts (twice) and from the simulators' own draws (an unset start with a seed)."""
    return [_collect(groups), _collect(groups), _collect(groups, EpisodeStarts.unset(groups.num_slots), seed=11)]


def _replayed(groups, tasks: np.ndarray, inits: np.ndarray) -> np.ndarray:
    return _collect(groups, EpisodeStarts(tasks.astype(np.int64), inits.astype(np.int64)))[2]


def test_a_default_libero_training_rollout_starts_only_from_held_out_states():
    cfg = validate(compose(LIBERO))
    assert cfg.env.train.train_init_states == "heldout"          # the default
    with WorkerGroups.from_config(worker_config(cfg), remote=False) as groups:
        used = _starts_used(groups)
        for tasks, inits, first in used:
            np.testing.assert_array_equal(_replayed(groups, tasks, inits), first)   # the ids name what was used
    tasks = np.concatenate([t for t, _, _ in used])
    inits = np.concatenate([i for _, i, _ in used])
    assert set(tasks.tolist()) == {0}
    assert ((inits >= TRAIN_INIT_STATE_BASE) & (inits < TRAIN_INIT_STATE_BASE + N_HELD_OUT)).all(), inits
    assert len(set(inits.tolist())) > 1
    # the states those ids name are none of the official ones, nor within 1 cm of one
    info = suite_info(cfg.env.train)
    starts = states.StartStates(cfg.env.train, info)
    held_out = states.heldout_set(cfg.env.train, info, 0)
    used_states = np.stack([starts.state(0, int(k)) for k in inits])
    official = info.init_states(0)
    assert not (used_states[:, None] == official[None]).all(-1).any()
    nearest = states.nearest_distance(held_out.object_positions(used_states), held_out.object_positions(official))
    assert (nearest >= states.NEAR_M).all(), nearest


MANISKILL = ["env=maniskill_pushcube", "env.train.num_envs=4", "env.train.max_episode_steps=8", "actor.global_batch_size=4",
             "cluster.use_ray=false"]
GRPO = ["algorithm=grpo", "algorithm.group_size=2", "env.train.use_fixed_reset_state_ids=true"]


def _maniskill_inits(*overrides) -> tuple[np.ndarray, set[int]]:
    """Init states (seeds) of ManiSkill training rollouts: GRPO's planned ones, then the simulators' own draws, with
    auto-reset; and the seeds evaluation runs."""
    inits = []
    for extra in (GRPO, []):
        cfg = validate(compose([*MANISKILL, *extra, *overrides]))
        with WorkerGroups.from_config(worker_config(cfg), remote=False) as groups:
            for tasks, ids, first in _starts_used(groups):
                np.testing.assert_array_equal(_replayed(groups, tasks, ids), first)
                inits.append(ids)
    evaluated = {k for _, k in eval_schedule(eval_env_cfg(cfg), 1)}
    return np.concatenate(inits), evaluated


def test_maniskill_training_seeds_never_hit_the_evaluation_range():
    inits, evaluated = _maniskill_inits()
    assert evaluated == set(range(50))
    assert ((inits >= TRAIN_INIT_STATE_BASE) & (inits < TRAIN_INIT_STATE_BASE + 1000)).all(), inits
    assert not evaluated & set(inits.tolist())
    assert len(set(inits.tolist())) > 4


def test_official_training_states_run_and_draw_the_evaluations_seeds_on_purpose():
    inits, evaluated = _maniskill_inits("env.train.train_init_states=official", "env.train.num_init_states=60")
    assert (inits < 60).all() and evaluated & set(inits.tolist()), inits       # 50 of the 60 are evaluated too
    assert torch.tensor(inits).unique().numel() > 4
