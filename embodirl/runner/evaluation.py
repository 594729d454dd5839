"""Evaluation: run a policy over an env's evaluation sweep and report per-task success.

The sweep is the adapter's ``eval_schedule(cfg)`` (LIBERO: trial k of every task starts from init
state k, 50 trials per task in the standard protocol) or, for adapters without fixed init states,
``num_trials_per_task`` seeded episodes per task. Episodes run in batches of ``num_envs`` without
auto-reset; each episode ends at termination or at the time limit. The first ``num_videos`` episodes
are recorded (every low-level step, with the info overlay). An episode whose simulator crashed and was
replaced (``info["restarted"]``) ends there as a failure and is counted in ``n_crashed``.

Episode ``j`` of the sweep is reset with seed ``seed + j`` (slot ``i`` of the batch starting at ``j - i``),
its ``seed`` in ``eval_info.json``. ``runner.eval_episodes=[j, ...]`` runs only those episodes of the sweep,
each with its video. An episode is fixed by its (task, init state): the adapters seed the scene from them, and
the reset seed only re-seeds the RNG that would draw ids left unset, so a chosen episode plays out as in the
full sweep whichever slot it lands in (its record keeps the sweep's seed).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping, Sequence
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


def protocol_env_cfg(env_cfg: Mapping, protocol: str | None, num_envs: int | None = None) -> dict:
    """``env_cfg`` as ``runner.eval_protocol`` runs it (``oft``: the adapter's OFT seeding switched on), with
    ``runner.eval_num_envs`` simulators when set. An episode's outcome does not depend on which slot or batch
    runs it (scenes are seeded from (task, init state), actions are greedy), so the sweep's per-episode
    results are the same at any number of simulators (``tests/runner/test_eval_report.py``)."""
    out = dict(env_cfg)
    if protocol == "oft":
        key, value = OFT_SEEDING[out["adapter"]]
        out[key] = value
    if num_envs is not None:
        out["num_envs"] = int(num_envs)
    return out


def check_eval_num_envs(runner_cfg: Mapping) -> None:
    """``runner.eval_num_envs``: null (``env.eval.num_envs``) or a positive number of simulators."""
    n = runner_cfg.get("eval_num_envs")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError("runner.eval_num_envs", f"must be null (env.eval.num_envs) or a positive number of "
                                                  f"simulators, got {n!r}")


def check_eval_episodes(runner_cfg: Mapping) -> list[int] | None:
    """``runner.eval_episodes``: null or a list of sweep indices (``episode_ix`` in ``eval_info.json``)."""
    ids = runner_cfg.get("eval_episodes")
    if ids is None:
        return None
    if isinstance(ids, int) and not isinstance(ids, bool):
        ids = [ids]
    if isinstance(ids, str) or not isinstance(ids, Sequence) or not ids or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ConfigError("runner.eval_episodes", f"must be null or a non-empty list of episode indices "
                                                  f"(episode_ix in eval_info.json, >= 0), got {ids!r}")
    return sorted({int(i) for i in ids})


def select_episodes(schedule: list[tuple[int, int]], ids: list[int] | None) -> list[tuple[int, int, int]]:
    """``(episode_ix, task_id, init_state_id)`` of the sweep, or of its episodes ``ids`` only."""
    if ids is None:
        return [(j, t, k) for j, (t, k) in enumerate(schedule)]
    beyond = [j for j in ids if j >= len(schedule)]
    if beyond:
        raise ConfigError("runner.eval_episodes", f"episode {beyond[0]} is beyond the sweep's {len(schedule)} "
                                                  f"episodes (0..{len(schedule) - 1})")
    return [(j, *schedule[j]) for j in ids]


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
                 num_videos: int = 0, episodes: list[int] | None = None):
        cfg = copy.deepcopy(dict(env_cfg))
        cfg["auto_reset"] = False
        if episodes_per_task is not None:
            cfg["num_trials_per_task"] = int(episodes_per_task)
        self.B = int(cfg["num_envs"])
        self.episodes = episodes              # runner.eval_episodes: these sweep indices only, every one recorded
        if episodes is not None:
            num_videos = self.B
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
        schedule = select_episodes(eval_schedule(cfg, len(spec.task_descriptions)), self.episodes)
        H = policy.action_chunk
        T = max_decisions or -(-spec.max_episode_steps // H)
        sampling = SamplingParams(greedy=greedy, temperature=temperature)
        recorder = None
        if num_videos:
            env.record_env_ids = list(range(num_videos))
            # files straight in <out_dir>/videos/: out_dir is already the evaluation's step folder
            recorder = VideoRecorder.for_env(env, Path(out_dir) / "videos", cfg["video"], step=None)
        results: list[EpisodeResult] = []
        for start in range(0, len(schedule), B):
            part = schedule[start:start + B]
            n = len(part)
            padded = part + [part[-1]] * (B - n)             # keep the batch full; extra rows are dropped
            task_ids = np.asarray([t for _, t, _ in padded], np.int64)
            init_ids = np.asarray([k for _, _, k in padded], np.int64)
            batch_seed = seed + part[0][0]                   # slot i: seed + episode_ix in the whole sweep
            obs, info = env.reset(task_ids=task_ids, init_state_ids=init_ids, seed=batch_seed)
            if recorder is not None:
                recorder.on_reset(info)
            alive = np.ones(B, bool)
            written: list[Path] = []
            success = np.zeros(B, bool)
            crashed = np.zeros(B, bool)
            ret = np.zeros(B, np.float64)
            max_reward = np.full(B, -np.inf)
            length = np.zeros(B, np.int64)
            for _ in range(T):
                out = act(policy, obs, spec.task_descriptions, sampling)
                obs, reward, terminated, truncated, info = env.step(out["action_chunk"])
                step_rewards = np.asarray(reward, np.float64).reshape(B, -1)           # (B, H)
                executed = np.arange(step_rewards.shape[1])[None, :] < np.asarray(info["steps"])[:, None]
                chunk_max = np.where(executed, step_rewards, -np.inf).max(axis=1)      # (B,)
                ret += np.where(alive, step_rewards.sum(axis=1), 0.0)
                max_reward = np.where(alive, np.maximum(max_reward, chunk_max), max_reward)
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
                if self.episodes is None:                    # video only for the first batch (chosen
                    env.record_env_ids = []                  # episodes: every batch, one recorder, so
                    recorder = None                          # that file names keep counting)
            for i in range(n):
                episode_ix, task_id, init_id = part[i]
                results.append(EpisodeResult(
                    suite=spec.name, task_id=task_id, task=spec.task_descriptions[task_id], init_state_id=init_id,
                    success=bool(success[i]), episode_return=float(ret[i]), length=int(length[i]),
                    video_path=videos.get(i), crashed=bool(crashed[i]), seed=seed + episode_ix,
                    max_reward=float(max_reward[i]) if np.isfinite(max_reward[i]) else None, episode_ix=episode_ix))
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
