"""Evaluation: run a policy over an env's evaluation sweep and report per-task success.

The sweep is the adapter's ``eval_schedule(cfg)`` (LIBERO: trial k of every task starts from init
state k, 50 trials per task in the standard protocol) or, for adapters without fixed init states,
``num_trials_per_task`` seeded episodes per task. Episodes run in batches of ``num_envs`` without
auto-reset; each episode ends at termination or at the time limit. The first ``num_videos`` episodes
are recorded (every low-level step, with the info overlay). An episode whose simulator crashed and was
replaced (``info["restarted"]``) ends there as a failure and is counted in ``n_crashed``.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from embodirl.envs.registry import get_adapter, make_env
from embodirl.envs.video import VideoRecorder
from embodirl.errors import ConfigError
from embodirl.models.base import Policy, SamplingParams
from embodirl.rollout.inference import act
from embodirl.runner.eval_report import EpisodeResult, build_eval_info

log = logging.getLogger(__name__)


#: runner.eval_protocol: parallel (the adapters' own deterministic seeding) | oft (OpenVLA-OFT's LIBERO seeding)
EVAL_PROTOCOLS = ("parallel", "oft")
#: adapters that can reproduce OFT's seeding, and the env key that selects it
OFT_SEEDING = {"libero": ("scene_seeding", "oft")}


def check_eval_protocol(runner_cfg: Mapping, eval_env_cfg: Mapping) -> None:
    """``runner.eval_protocol`` names a protocol the evaluation env supports (one ConfigError sentence)."""
    protocol = runner_cfg.get("eval_protocol", EVAL_PROTOCOLS[0])
    if protocol not in EVAL_PROTOCOLS:
        raise ConfigError("runner.eval_protocol", f"'{protocol}' is not one of {', '.join(EVAL_PROTOCOLS)}")
    if protocol == "oft" and eval_env_cfg.get("adapter") not in OFT_SEEDING:
        raise ConfigError("runner.eval_protocol", f"oft reproduces OpenVLA-OFT's LIBERO evaluation; env.eval uses "
                                                  f"the '{eval_env_cfg.get('adapter')}' adapter, so use parallel")


def protocol_env_cfg(env_cfg: Mapping, protocol: str | None) -> dict:
    """``env_cfg`` as ``runner.eval_protocol`` runs it (``oft``: the adapter's OFT seeding switched on)."""
    out = dict(env_cfg)
    if protocol == "oft":
        key, value = OFT_SEEDING[out["adapter"]]
        out[key] = value
    return out


def eval_schedule(env_cfg: Mapping, num_tasks: int) -> list[tuple[int, int]]:
    """Ordered ``(task_id, init_state_id)`` pairs of the sweep."""
    adapter = get_adapter(env_cfg["adapter"])
    if hasattr(adapter, "eval_schedule"):
        return list(adapter.eval_schedule(env_cfg))
    tasks = env_cfg.get("task_ids") or range(num_tasks)
    trials = env_cfg.get("init_state_ids") or range(int(env_cfg["num_trials_per_task"]))
    return [(int(t), int(k)) for t in tasks for k in trials]


class Evaluator:
    """Runs the evaluation sweep of ``env_cfg`` again and again on one set of simulators.

    The env batch is built on the first :meth:`run` and kept until :meth:`close`, so periodic
    evaluation during training does not pay the simulators' start-up (ManiSkill: shader compilation
    and scene building, seconds per process) every time. Every run replays the same sweep with the
    same seeds, so successive evaluations measure the same episodes.
    """

    def __init__(self, env_cfg: Mapping, *, seed: int = 0, episodes_per_task: int | None = None,
                 num_videos: int = 0):
        cfg = copy.deepcopy(dict(env_cfg))
        cfg["auto_reset"] = False
        if episodes_per_task is not None:
            cfg["num_trials_per_task"] = int(episodes_per_task)
        self.B = int(cfg["num_envs"])
        self.num_videos = min(int(num_videos), self.B)
        cfg["video"] = {**dict(cfg.get("video") or {}), "enabled": self.num_videos > 0,
                        "env_ids": list(range(self.num_videos))}
        self.cfg = cfg
        self.seed = int(seed)
        self.env = None

    def _env(self):
        if self.env is None:
            self.env = make_env(self.cfg, num_envs=self.B, seed=self.seed)
        return self.env

    def run(self, policy: Policy, *, out_dir: str | Path, step: int = 0, greedy: bool = True,
            temperature: float = 1.0, max_decisions: int | None = None) -> dict:
        """One sweep; returns the ``eval_info`` dict (see :mod:`embodirl.runner.eval_report`)."""
        cfg, B, seed, num_videos = self.cfg, self.B, self.seed, self.num_videos
        t_start = time.perf_counter()
        env = self._env()
        spec = env.spec
        schedule = eval_schedule(cfg, len(spec.task_descriptions))
        H = policy.action_chunk
        T = max_decisions or -(-spec.max_episode_steps // H)
        sampling = SamplingParams(greedy=greedy, temperature=temperature)
        recorder = None
        if num_videos:
            env.record_env_ids = list(range(num_videos))
            recorder = VideoRecorder.for_env(env, Path(out_dir) / "videos", cfg["video"], step=step)
        results: list[EpisodeResult] = []
        for start in range(0, len(schedule), B):
            part = schedule[start:start + B]
            n = len(part)
            padded = part + [part[-1]] * (B - n)             # keep the batch full; extra rows are dropped
            task_ids = np.asarray([t for t, _ in padded], np.int64)
            init_ids = np.asarray([k for _, k in padded], np.int64)
            obs, info = env.reset(task_ids=task_ids, init_state_ids=init_ids, seed=seed + start)
            if recorder is not None:
                recorder.on_reset(info)
            alive = np.ones(B, bool)
            written: list[Path] = []
            success = np.zeros(B, bool)
            crashed = np.zeros(B, bool)
            ret = np.zeros(B, np.float64)
            length = np.zeros(B, np.int64)
            for _ in range(T):
                out = act(policy, obs, spec.task_descriptions, sampling)
                obs, reward, terminated, truncated, info = env.step(out["action_chunk"])
                chunk_reward = np.asarray(reward, np.float64).reshape(B, -1).sum(axis=1)
                ret += np.where(alive, chunk_reward, 0.0)
                length += np.where(alive, np.asarray(info["steps"]), 0)
                # a simulator replaced mid-episode lost that episode: it ends as a failure, as OFT's
                # run_libero_eval.py counts an episode whose simulator raised
                lost = alive & np.asarray(info.get("restarted", np.zeros(B, bool)), bool)
                crashed |= lost
                alive &= ~lost
                success |= alive & np.asarray(info["success"], bool)
                if recorder is not None:
                    written += recorder.on_step(reward, terminated, truncated, info)
                alive &= ~(np.asarray(terminated, bool) | np.asarray(truncated, bool))
                if not alive.any():
                    break
            videos: dict[int, str] = {}
            if recorder is not None:
                written += recorder.flush()
                for path in written:
                    name = path.name
                    for i in range(num_videos):
                        if f"_env{i}_" in name and i not in videos:
                            videos[i] = str(Path(path).relative_to(out_dir))
                env.record_env_ids = []                      # video only for the first batch
                recorder = None
            for i in range(n):
                task_id, init_id = part[i]
                results.append(EpisodeResult(
                    suite=spec.name, task_id=task_id, task=spec.task_descriptions[task_id], init_state_id=init_id,
                    success=bool(success[i]), episode_return=float(ret[i]), length=int(length[i]),
                    video_path=videos.get(i), crashed=bool(crashed[i])))
            log.info("eval: %d/%d episodes, success so far %.3f", len(results), len(schedule),
                     np.mean([r.success for r in results]))
        return build_eval_info(results, eval_s=time.perf_counter() - t_start)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
