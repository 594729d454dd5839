"""A simulator that crashes mid-episode during evaluation: the collector runs that episode again from its
start, as in training, so the report holds the episode as it plays out without the crash and counts the
re-run (``n_rerun_after_crash``)."""

from __future__ import annotations

import json

import torch

from embodirl import data as D
from embodirl.config import compose
from embodirl.runner.eval_report import write_eval_info
from embodirl.runner.evaluation import run_sweep
from embodirl.runner.loop import Runner
from tests import cli_runs


class CrashFirstEnv(torch.nn.Module):
    """Acts like ``policy`` but sends a NaN action to env row 0 at its first decision, which makes the toy
    simulator's state non-finite: the vector env replaces it (``info["restarted"]``)."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.action_chunk = policy.action_chunk
        self.calls = 0

    def act(self, obs, sampling, return_value=False):
        out = self.policy.act(obs, sampling, return_value=return_value)
        if self.calls == 0:
            out[D.ACTION_CHUNK] = out[D.ACTION_CHUNK].clone()
            out[D.ACTION_CHUNK][0, 0, 0] = float("nan")
        self.calls += 1
        return out


def test_crashed_episode_is_run_again_and_counted(tmp_path):
    cfg = compose(["env=toy_reach", "env.eval.num_envs=2", "env.eval.state_obs=true", "env.train.state_obs=true",
                   "env.train.num_envs=2", "env.eval.num_tasks=1", "env.eval.reward_mode=dense",
                   "runner.eval_episodes_per_task=2", "runner.eval_num_videos=0", f"runner.output_dir={tmp_path}"])
    torch.manual_seed(0)
    with Runner(cfg)._workers(train=False) as groups:
        clean = run_sweep(groups, cfg, out_dir=tmp_path / "clean", seed=3)
        groups.inference.workers[0].engine.policy = CrashFirstEnv(groups.policy)
        info = run_sweep(groups, cfg, out_dir=tmp_path / "crash", seed=3)
    assert info["overall"]["n_rerun_after_crash"] == 1 and clean["overall"]["n_rerun_after_crash"] == 0
    # the re-run episode is the one the sweep would have run
    assert info["per_episode"] == clean["per_episode"]
    written = json.loads(write_eval_info(info, tmp_path).read_text())
    assert written["overall"]["n_rerun_after_crash"] == 1


def test_an_episode_that_always_crashes_counts_as_a_failure_and_the_sweep_finishes(tmp_path):
    """The toy simulator crashes at the second chunk of every episode from init state 2, on every re-run (as a
    MuJoCo instability the policy's greedy actions cause would). `embodirl eval` finishes the sweep: each such
    episode is a failure marked crashed, per episode, per task and overall, and the console table shows it."""

    proc = cli_runs.run(["eval", "env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true",
                         "env.eval.num_envs=4", "env.eval.crash_init_state=2", "runner.eval_episodes_per_task=4",
                         "runner.eval_num_videos=0", "runner.experiment_name=crash"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((tmp_path / "outputs" / "crash" / "eval_info.json").read_text())
    assert info["overall"]["n_episodes"] == 16 and info["overall"]["crashed"] == 4
    crashed = [e for e in info["per_episode"] if e["crashed"]]
    assert sorted(e["init_state_id"] for e in crashed) == [2, 2, 2, 2] and not any(e["success"] for e in crashed)
    assert [t["crashed"] for t in info["per_task"]] == [1, 1, 1, 1]
    assert "crashed" in proc.stdout and "they count as failures" in proc.stdout + proc.stderr
