"""A simulator that crashes mid-episode during evaluation: the episode counts as a failure (as OFT's
run_libero_eval.py counts an episode whose simulator raised) and eval_info.json reports it."""

from __future__ import annotations

import json

import torch
from omegaconf import OmegaConf

from embodirl import data as D
from embodirl.config import compose
from embodirl.envs.registry import make_env
from embodirl.models.registry import make_policy
from embodirl.runner.eval_report import write_eval_info
from embodirl.runner.evaluation import Evaluator


class CrashFirstEnv(torch.nn.Module):
    """Acts like ``policy`` but sends a NaN action to env row 0 at the first decision of each sweep, which
    makes the toy simulator's state non-finite: the vector env replaces it (``info["restarted"]``)."""

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


def test_crashed_episode_is_a_failure_and_counted(tmp_path):
    cfg = compose(["env=toy_reach", "env.eval.num_envs=2", "env.eval.state_obs=true", "env.train.state_obs=true",
                   "env.eval.num_tasks=1"])
    env_cfg = OmegaConf.to_container(cfg.env.eval, resolve=True)
    probe = make_env(env_cfg, num_envs=1, seed=0)
    spec = probe.spec
    probe.close()
    torch.manual_seed(0)
    policy = CrashFirstEnv(make_policy(cfg.model, spec))
    with Evaluator(env_cfg, seed=3, episodes_per_task=2) as evaluator:
        info = evaluator.run(policy, out_dir=tmp_path, greedy=True)
    episodes = info["per_episode"]
    assert [e["crashed"] for e in episodes] == [True, False]
    assert episodes[0]["success"] is False
    assert info["overall"]["n_crashed"] == 1 and info["overall"]["n_rerun_after_crash"] == 0
    written = json.loads(write_eval_info(info, tmp_path).read_text())
    assert written["overall"]["n_crashed"] == 1
