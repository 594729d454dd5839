"""Evaluation results: ``eval_info.json``, a console table and a PNG of per-task success.

``eval_info.json`` follows the shape LeRobot users know, extended with suites::

    {
      "per_episode": [{"episode_ix", "suite", "task_id", "task", "init_state_id", "success",
                       "return", "length", "video_path", "crashed"}, ...],
      "per_task":    [{"suite", "task_id", "task", "n_episodes", "success_rate", "avg_return",
                       "avg_length", "video_paths"}, ...],
      "per_suite":   {"<suite>": {"n_episodes", "n_tasks", "success_rate", "avg_return", "avg_length"}},
      "overall":     {"n_episodes", "success_rate", "avg_return", "avg_length", "n_crashed",
                      "n_rerun_after_crash", "eval_s", "video_paths"}
    }

The suite success rate averages episodes (every task has the same number of trials in the standard
protocol, so this equals the mean of per-task rates there).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class EpisodeResult:
    suite: str
    task_id: int
    task: str
    init_state_id: int
    success: bool
    episode_return: float
    length: int
    video_path: str | None = None
    crashed: bool = False          # the simulator crashed mid-episode: counted as a failure


def _summary(episodes: list[EpisodeResult]) -> dict:
    n = len(episodes)
    return {
        "n_episodes": n,
        "success_rate": sum(e.success for e in episodes) / n if n else 0.0,
        "avg_return": sum(e.episode_return for e in episodes) / n if n else 0.0,
        "avg_length": sum(e.length for e in episodes) / n if n else 0.0,
    }


def build_eval_info(episodes: Iterable[EpisodeResult], eval_s: float | None = None, rerun_after_crash: int = 0) -> dict:
    """``rerun_after_crash``: episodes a simulator crash interrupted that were collected again from their start
    (the Ray collector's rule); crashed episodes that were not re-run count as failures (``n_crashed``)."""
    episodes = list(episodes)
    by_task: dict[tuple[str, int], list[EpisodeResult]] = defaultdict(list)
    by_suite: dict[str, list[EpisodeResult]] = defaultdict(list)
    for ep in episodes:
        by_task[(ep.suite, ep.task_id)].append(ep)
        by_suite[ep.suite].append(ep)
    per_task = []
    for (suite, task_id), eps in sorted(by_task.items()):
        per_task.append({"suite": suite, "task_id": task_id, "task": eps[0].task, **_summary(eps),
                         "video_paths": [e.video_path for e in eps if e.video_path]})
    per_suite = {suite: {**_summary(eps), "n_tasks": len({e.task_id for e in eps})}
                 for suite, eps in sorted(by_suite.items())}
    overall = {**_summary(episodes), "n_crashed": sum(e.crashed for e in episodes),
               "n_rerun_after_crash": int(rerun_after_crash),
               "video_paths": [e.video_path for e in episodes if e.video_path]}
    if eval_s is not None:
        overall["eval_s"] = round(eval_s, 3)
    per_episode = []
    for i, ep in enumerate(episodes):
        record = asdict(ep)
        record["return"] = record.pop("episode_return")
        per_episode.append({"episode_ix": i, **record})
    return {"per_episode": per_episode, "per_task": per_task, "per_suite": per_suite, "overall": overall}


def write_eval_info(info: dict, output_dir: str | Path) -> Path:
    path = Path(output_dir) / "eval_info.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=2))
    tmp.replace(path)
    return path


def print_table(info: dict) -> None:
    """Per-task success on the console (rich table)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="evaluation")
    for column in ("suite", "task", "episodes", "success", "return", "length"):
        table.add_column(column, justify="left" if column in ("suite", "task") else "right")
    for row in info["per_task"]:
        table.add_row(row["suite"], f"{row['task_id']}: {row['task'][:60]}", str(row["n_episodes"]),
                      f"{row['success_rate']:.1%}", f"{row['avg_return']:.3g}", f"{row['avg_length']:.1f}")
    o = info["overall"]
    table.add_row("all", "", str(o["n_episodes"]), f"{o['success_rate']:.1%}", f"{o['avg_return']:.3g}",
                  f"{o['avg_length']:.1f}", style="bold")
    Console().print(table)


def plot_success(info: dict, path: str | Path) -> Path:
    """A horizontal bar chart of per-task success rates (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = info["per_task"]
    labels = [f"{r['suite']} {r['task_id']}: {r['task'][:48]}" for r in rows]
    rates = [100.0 * r["success_rate"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.4))
    ax.barh(range(len(rows)), rates, color="#4c72b0")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("success rate (%)")
    ax.set_title(f"overall {100.0 * info['overall']['success_rate']:.1f}% over {info['overall']['n_episodes']} episodes")
    for i, rate in enumerate(rates):
        ax.text(min(rate + 1, 92), i, f"{rate:.0f}%", va="center", fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
