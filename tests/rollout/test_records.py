"""Per-decision records -> Trajectory: masking of decisions that did not happen, row replacement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodirl import data as D
from embodirl.rollout.records import DecisionRecorder

B, T, H, A = 3, 4, 2, 2


def _fill(rec: DecisionRecorder, t: int, alive: np.ndarray, reward: float, done: np.ndarray, success: np.ndarray):
    rec.record_obs(t, {D.STATE: np.full((B, 5), t, np.float32), D.TASK_ID: np.arange(B)}, alive)
    rec.record_policy(t, {D.ACTION_CHUNK: torch.full((B, H, A), float(t)), D.ACTION_SAMPLE: torch.zeros(B, H * A),
                          D.LOGPROB_BEHAVIOR: torch.zeros(B, H * A)}, weight_version=7)
    rec.record_step(t, np.full(B, reward, np.float32), done, np.zeros(B, bool), success)


def test_invalid_decisions_have_no_reward_done_or_new_success():
    rec = DecisionRecorder(B, T)
    alive = np.ones(B, bool)
    for t in range(T):
        done = np.array([t == 0, t == 2, False])          # row 0 ends at t=0, row 1 at t=2, row 2 runs on
        success = np.array([True, False, t >= 3])
        _fill(rec, t, alive.copy(), reward=1.0, done=done, success=success)
        alive &= ~done
    traj = rec.build(group_id=np.zeros(B, np.int64), init_state_id=np.arange(B))
    D.validate(traj)
    np.testing.assert_array_equal(traj[D.VALID].numpy(), [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(traj[D.REWARD].numpy(), traj[D.VALID].float().numpy())
    np.testing.assert_array_equal(traj[D.TERMINATED].numpy(), [[1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(traj[D.SUCCESS].numpy(), [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1]])
    assert (traj[D.WEIGHT_VERSION] == 7).all()
    assert (traj[D.INIT_STATE_ID][:, 0] == torch.arange(B)).all()


def test_rest_marked_invalid_and_rows_replaced():
    rec = DecisionRecorder(B, T)
    _fill(rec, 0, np.ones(B, bool), reward=1.0, done=np.ones(B, bool), success=np.array([True, False, True]))
    rec.mark_rest_invalid(1)
    other = DecisionRecorder(B, T)
    for t in range(T):
        _fill(other, t, np.ones(B, bool), reward=2.0, done=np.zeros(B, bool), success=np.zeros(B, bool))
    rec.replace_rows(np.array([1]), other, np.array([1]))
    traj = rec.build(group_id=np.zeros(B, np.int64), init_state_id=np.zeros(B, np.int64))
    np.testing.assert_array_equal(traj[D.VALID].numpy(), [[1, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    np.testing.assert_array_equal(traj[D.REWARD][1].numpy(), [2, 2, 2, 2])
    np.testing.assert_array_equal(traj[D.SUCCESS][:, -1].numpy(), [True, False, True])
    assert (traj[D.ACTION_CHUNK][0, 1:] == 0).all()


def test_build_refuses_missing_decisions_and_wrong_batch():
    rec = DecisionRecorder(B, T)
    _fill(rec, 0, np.ones(B, bool), reward=0.0, done=np.zeros(B, bool), success=np.zeros(B, bool))
    with pytest.raises(ValueError, match="only 1 of 4"):
        rec.build(group_id=np.zeros(B, np.int64), init_state_id=np.zeros(B, np.int64))
    with pytest.raises(ValueError, match=r"expected \[B=3"):
        rec.record_obs(1, {D.STATE: np.zeros((2, 5), np.float32)}, np.ones(B, bool))
