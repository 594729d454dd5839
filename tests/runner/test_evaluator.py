"""Evaluation in this process keeps its simulators between sweeps and replays the same episodes."""

from __future__ import annotations

import imageio.v3 as iio

from embodirl.config import compose
from embodirl.runner.evaluation import run_sweep
from embodirl.runner.loop import Runner

TOY = ["env=toy_reach", "env.eval.state_obs=true", "env.train.state_obs=true", "env.train.num_envs=3",
       "env.eval.num_envs=3", "runner.eval_episodes_per_task=2", "runner.eval_num_videos=2"]


def strip(info: dict) -> list:
    return [(e["episode_ix"], e["task_id"], e["success"], e["return"], e["length"]) for e in info["per_episode"]]


def test_repeated_sweeps_reuse_the_simulators_and_match(tmp_path):
    cfg = compose([*TOY, f"runner.output_dir={tmp_path}"])
    with Runner(cfg)._workers(train=False) as groups:
        first = run_sweep(groups, cfg, out_dir=tmp_path / "a", seed=5)
        workers = list(groups.eval_env.workers)
        envs = [env for worker in workers for env in worker.envs]
        second = run_sweep(groups, cfg, out_dir=tmp_path / "b", seed=5)
        assert list(groups.eval_env.workers) == workers                           # built once
        assert [env for worker in workers for env in worker.envs] == envs
        n = 2 * len(groups.spec.task_descriptions)
    assert groups.eval_env is None and groups.inference is None                 # closed with the groups
    assert first["overall"]["n_episodes"] == second["overall"]["n_episodes"] == n
    assert strip(first) == strip(second)              # greedy, the same seeds and starts: the same episodes
    for info, folder in ((first, tmp_path / "a"), (second, tmp_path / "b")):
        videos = info["overall"]["video_paths"]
        assert len(videos) == 2                                                   # each sweep records again
        assert iio.imread(folder / videos[0]).shape[0] >= 2
