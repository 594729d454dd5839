"""Worker groups with zero remote workers (every worker an object in this process): the layout of
slots over env workers and stages, evaluation with greedy sampling and video, offload hooks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodirl import data as D
from embodirl.errors import ConfigError
from embodirl.rollout.starts import EpisodeStarts
from embodirl.workers.groups import WorkerGroups
from embodirl.workers.layout import layout_from_config


def _cfg(compose_cfg, *overrides):
    return compose_cfg("env=toy_reach", "model=state_mlp", "env.train.state_obs=true", "env.eval.state_obs=true",
                       *overrides)


def test_layout_follows_the_config(compose_cfg):
    cfg = _cfg(compose_cfg, "env.train.num_envs=12", "env_workers.num_workers=3", "rollout.pipeline_stage_num=2",
               "rollout.num_workers=2", "env.eval.num_envs=6", "actor.global_batch_size=12",
               "actor.micro_batch_size=4")
    layout = layout_from_config(cfg)
    assert (layout.num_env_workers, layout.num_stages, layout.envs_per_stage) == (3, 2, 2)
    assert layout.num_decisions == 6 and layout.num_slots == 12
    assert [layout.inference_worker_of(k) for k in range(3)] == [0, 1, 0]
    evaluation = layout_from_config(cfg, "env.eval")
    assert (evaluation.num_env_workers, evaluation.num_stages, evaluation.envs_per_stage) == (3, 1, 2)
    with pytest.raises(ConfigError, match="env.train.num_envs"):
        layout_from_config(_cfg(compose_cfg, "env.train.num_envs=5", "env_workers.num_workers=2"))


def test_in_process_groups_collect_evaluate_and_record_video(compose_cfg, tmp_path):
    cfg = _cfg(compose_cfg, "env.train.num_envs=8", "env_workers.num_workers=2", "rollout.pipeline_stage_num=2",
               "actor.global_batch_size=8", "env.eval.num_envs=4", "env.eval.video.enabled=true",
               "env.eval.video.env_ids=[0,3]", "rollout.enable_offload=true", "env_workers.enable_offload=true")
    with WorkerGroups.from_config(cfg, remote=False) as groups:
        traj = groups.collect()
        D.validate(traj)
        assert traj.batch_size == torch.Size([8, 6])
        assert (traj[D.GROUP_ID][:, 0] == torch.arange(8)).all()
        assert D.VALUE in traj.keys() and D.BOOTSTRAP_VALUE in traj[D.EXTRAS].keys()   # PPO: values
        starts = EpisodeStarts(np.array([0, 1, 2, 3]), np.array([4, 5, 6, 7]))
        first = groups.evaluate(starts, video_dir=tmp_path, step=3)
        written = sorted(groups.videos)
        second = groups.evaluate(starts)
        assert groups.videos == []
        assert first.batch_size == torch.Size([4, 6])
        assert D.VALUE not in first.keys()                                            # evaluation: no critic
        torch.testing.assert_close(first[D.ACTION_CHUNK], second[D.ACTION_CHUNK])     # greedy sampling
        assert (first[D.TASK_ID][:, 0].numpy() == starts.task_ids).all()
        videos = sorted(p.name for p in (tmp_path / "step_3").glob("*.mp4"))
        assert len(videos) == 2 and {v.split("_env")[1][0] for v in videos} == {"0", "3"}
        assert written == sorted(str(p) for p in (tmp_path / "step_3").glob("*.mp4"))


def test_evaluation_only_groups_publish_weights_and_count_executed_steps(compose_cfg):
    # 10 low-level steps in chunks of 4: the third chunk executes only 2 of its actions
    cfg = _cfg(compose_cfg, "env.eval.num_envs=2", "env.eval.max_episode_steps=10")
    seen = []

    def policy_for(spec):
        from embodirl.models.registry import make_policy

        seen.append(spec.name)
        return make_policy(cfg.model, spec)

    with WorkerGroups.from_config(cfg, remote=False, policy_for=policy_for, train=False) as groups:
        assert seen == ["toy_reach"] and groups.env is None
        with pytest.raises(RuntimeError, match="evaluation only"):
            groups.collect()
        starts = EpisodeStarts(np.array([0, 1]), np.array([0, 0]))
        before = groups.evaluate(starts, seed=3)
        assert before.batch_size == torch.Size([2, 3])
        assert (before[D.EXECUTED] & before[D.VALID][..., None]).sum(dim=(1, 2)).tolist() == [10, 10]
        policy = groups.inference.workers[0].engine.policy
        weights = {k: v + 1.0 for k, v in policy.trainable_state_dict().items()}
        assert groups.inference.publish_weights(weights, version=5, full=True) == 5
        after = groups.evaluate(starts, seed=3)
        assert (after[D.WEIGHT_VERSION] == 5).all()
        assert not torch.allclose(after[D.ACTION_CHUNK], before[D.ACTION_CHUNK])
