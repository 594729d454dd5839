"""Real rollouts on ManiSkill and LIBERO with the tiny OpenVLA-OFT preset through Ray actors: env
workers (two pipeline stages) + an inference worker, observations over shared memory."""

from __future__ import annotations

import pytest
import torch

from embodirl import data as D
from embodirl.channel import segments
from embodirl.workers.groups import WorkerGroups

SMALL = ["model=openvla_oft_tiny", "env.train.num_envs=2", "env.eval.num_envs=2", "actor.global_batch_size=2",
         "actor.micro_batch_size=1", "rollout.pipeline_stage_num=2", "rollout.max_decisions=2"]


def _check(traj, *, N, T, V, h, A, H, S):
    sizes = D.validate(traj)
    assert traj.batch_size == torch.Size([N, T])
    assert traj[D.IMAGES].shape == (N, T, V, 3, h, h) and traj[D.IMAGES].dtype == torch.uint8
    assert traj[D.STATE].shape == (N, T, S)
    assert traj[D.ACTION_TOKENS].shape == (N, T, H * A)
    assert traj[D.LOGPROB_BEHAVIOR].shape == (N, T, H * A) and (traj[D.LOGPROB_BEHAVIOR] <= 0).all()
    assert traj[D.ACTION_CHUNK].shape == (N, T, H, A)
    assert traj[D.VALUE].shape == (N, T)
    assert traj[D.VALID][:, 0].all()
    assert (traj[D.WEIGHT_VERSION] == 0).all()
    # two decisions are shorter than an episode: the horizon cuts it and the value head bootstraps it
    cut = traj[D.VALID][:, -1] & ~traj[D.TERMINATED][:, -1] & ~traj[D.TRUNCATED][:, -1]
    bootstrap = D.get_extra(traj, D.BOOTSTRAP_VALUE)
    assert cut.all() and bootstrap.shape == (N,) and torch.isfinite(bootstrap).all()
    return sizes


def _collect(ray_local, cfg):
    with WorkerGroups.from_config(cfg, remote=True) as groups:
        traj = groups.collect()
        info = ray_local.get(groups.env.workers[0].transport_info.remote())
        assert info["shm_batches"] > 0 and info["ray_batches"] == 0
        ring = info["segment"]
    assert ring not in segments.listing()
    return traj


@pytest.mark.slow
def test_maniskill_rollout_with_tiny_openvla_through_ray(ray_local, compose_cfg):
    cfg = compose_cfg("env=maniskill_pickcube_rgb", *SMALL, "env.train.image_size=[64,64]")
    traj = _collect(ray_local, cfg)
    _check(traj, N=2, T=2, V=1, h=64, A=4, H=8, S=traj[D.STATE].shape[-1])


@pytest.mark.slow
def test_libero_rollout_with_tiny_openvla_through_ray(ray_local, compose_cfg):
    cfg = compose_cfg("env=libero_spatial", *SMALL, "env.train.image_size=[64,64]", "env.eval.image_size=[64,64]")
    traj = _collect(ray_local, cfg)
    _check(traj, N=2, T=2, V=2, h=64, A=7, H=8, S=8)
    # LIBERO's suite: task ids index the suite's 10 instructions
    assert ((traj[D.TASK_ID] >= 0) & (traj[D.TASK_ID] < 10)).all()
