"""Evaluation results: ``eval_info.json``, a console table and a PNG of per-task success, with 95 % intervals.

``eval_info.json`` carries embodirl's keys and, next to them, those of LeRobot's multi-task evaluation
(``eval_policy_all`` in ``src/lerobot/scripts/lerobot_eval.py`` of huggingface/lerobot, commit 7427f318:
``per_task[*].{task_group, task_id, metrics}``, ``per_group``, ``overall.{avg_sum_reward, avg_max_reward,
pc_success, n_episodes, eval_s, eval_ep_s, video_paths}``, per episode ``sum_reward, max_reward, success,
seed``), so the file reads in LeRobot users' tooling. A task group is a suite::

    {
      "per_episode": [{"episode_ix", "suite", "task_id", "task", "init_state_id", "seed", "success", "crashed",
                       "return", "sum_reward", "max_reward", "length", "video_path"}, ...],
      "per_task":    [{"suite", "task_group", "task_id", "task", "n_episodes", "n_successes", "crashed", "success_rate",
                       "success_rate_ci95", "pc_success", "avg_return", "avg_length", "video_paths",
                       "metrics": {"sum_rewards", "max_rewards", "successes", "video_paths"}}, ...],
      "per_suite":   {"<suite>": {"n_episodes", "n_tasks", "n_successes", "success_rate", "success_rate_ci95",
                                  "avg_return", "avg_length", ...LeRobot's keys}},
      "per_group":   the same as per_suite (LeRobot's name),
      "overall":     {"n_episodes", "n_successes", "crashed", "success_rate", "success_rate_ci95", "avg_return",
                      "avg_length", "n_rerun_after_crash", "eval_s", "eval_ep_s", "pc_success", "avg_sum_reward",
                      "avg_max_reward", "video_paths"},
      "init_states": {"disjoint", "detail"},    # training's starts beside these (embodirl/runner/heldout.py)
      "training_states": {"per_episode", "per_task", "per_suite", "per_group", "overall"}
    }

The evaluation runs the benchmark's evaluation states (LIBERO's official init states), which training holds out by
default; ``init_states.disjoint`` is False when training started from them too (on purpose: ``train_init_states:
official``). ``training_states`` (with ``runner.eval_train_states_per_task``) is the same report for episodes started
from training states, so that success on trained starts stands beside success on held-out ones.

``success_rate_ci95`` is the Wilson score interval at 95 % ([low, high], :func:`wilson_interval`): unlike
p ± 1.96·sqrt(p(1-p)/n) it stays inside [0, 1] and does not collapse to a point at 0 or n successes, which
is where small per-task samples often sit. The suite success rate averages episodes (every task has the
same number of trials in the standard protocol, so this equals the mean of per-task rates there), and its
interval treats the suite's episodes as one sample. ``seed`` and ``init_state_id`` with ``task_id`` say
how to run an episode again (``runner.eval_episodes=[<episode_ix>, ...]``). ``crashed`` counts the episodes
whose simulator crashed on every re-run: they are failures, and the sweep went on without them.
"""

from __future__ import annotations

import json
import math
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
    seed: int | None = None        # the seed the episode's simulator was reset with
    max_reward: float | None = None  # the largest single-step reward (LeRobot's max_reward)
    episode_ix: int | None = None  # its index in the evaluation sweep (None: its position in the list)
    crashed: bool = False          # its simulator crashed on every re-run: a failure (the sweep went on)


#: two-sided 95 % normal quantile
Z95 = 1.959963984540054


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for ``successes`` of ``n`` Bernoulli trials (Wilson 1927; Newcombe 1998,
    method 3): ``(centre ± half) `` with ``centre = (p + z²/2n) / (1 + z²/n)`` and
    ``half = z / (1 + z²/n) · sqrt(p(1-p)/n + z²/4n²)``. ``n = 0`` gives (0, 1)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _summary(episodes: list[EpisodeResult]) -> dict:
    n = len(episodes)
    k = sum(bool(e.success) for e in episodes)
    low, high = wilson_interval(k, n)
    returns = [e.episode_return for e in episodes]
    max_rewards = [e.max_reward for e in episodes if e.max_reward is not None]
    rate = k / n if n else 0.0
    return {
        "n_episodes": n,
        "n_successes": k,
        "crashed": sum(bool(e.crashed) for e in episodes),
        "success_rate": rate,
        "success_rate_ci95": [round(low, 6), round(high, 6)],
        "avg_return": _mean(returns) or 0.0,
        "avg_length": _mean([e.length for e in episodes]) or 0.0,
        # LeRobot's names
        "pc_success": 100.0 * rate,
        "avg_sum_reward": _mean(returns) or 0.0,
        "avg_max_reward": _mean(max_rewards),
    }


def build_eval_info(episodes: Iterable[EpisodeResult], eval_s: float | None = None, rerun_after_crash: int = 0) -> dict:
    """The report of ``episodes`` (see module docstring); ``rerun_after_crash``: episodes a simulator crash
    interrupted that the collector ran again from their start."""
    episodes = list(episodes)
    by_task: dict[tuple[str, int], list[EpisodeResult]] = defaultdict(list)
    by_suite: dict[str, list[EpisodeResult]] = defaultdict(list)
    for ep in episodes:
        by_task[(ep.suite, ep.task_id)].append(ep)
        by_suite[ep.suite].append(ep)
    per_task = []
    for (suite, task_id), eps in sorted(by_task.items()):
        videos = [e.video_path for e in eps if e.video_path]
        per_task.append({"suite": suite, "task_group": suite, "task_id": task_id, "task": eps[0].task,
                         **_summary(eps), "video_paths": videos,
                         "metrics": {"sum_rewards": [e.episode_return for e in eps],
                                     "max_rewards": [e.max_reward for e in eps],
                                     "successes": [bool(e.success) for e in eps], "video_paths": videos}})
    per_suite = {suite: {**_summary(eps), "n_tasks": len({e.task_id for e in eps}),
                         "video_paths": [e.video_path for e in eps if e.video_path]}
                 for suite, eps in sorted(by_suite.items())}
    overall = {**_summary(episodes), "n_rerun_after_crash": int(rerun_after_crash),
               "video_paths": [e.video_path for e in episodes if e.video_path]}
    if eval_s is not None:
        overall["eval_s"] = round(eval_s, 3)
        overall["eval_ep_s"] = round(eval_s / max(1, len(episodes)), 4)
    per_episode = []
    for i, ep in enumerate(episodes):
        record = asdict(ep)
        record["return"] = record.pop("episode_return")
        record["sum_reward"] = record["return"]
        ix = record.pop("episode_ix")
        per_episode.append({"episode_ix": i if ix is None else ix, **record})
    return {"per_episode": per_episode, "per_task": per_task, "per_suite": per_suite, "per_group": per_suite,
            "overall": overall}


def write_eval_info(info: dict, output_dir: str | Path) -> Path:
    path = Path(output_dir) / "eval_info.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=2))
    tmp.replace(path)
    return path


def print_table(info: dict) -> None:
    """Per-task success on the console (rich tables): the evaluation states', then the training states' when swept."""
    from rich.console import Console

    console = Console()
    states = info.get("init_states")
    held_out = states is None or states["disjoint"]
    console.print(_table(info, "evaluation (success with its 95 % Wilson interval)" if held_out else
                         "evaluation (success with its 95 % Wilson interval) - training started from these states too"))
    if states is not None and not held_out:
        console.print(f"training and evaluation states meet: {states['detail']}")
    if "training_states" in info:
        console.print(_table(info["training_states"], "on training states (success with its 95 % Wilson interval)"))
        trained, evaluated = info["training_states"]["overall"], info["overall"]
        console.print(f"success on training states {trained['success_rate']:.1%} {_interval(trained)}, on held-out "
                      f"evaluation states {evaluated['success_rate']:.1%} {_interval(evaluated)}")


def _table(info: dict, title: str):
    from rich.table import Table

    table = Table(title=title)
    for column in ("suite", "task", "episodes", "success", "95 % interval", "crashed", "return", "length"):
        table.add_column(column, justify="left" if column in ("suite", "task") else "right")

    def cells(row: dict) -> list[str]:
        return [str(row["n_episodes"]), f"{row['success_rate']:.1%}", _interval(row), str(row.get("crashed", 0)),
                f"{row['avg_return']:.3g}", f"{row['avg_length']:.1f}"]

    for row in info["per_task"]:
        table.add_row(row["suite"], f"{row['task_id']}: {row['task'][:60]}", *cells(row))
    if len(info["per_suite"]) > 1:
        for suite, row in info["per_suite"].items():
            table.add_row(suite, "(suite)", *cells(row), style="italic")
    table.add_row("all", "", *cells(info["overall"]), style="bold")
    return table


def _interval(row: dict) -> str:
    low, high = row.get("success_rate_ci95") or wilson_interval(row.get("n_successes", 0), row["n_episodes"])
    return f"[{100 * low:.1f}, {100 * high:.1f}]"


def plot_success(info: dict, path: str | Path) -> Path:
    """A horizontal bar chart of per-task success rates with their 95 % intervals as error bars (PNG)."""
    import matplotlib.pyplot as plt

    fig = success_figure(info)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def success_figure(info: dict):
    """The figure :func:`plot_success` saves (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = info["per_task"]
    labels = [f"{r['suite']} {r['task_id']}: {r['task'][:48]}" for r in rows]
    rates = [100.0 * r["success_rate"] for r in rows]
    intervals = [r.get("success_rate_ci95") or wilson_interval(r["n_successes"], r["n_episodes"]) for r in rows]
    below = [max(0.0, rate - 100.0 * lo) for rate, (lo, _) in zip(rates, intervals, strict=True)]
    above = [max(0.0, 100.0 * hi - rate) for rate, (_, hi) in zip(rates, intervals, strict=True)]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.4))
    ax.barh(range(len(rows)), rates, color="#4c72b0", xerr=[below, above],
            error_kw={"ecolor": "#222222", "capsize": 3, "elinewidth": 1})
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("success rate (%)")
    o = info["overall"]
    low, high = o.get("success_rate_ci95") or wilson_interval(o["n_successes"], o["n_episodes"])
    ax.set_title(f"overall {100.0 * o['success_rate']:.1f}% [{100 * low:.1f}, {100 * high:.1f}] over "
                 f"{o['n_episodes']} episodes (bars: 95 % Wilson intervals)")
    for i, rate in enumerate(rates):
        ax.text(min(rate + above[i] + 1, 92), i, f"{rate:.0f}%", va="center", fontsize=7)
    fig.tight_layout()
    return fig


def plot_learning_curve(points: list[dict], path: str | Path) -> Path:
    """Evaluation success with its 95 % interval against wall-clock minutes and against training steps, side
    by side (PNG). ``points``: one ``{"step", "minutes", "success_rate", "success_rate_ci95"}`` per evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p["step"] for p in points]
    minutes = [p["minutes"] for p in points]
    rates = [100.0 * p["success_rate"] for p in points]
    low = [100.0 * p["success_rate_ci95"][0] for p in points]
    high = [100.0 * p["success_rate_ci95"][1] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, x, label in ((axes[0], minutes, "wall-clock minutes"), (axes[1], steps, "training step")):
        ax.fill_between(x, low, high, color="#4c72b0", alpha=0.2, linewidth=0, label="95 % interval")
        ax.plot(x, rates, "o-", color="#4c72b0", markersize=3, label="success")
        ax.set_xlabel(label)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("evaluation success (%)")
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"evaluation success: {rates[-1]:.0f}% at step {steps[-1]} ({minutes[-1]:.1f} min)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)              # rewritten at each evaluation: readers never see half a file
    return path
