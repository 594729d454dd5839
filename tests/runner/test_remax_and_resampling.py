"""The runner's collection phase on the toy task with the state policy: ReMax's greedy baseline rollout
(from the same episode starts as the sampled one) and re-sampled group filtering; both through the CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodirl import data as D
from embodirl.algorithms.advantages import REWARD_BASELINE
from embodirl.algorithms.filtering import group_keep_mask
from embodirl.config import validate
from embodirl.envs.registry import make_env
from embodirl.errors import ConfigError
from embodirl.models.base import SamplingParams
from embodirl.rollout.collector import RolloutCollector
from embodirl.rollout.inference import PolicyInference
from embodirl.rollout.starts import EpisodeStarts
from embodirl.runner.collection import episode_returns, episode_starts
from embodirl.runner.loop import Runner, worker_config
from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

TOY = ["env=toy_reach", "model=state_mlp", "env.train.state_obs=true", "env.eval.state_obs=true",
       "env.train.reward_mode=dense", "env.train.step_size=0.3", "env.train.num_envs=8", "env.eval.num_envs=4"]


def test_remax_baseline_is_the_greedy_return_from_the_same_starts(compose_cfg, tmp_path):
    cfg = compose_cfg(*TOY, "algorithm.adv_type=remax", f"runner.output_dir={tmp_path}")
    validate(cfg)
    runner = Runner(cfg)
    with runner._workers(train=True) as groups:
        batch, stats = runner._collect(groups, 1, np.random.default_rng(0))
        baseline = D.get_extra(batch, REWARD_BASELINE)                         # (N,)
        assert stats.baseline_s > 0
        # the greedy return from the same starts, by a collector of its own on fresh simulators
        env = make_env(worker_config(cfg).env.train, num_envs=8, seed=int(cfg.runner.seed))
        greedy = RolloutCollector([env], PolicyInference(groups.policy, env.spec.task_descriptions,
                                                         SamplingParams(greedy=True)),
                                  num_decisions=batch.batch_size[1]).collect(episode_starts(batch),
                                                                              seed=runner.seed + 1_000_003)
        env.close()
    torch.testing.assert_close(greedy[D.STATE][:, 0], batch[D.STATE][:, 0])     # the same starts
    torch.testing.assert_close(baseline, episode_returns(greedy))
    assert not torch.equal(baseline, episode_returns(batch))                      # sampled != greedy


def test_remax_refuses_rows_of_several_episodes(compose_cfg):
    with pytest.raises(ConfigError, match="env.train.auto_reset"):
        validate(compose_cfg(*TOY, "algorithm.adv_type=remax", "env.train.auto_reset=true"), check_envs=False)


@pytest.mark.parametrize("over,key", [(["algorithm.filter_groups.resample=true"], "algorithm.filter_groups.resample"),
                                      (["algorithm.filter_groups.max_resample_rounds=-1"],
                                       "algorithm.filter_groups.max_resample_rounds")])
def test_resample_keys_are_checked(compose_cfg, over, key):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*TOY, *over), check_envs=False)
    assert err.value.key == key


GROUPED = [*TOY, "algorithm=grpo", "algorithm.group_size=2", "env.train.use_fixed_reset_state_ids=true",
           "algorithm.filter_groups.enable=true"]


@pytest.mark.parametrize("cap", [0, 6])
def test_resampling_fills_the_batch_with_informative_groups(compose_cfg, tmp_path, cap):
    cfg = compose_cfg(*GROUPED, "algorithm.filter_groups.resample=true",
                      f"algorithm.filter_groups.max_resample_rounds={cap}", f"runner.output_dir={tmp_path}")
    validate(cfg)
    runner = Runner(cfg)
    with runner._workers(train=True) as groups:
        batch, stats = runner._collect(groups, 1, np.random.default_rng(0))
    N = 8
    assert batch.batch_size[0] == N
    keep, _ = group_keep_mask(batch[D.SUCCESS], batch[D.VALID], group_size=2, min_success=0.0, max_success=1.0)
    assert int(keep.sum()) == stats.rollouts_kept
    assert keep[:stats.rollouts_kept].all() and not keep[stats.rollouts_kept:].any()   # informative groups first
    assert stats.rollouts_drawn % N == 0 and N <= stats.rollouts_drawn <= N * (1 + cap)
    if stats.rollouts_drawn < N * (1 + cap):
        assert stats.rollouts_kept == N                   # it stopped early only because the batch was full
    group_id = batch[D.GROUP_ID][:, 0]
    torch.testing.assert_close(group_id, torch.arange(N) // 2)
    if cap:
        assert stats.rollouts_kept > 0


def _cli(args, cwd):
    cli_runs.run(args, cwd, expect=0)


COMMON = ["runner.max_steps=2", "runner.val_check_interval=0", "runner.save_interval=0", "runner.progress_bar=false",
          "runner.logger.tensorboard=false"]


def test_remax_trains_through_the_cli(tmp_path):
    _cli(["train", *TOY, *COMMON, "algorithm.adv_type=remax", "runner.experiment_name=remax"], tmp_path)
    records = read_metrics(tmp_path / "outputs" / "remax" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["time/baseline_rollout"] > 0 and np.isfinite(r["actor/pg_loss"])


def test_resampled_group_filtering_trains_through_the_cli(tmp_path):
    _cli(["train", *GROUPED, *COMMON, "algorithm.filter_groups.resample=true",
          "algorithm.filter_groups.max_resample_rounds=3", "runner.experiment_name=resample"], tmp_path)
    records = read_metrics(tmp_path / "outputs" / "resample" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 8 <= r["train/rollouts_drawn"] <= 32 and 0 <= r["train/rollouts_kept"] <= 8
        # the composition of the groups trained on: the kept ones are mixed (4 groups of 2)
        parts = [r[f"groups/{k}"] for k in ("all_fail", "mixed", "all_success")]
        assert sum(parts) == pytest.approx(1.0) and r["groups/mixed"] == pytest.approx(r["train/rollouts_kept"] / 8)


def test_worker_groups_collect_greedy_baselines_in_evaluation_mode(compose_cfg):
    """The worker groups' path (here in-process): ``greedy=True`` makes one training
    rollout greedy (repeatable), and the next one samples again."""
    from embodirl.workers.groups import WorkerGroups

    cfg = compose_cfg(*TOY, "algorithm.adv_type=remax", "env_workers.num_workers=2")
    starts = EpisodeStarts(np.arange(8) % 4, np.arange(8))
    with WorkerGroups.from_config(cfg, remote=False) as groups:
        a = groups.collect(starts, seed=3, greedy=True)
        sampled = groups.collect(starts, seed=3)
        b = groups.collect(starts, seed=3, greedy=True)
    torch.testing.assert_close(a[D.ACTION_CHUNK], b[D.ACTION_CHUNK])
    assert not torch.equal(a[D.ACTION_CHUNK][:, 0], sampled[D.ACTION_CHUNK][:, 0])


@pytest.mark.slow
def test_remax_trains_through_the_cli_on_ray_workers(tmp_path):
    _cli(["train", *TOY, *COMMON, "algorithm.adv_type=remax", "cluster.use_ray=true", "runner.experiment_name=rr"],
         tmp_path)
    records = read_metrics(tmp_path / "outputs" / "rr" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["time/baseline_rollout"] > 0 and np.isfinite(r["actor/pg_loss"]) for r in records)
