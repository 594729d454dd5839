"""The evaluator keeps its simulators between sweeps and replays the same episodes."""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import torch
from omegaconf import OmegaConf

from embodirl.config import compose
from embodirl.envs.registry import make_env
from embodirl.models.registry import make_policy
from embodirl.runner.evaluation import Evaluator


def toy_policy(num_envs: int):
    """The toy task's eval config (state observations) and a fresh state policy for it."""
    cfg = compose(["env=toy_reach", f"env.eval.num_envs={num_envs}", "env.eval.state_obs=true",
                   "env.train.state_obs=true"])
    env_cfg = OmegaConf.to_container(cfg.env.eval, resolve=True)
    probe = make_env(env_cfg, num_envs=1, seed=0)
    spec = probe.spec
    probe.close()
    torch.manual_seed(0)
    return env_cfg, spec, make_policy(cfg.model, spec)


def test_repeated_sweeps_reuse_the_simulators_and_match(tmp_path):
    env_cfg, spec, policy = toy_policy(3)
    with Evaluator(env_cfg, seed=5, episodes_per_task=2, num_videos=2) as evaluator:
        first = evaluator.run(policy, out_dir=tmp_path / "a", step=1, greedy=False)
        env = evaluator.env
        pids = list(env.pids)
        second = evaluator.run(policy, out_dir=tmp_path / "b", step=2, greedy=False)
        assert evaluator.env is env and list(env.pids) == pids          # built once
    assert evaluator.env is None
    n = 2 * len(spec.task_descriptions)
    assert first["overall"]["n_episodes"] == second["overall"]["n_episodes"] == n
    # the same seeds and starts each sweep: identical episodes (sampling noise is seeded per sweep by torch)
    returns = [e["avg_return"] for e in first["per_task"]]
    assert np.isfinite(returns).all()
    for info, folder in ((first, tmp_path / "a"), (second, tmp_path / "b")):
        videos = info["overall"]["video_paths"]
        assert len(videos) == 2                                           # each sweep records again
        assert iio.imread(folder / videos[0]).shape[0] >= 2


def test_greedy_sweeps_are_identical(tmp_path):
    env_cfg, _, policy = toy_policy(4)
    with Evaluator(env_cfg, seed=3, episodes_per_task=1) as evaluator:
        a = evaluator.run(policy, out_dir=tmp_path, step=0)
        b = evaluator.run(policy, out_dir=tmp_path, step=1)
    strip = lambda info: [(e["task_id"], e["success_rate"], e["avg_return"], e["avg_length"]) for e in info["per_task"]]
    assert strip(a) == strip(b)
