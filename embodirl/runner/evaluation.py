"""Evaluation: the training collector run over an env's evaluation sweep with evaluation sampling, and
one report of per-task success.

The sweep is the adapter's ``eval_schedule(cfg)`` (LIBERO: trial k of every task starts from init
state k, 50 trials per task in the standard protocol) or, for adapters without fixed init states,
``num_trials_per_task`` seeded episodes per task. :func:`run_sweep` runs it in batches of ``num_envs``
slots on the evaluation env workers of a :class:`~embodirl.workers.groups.WorkerGroups` (in this process
or Ray workers: the same code), which collect with the training
:class:`~embodirl.rollout.collector.RolloutCollector` without auto-reset, every episode to termination or
its time limit, the inference workers sampling with the evaluation parameters
(:func:`~embodirl.workers.inference_worker.sampling_from_config`: greedy with ``runner.eval_greedy``, else
``rollout.temperature``, ``rollout.top_k``, ``rollout.top_p``).
:func:`episode_results` turns each batch into :class:`~embodirl.runner.eval_report.EpisodeResult` rows and
:func:`~embodirl.runner.eval_report.build_eval_info` builds the report. The first ``runner.eval_num_videos``
episodes are recorded (every low-level step, with the info overlay).

An episode whose simulator crashed and was replaced mid-way (``info["restarted"]``) is collected again
from its start by the collector, as in training (``n_rerun_after_crash`` in ``eval_info.json``). An episode
that crashes its simulator on every re-run (a MuJoCo instability the policy's own greedy actions cause) does
not end the sweep: it counts as a failure, as OpenVLA-OFT's ``run_libero_eval.py`` counts an episode that
raised (``run_episode``'s ``except Exception``, moojink/openvla-oft @213c5ff8), and is reported as
``crashed`` per episode, per task and overall.

Evaluation runs the benchmark's evaluation states (LIBERO's official init states, ManiSkill's seeds from 0), apart from
the ones training starts from (:mod:`embodirl.runner.heldout`). With ``runner.eval_train_states_per_task = N`` the sweep
also runs the first N training states of every trained task, reported apart (``training_states`` in
``eval_info.json``, :func:`~embodirl.runner.eval_report.build_eval_info`): success on starts the policy was trained
from beside success on held-out ones.

Episode ``j`` of the sweep is reset with seed ``seed + j`` (slot ``i`` of the batch starting at ``j - i``),
its ``seed`` in ``eval_info.json``. ``runner.eval_episodes=[j, ...]`` runs only those episodes of the sweep,
each with its video. An episode is fixed by its (task, init state): the adapters seed the scene from them, and
the reset seed only re-seeds the RNG that would draw ids left unset, so a chosen episode plays out as in the
full sweep whichever slot it lands in (its record keeps the sweep's seed).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import numpy as np

from embodirl import data as D
from embodirl.envs.base import CommonEnvConfig
from embodirl.envs.registry import get_adapter
from embodirl.errors import ConfigError
from embodirl.rollout.starts import EpisodeStarts
from embodirl.runner import heldout
from embodirl.runner.eval_report import EpisodeResult, build_eval_info
from embodirl.schema import Config, run_config
from embodirl.schema.sections import (
    EVAL_PROTOCOLS,  # parallel (the adapters' seeding) | oft (OFT's LIBERO seeding)
    RunnerSection,
)

log = logging.getLogger(__name__)


#: adapters that can reproduce OFT's seeding, and the env key that selects it
OFT_SEEDING = {"libero": ("scene_seeding", "oft")}


def check_eval_protocol(runner: RunnerSection, eval_env: CommonEnvConfig) -> None:
    """``runner.eval_protocol`` names a protocol the evaluation env supports (one ConfigError sentence)."""
    protocol = runner.eval_protocol
    if protocol not in EVAL_PROTOCOLS:
        raise ConfigError("runner.eval_protocol", f"'{protocol}' is not one of {', '.join(EVAL_PROTOCOLS)}")
    if protocol == "oft" and eval_env.adapter not in OFT_SEEDING:
        raise ConfigError("runner.eval_protocol", f"oft reproduces OpenVLA-OFT's LIBERO evaluation; env.eval uses "
                                                  f"the '{eval_env.adapter}' adapter, so use parallel")


def protocol_env_cfg(env: CommonEnvConfig, protocol: str | None, num_envs: int | None = None) -> CommonEnvConfig:
    """``env`` (a typed env split) as ``runner.eval_protocol`` runs it (``oft``: the adapter's OFT seeding switched
    on), with ``runner.eval_num_envs`` simulators when set. An episode's outcome does not depend on which slot or batch
    runs it (scenes are seeded from (task, init state), actions are greedy), so the sweep's per-episode
    results are the same at any number of simulators, returns up to float rounding (another batch size may sum
    in another order; ``tests/runner/test_eval_report.py``)."""
    changes: dict[str, Any] = {}
    if protocol == "oft":
        key, value = OFT_SEEDING[env.adapter]
        changes[key] = value
    if num_envs is not None:
        changes["num_envs"] = num_envs
    return dataclasses.replace(env, **changes)


def check_eval_num_envs(runner: RunnerSection) -> None:
    """``runner.eval_num_envs``: null (``env.eval.num_envs``) or a positive number of simulators."""
    n = runner.eval_num_envs
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError("runner.eval_num_envs", f"must be null (env.eval.num_envs) or a positive number of "
                                                  f"simulators, got {n!r}")


def check_eval_episodes(runner: RunnerSection) -> list[int] | None:
    """``runner.eval_episodes``: null or a list of sweep indices (``episode_ix`` in ``eval_info.json``)."""
    ids = runner.eval_episodes
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


def eval_schedule(env: CommonEnvConfig, num_tasks: int) -> list[tuple[int, int]]:
    """Ordered ``(task_id, init_state_id)`` pairs of the sweep."""
    adapter = get_adapter(env.adapter)
    if hasattr(adapter, "eval_schedule"):
        return list(adapter.eval_schedule(env))
    tasks = env.task_subset or range(num_tasks)
    trials = env.init_state_ids or range(env.num_trials_per_task)
    return [(int(t), int(k)) for t in tasks for k in trials]


def eval_env_cfg(cfg: Config) -> CommonEnvConfig:
    """``env.eval`` (typed) as evaluation runs it: ``runner.eval_protocol``'s seeding and ``runner.eval_num_envs``
    simulators, one episode per slot (no auto-reset), ``runner.eval_episodes_per_task`` trials per task when
    set, the first ``runner.eval_num_videos`` slots recorded (every slot with ``runner.eval_episodes``), and
    ``env.train``'s training-state keys (``training_state_keys``: the training states it names are the ones training
    started from). ``cfg``: the typed config (a composed one is converted)."""
    cfg = run_config(cfg)
    r = cfg.runner
    env = protocol_env_cfg(cfg.env.eval, r.eval_protocol, r.eval_num_envs)
    train = cfg.env.train
    if type(train) is type(env) and train.training_state_keys:
        env = dataclasses.replace(env, **{key: getattr(train, key) for key in train.training_state_keys})
    trials = env.num_trials_per_task if r.eval_episodes_per_task is None else r.eval_episodes_per_task
    num_videos = min(r.eval_num_videos, env.num_envs)
    if check_eval_episodes(r) is not None:               # chosen episodes: every one with its video
        num_videos = env.num_envs
    video = dataclasses.replace(env.video, enabled=num_videos > 0, env_ids=list(range(num_videos)))
    return dataclasses.replace(env, auto_reset=False, num_trials_per_task=trials, video=video)


def run_sweep(groups, cfg: Config, *, out_dir: str | Path, seed: int) -> dict:
    """The evaluation sweep on ``groups``' evaluation env workers (:meth:`WorkerGroups.evaluate
    <embodirl.workers.groups.WorkerGroups.evaluate>`: the training collector with the inference workers'
    evaluation sampling), in batches of the evaluation env's ``num_envs`` slots; returns the ``eval_info``
    dict. The first batch's first ``runner.eval_num_videos`` episodes are recorded (with
    ``runner.eval_episodes``: every chosen episode) straight into ``out_dir/videos``."""
    t_start = time.perf_counter()
    results, reruns = sweep_episodes(groups, cfg, out_dir=out_dir, seed=seed)
    info = build_eval_info(results, eval_s=time.perf_counter() - t_start, rerun_after_crash=reruns)
    cfg = run_config(cfg)
    env = eval_env_cfg(cfg)
    states = heldout.check_states(cfg, env)
    info["init_states"] = {"disjoint": states.disjoint, "detail": states.detail}
    per_task = cfg.runner.eval_train_states_per_task
    if per_task and check_eval_episodes(cfg.runner) is None:          # chosen episodes replay the sweep's own
        t_train = time.perf_counter()
        first = len(results)
        train = [(first + j, t, k) for j, (t, k) in enumerate(heldout.train_schedule(cfg, env, per_task))]
        no_video = dataclasses.replace(env, video=dataclasses.replace(env.video, enabled=False, env_ids=[]))
        train_results, train_reruns = _run_schedule(groups, no_video, groups.eval_spec(), train, Path(out_dir).resolve(),
                                                    seed, False)
        info["training_states"] = build_eval_info(train_results, eval_s=time.perf_counter() - t_train,
                                                  rerun_after_crash=train_reruns)
    return info


def sweep_schedule(groups, cfg: Config) -> list[tuple[int, int, int]]:
    """``(episode_ix, task_id, init_state_id)`` of the evaluation sweep ``cfg`` runs on ``groups`` (its episodes
    ``runner.eval_episodes`` only, when set)."""
    cfg = run_config(cfg)
    schedule = eval_schedule(eval_env_cfg(cfg), len(groups.eval_spec().task_descriptions))
    return select_episodes(schedule, check_eval_episodes(cfg.runner))


def sweep_episodes(groups, cfg: Config, *, out_dir: str | Path, seed: int, episodes: Sequence[int] | None = None,
                   videos: bool = True) -> tuple[list[EpisodeResult], int]:
    """:func:`run_sweep`'s episodes and how many a simulator crash made the collector run again. ``episodes``: only
    these ``episode_ix`` of :func:`sweep_schedule`, in this order (``embodirl compare`` runs the sweep in parts);
    each plays out as in the whole sweep (see module docstring). ``videos=False``: none recorded."""
    out_dir = Path(out_dir).resolve()                    # the workers' cwd may differ
    cfg = run_config(cfg)
    env = eval_env_cfg(cfg)
    spec = groups.eval_spec()
    chosen = check_eval_episodes(cfg.runner)
    schedule = sweep_schedule(groups, cfg)
    if episodes is not None:
        by_ix = {j: (j, t, k) for j, t, k in schedule}
        schedule = [by_ix[j] for j in episodes]
    if not videos:
        env = dataclasses.replace(env, video=dataclasses.replace(env.video, enabled=False, env_ids=[]))
    return _run_schedule(groups, env, spec, schedule, out_dir, seed, chosen is not None)


def _run_schedule(groups, env: CommonEnvConfig, spec, schedule: list[tuple[int, int, int]], out_dir: Path, seed: int,
                  every_video: bool) -> tuple[list[EpisodeResult], int]:
    """``(episode_ix, task_id, init_state_id)`` rows in batches of ``env.num_envs`` slots; the results and the number
    of episodes a simulator crash made the collector run again. Videos: the first batch's, or every batch's
    (``every_video``), when ``env`` records any."""
    N = env.num_envs
    num_videos = len(env.video.env_ids) if env.video.enabled else 0
    results: list[EpisodeResult] = []
    reruns = 0
    for start in range(0, len(schedule), N):
        part = schedule[start:start + N]
        padded = part + [part[-1]] * (N - len(part))     # keep every slot busy; extra rows are dropped
        starts = EpisodeStarts(np.asarray([t for _, t, _ in padded], np.int64),
                               np.asarray([k for _, _, k in padded], np.int64))
        video_dir = str(out_dir / "videos") if (start == 0 or every_video) and num_videos else None
        batch_seed = seed + part[0][0]                   # slot i: seed + episode_ix in the whole sweep
        # step=None: the files go straight into <out_dir>/videos/ (out_dir is the evaluation's step folder)
        traj = groups.evaluate(starts, seed=batch_seed, video_dir=video_dir, step=None)
        # the collector runs an episode a simulator crash cut short again from its start: count them; an episode
        # that crashed on every re-run is kept and counts as a failure
        stats = groups.eval_env.last_stats()
        reruns += sum(s.recollected_rows for s in stats)
        crashed = {slot for s in stats for slot in s.crashed_slots}
        recorded = _videos_by_slot(groups.eval_env.videos if video_dir else [], num_videos, out_dir)
        results += episode_results(traj, part, spec, recorded, seed, crashed=crashed)
        log.info("eval: %d/%d episodes, success so far %.3f", len(results), len(schedule),
                 np.mean([r.success for r in results]))
    return results, reruns


def _videos_by_slot(paths: list[str], num_videos: int, out_dir: Path) -> dict[int, str]:
    """Slot -> its episode's video, relative to ``out_dir`` (names hold ``_env<slot>_``)."""
    videos: dict[int, str] = {}
    for path in sorted(paths):
        for i in range(num_videos):
            if f"_env{i}_" in Path(path).name and i not in videos:
                videos[i] = str(Path(path).relative_to(out_dir))
    return videos


def episode_results(traj, part: list[tuple[int, int, int]], spec, videos: Mapping[int, str],
                    seed: int | None = None, crashed: AbstractSet[int] = frozenset()) -> list[EpisodeResult]:
    """One :class:`EpisodeResult` per scheduled ``(episode_ix, task_id, init_state_id)`` from an evaluation
    trajectory ``[N, T]`` (one episode per row; padding rows beyond ``part`` are dropped). An episode
    succeeded when ``success`` held at one of its valid decisions; its return sums its valid rewards, its
    length counts the low-level steps it executed (``executed`` at valid decisions); ``seed``: the sweep's base seed (episode
    ``j`` is reset with ``seed + j``); ``crashed``: rows whose episode crashed its simulator on every re-run, failures
    whatever their rows hold."""
    valid = traj.get(D.VALID)                                                    # (N, T)
    step_reward = traj.get(D.REWARD)
    step_reward = step_reward if step_reward.dim() == 3 else step_reward[..., None]  # (N, T, H or 1)
    success = (traj.get(D.SUCCESS) & valid).any(-1)                              # (N,)
    length = (traj.get(D.EXECUTED) & valid[..., None]).sum(dim=(1, 2))           # (N,)
    episode_return = (step_reward.sum(-1) * valid).sum(-1)                       # (N,)
    # chunk-level rewards: the largest chunk (action-level: step) reward of the episode
    max_reward = step_reward.masked_fill(~valid[..., None], float("-inf")).amax(dim=(1, 2))   # (N,)
    return [EpisodeResult(suite=spec.task_groups[task_id] if spec.task_groups else spec.name, task_id=task_id,
                          task=spec.task_descriptions[task_id],
                          init_state_id=init_id, success=bool(success[i]) and i not in crashed,
                          crashed=i in crashed, episode_return=float(episode_return[i]),
                          length=int(length[i]), video_path=videos.get(i), episode_ix=episode_ix,
                          seed=None if seed is None else seed + episode_ix,
                          max_reward=float(max_reward[i]) if bool(valid[i].any()) else None)
            for i, (episode_ix, task_id, init_id) in enumerate(part)]
