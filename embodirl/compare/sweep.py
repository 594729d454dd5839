"""Both sides of a comparison on the same evaluation episodes, and the report: ``compare_info.json`` and a table.

Each side's episodes are what ``embodirl eval`` of its checkpoint plays: its evaluation workers
(:meth:`Runner.eval_workers <embodirl.runner.loop.Runner.eval_workers>`) run the sweep of ``env.eval``
(:func:`~embodirl.runner.evaluation.sweep_episodes`) with its seeds, greedily. Without ``compare.sequential`` each side
runs the whole sweep once, A then B. With it, the sweep is cut into ``compare.looks`` parts
(:func:`~embodirl.runner.paired.plan_looks`: every task in each); after each part both sides have run, the
group-sequential exact McNemar test (:class:`~embodirl.runner.paired.GroupSequentialMcNemar`) looks at all pairs so
far and the comparison stops once it finds a difference. Each part starts each side's workers again (one side's
weights at a time on the devices; for a 7B policy that is a model load per side and part).

The output folder (``runner.output_dir``, by default ``outputs/compare/<experiment>``)::

    compare_info.json   both sides (path, kind, step, weights' SHA-256), settings, every paired episode, per-task
                        (with Holm-adjusted p-values), per-suite and overall statistics, the sequential looks
    a/, b/              each side's ordinary evaluation: config.yaml, eval_info.json, eval_success.png, videos/

``compare_info.json``::

    {"a": {...side}, "b": {...side}, "difference": "b - a", "alpha", "multiple_comparisons", "test",
     "n_planned_pairs", "n_pairs", "eval_s",
     "sequential": {"enabled", "looks", "spending", "stopped_early", "stopped_at_look", "looks_run": [Look, ...]},
     "episodes": [{"episode_ix", "suite", "task_id", "task", "init_state_id", "seed", "look", "a_success",
                   "b_success", "a_length", "b_length", "a_crashed", "b_crashed"}, ...],
     "per_task": [{"suite", "task_id", "task", "n_pairs", "a_successes", "b_successes", "a_success_rate",
                   "b_success_rate", "both", "a_only", "b_only", "neither", "difference", "difference_ci95",
                   "p_value", "p_holm", "differs", "better"}, ...],
     "per_suite": {"<suite>": {... as per_task without p_holm, "n_tasks"}},
     "overall": {... as per_suite}}
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from embodirl.compare.compose import INFO_FILE, CompareJob
from embodirl.runner.eval_report import EpisodeResult, build_eval_info, plot_success, write_eval_info
from embodirl.runner.paired import GroupSequentialMcNemar, compare_stats, plan_looks

log = logging.getLogger(__name__)


def run(job: CompareJob) -> dict:
    """Run the comparison, write its folder and print its table; returns ``compare_info``."""
    from embodirl.runner.evaluation import sweep_episodes, sweep_schedule
    from embodirl.runner.loop import Runner

    settings = job.settings
    job.out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[EpisodeResult]] = {side.label: [] for side in job.sides}
    reruns = {side.label: 0 for side in job.sides}
    seconds = {side.label: 0.0 for side in job.sides}
    look_of: dict[int, int] = {}
    parts: list[list[int]] | None = None
    test: GroupSequentialMcNemar | None = None
    t_start = time.perf_counter()
    look = 0
    while parts is None or look < len(parts):
        for side in job.sides:
            t_side = time.perf_counter()
            runner = Runner(side.cfg)
            with runner.eval_workers() as (groups, _):
                if parts is None:      # the sweep is known once the evaluation env has told its tasks
                    schedule = sweep_schedule(groups, runner.cfg)
                    parts = plan_looks(schedule, settings.looks if settings.sequential else 1)
                    if settings.sequential:
                        test = GroupSequentialMcNemar(len(schedule), settings.alpha, settings.spending)
                episodes, rerun = sweep_episodes(groups, runner.cfg, out_dir=side.out_dir, seed=runner.eval_seed,
                                                 episodes=parts[look], videos=look == 0)
            results[side.label] += episodes
            reruns[side.label] += rerun
            seconds[side.label] += time.perf_counter() - t_side
        assert parts is not None        # planned by the first side
        look_of.update({j: look + 1 for j in parts[look]})
        look += 1
        if test is not None:
            pairs = paired_episodes(results["a"], results["b"], look_of)
            a_only = sum(e["a_success"] and not e["b_success"] for e in pairs)
            b_only = sum(e["b_success"] and not e["a_success"] for e in pairs)
            result = test.look(len(pairs), a_only, b_only)
            print(f"[compare look {look}/{len(parts)}] {len(pairs)} pairs: A only {a_only}, B only {b_only}; "
                  f"stop when min <= {result.boundary} (alpha spent {result.alpha_spent:.4g})"
                  + (": a difference, stopping" if result.stop else ""), flush=True)
            if result.stop:
                break
    for side in job.sides:
        info = build_eval_info(sorted(results[side.label], key=_episode_ix), eval_s=seconds[side.label],
                               rerun_after_crash=reruns[side.label])
        write_eval_info(info, side.out_dir)
        plot_success(info, side.out_dir / "eval_success.png")
    info = compare_info(job, paired_episodes(results["a"], results["b"], look_of), test,
                        planned=sum(len(p) for p in parts), looks_planned=len(parts),
                        eval_s=time.perf_counter() - t_start)
    path = write_compare_info(info, job.out_dir)
    print_table(info)
    print(f"compare_info: {path}")
    return info


def _episode_ix(episode: EpisodeResult) -> int:
    """The episode's index in the evaluation sweep (:func:`~embodirl.runner.evaluation.sweep_episodes` numbers every
    episode it returns)."""
    assert episode.episode_ix is not None
    return episode.episode_ix


def paired_episodes(a: list[EpisodeResult], b: list[EpisodeResult], look_of: dict[int, int]) -> list[dict]:
    """One record per episode both sides have run, in ``episode_ix`` order."""
    by_ix = {e.episode_ix: e for e in b}
    pairs = []
    for ea in sorted(a, key=_episode_ix):
        eb = by_ix.get(ea.episode_ix)
        if eb is None:
            continue
        if (eb.task_id, eb.init_state_id) != (ea.task_id, ea.init_state_id):
            raise RuntimeError(f"episode {ea.episode_ix} is (task {ea.task_id}, init state {ea.init_state_id}) for A "
                               f"but (task {eb.task_id}, init state {eb.init_state_id}) for B")
        pairs.append({"episode_ix": ea.episode_ix, "suite": ea.suite, "task_id": ea.task_id, "task": ea.task,
                      "init_state_id": ea.init_state_id, "seed": ea.seed, "look": look_of.get(_episode_ix(ea)),
                      "a_success": bool(ea.success), "b_success": bool(eb.success), "a_length": ea.length,
                      "b_length": eb.length, "a_crashed": bool(ea.crashed), "b_crashed": bool(eb.crashed)})
    return pairs


def compare_info(job: CompareJob, episodes: list[dict], test: GroupSequentialMcNemar | None, *, planned: int,
                 looks_planned: int, eval_s: float) -> dict:
    """``compare_info.json`` (module docstring). With the sequential test, the overall ``differs`` is its decision
    (``p_value`` stays the nominal exact McNemar p of the pairs run)."""
    settings = job.settings
    stats = compare_stats(episodes, settings.alpha)
    sequential: dict[str, object] = {"enabled": settings.sequential}
    if test is not None:
        stopped = test.stopped
        overall = stats["overall"]
        overall["differs"] = stopped
        overall["better"] = ("b" if overall["b_only"] > overall["a_only"] else "a") if stopped else None
        sequential.update({"looks": looks_planned, "spending": settings.spending, "stopped_early": stopped and
                           len(episodes) < planned, "stopped_at_look": test.looks[-1].look if stopped else None,
                           "looks_run": [look.to_dict() for look in test.looks]})
    return {"a": job.sides[0].record(), "b": job.sides[1].record(), "difference": "b - a",
            "alpha": settings.alpha,
            "test": "exact McNemar (two-sided, conditional on the discordant pairs)"
                    + (f"; overall: group-sequential with {settings.spending} alpha spending" if test else ""),
            "multiple_comparisons": "holm (per-task p-values, family-wise at alpha)",
            "n_planned_pairs": planned, "n_pairs": len(episodes), "eval_s": round(eval_s, 3),
            "sequential": sequential, "command_line": job.command_line,
            **stats, "episodes": episodes}


def write_compare_info(info: dict, out_dir: Path) -> Path:
    path = Path(out_dir) / INFO_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=2))
    tmp.replace(path)
    return path


def print_table(info: dict) -> None:
    """Per task, per suite and overall: pairs, both success rates, discordant pairs, B - A with its 95 % interval,
    the exact McNemar p (per task also Holm's), and whether they differ; then one verdict line."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"paired comparison, B - A (exact McNemar; per task Holm-adjusted; alpha {info['alpha']})")
    for column in ("suite", "task", "pairs", "A", "B", "A only", "B only", "B - A [95 %]", "p", "p Holm", "differ"):
        table.add_column(column, justify="left" if column in ("suite", "task") else "right")

    def cells(row: dict) -> list[str]:
        low, high = row["difference_ci95"]
        return [str(row["n_pairs"]), f"{row['a_success_rate']:.1%}", f"{row['b_success_rate']:.1%}",
                str(row["a_only"]), str(row["b_only"]),
                f"{100 * row['difference']:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]", f"{row['p_value']:.3g}",
                f"{row['p_holm']:.3g}" if "p_holm" in row else "", (row["better"] or "").upper() or "-"]

    for row in info["per_task"]:
        table.add_row(row["suite"], f"{row['task_id']}: {row['task'][:40]}", *cells(row))
    if len(info["per_suite"]) > 1:
        for suite, row in info["per_suite"].items():
            table.add_row(suite, "(suite)", *cells(row), style="italic")
    table.add_row("all", "", *cells(info["overall"]), style="bold")
    console = Console()
    if not console.is_terminal:                # a log file or a pipe: no terminal's width to fit
        console = Console(width=160)
    console.print(table)
    console.print(verdict(info))


def verdict(info: dict) -> str:
    """One sentence: which side is better overall (or that no difference was found), and how it was decided."""
    o, seq = info["overall"], info["sequential"]
    low, high = o["difference_ci95"]
    diff = f"B - A = {100 * o['difference']:+.1f} points [{100 * low:+.1f}, {100 * high:+.1f}] over {o['n_pairs']} pairs"
    how = f"exact McNemar p = {o['p_value']:.3g}"
    if seq["enabled"]:
        look = seq["stopped_at_look"]
        how += (f"; sequential test stopped at look {look} of {seq['looks']} ({o['n_pairs']} of "
                f"{info['n_planned_pairs']} pairs)" if look else f"; sequential test ran all {seq['looks']} looks")
    if o["better"]:
        return f"{o['better'].upper()} is better overall at alpha {info['alpha']}: {diff} ({how})"
    return f"no overall difference found at alpha {info['alpha']}: {diff} ({how})"
