"""Seeds of one job, summarised: when each first reached a success bar, whether it held, where it ended.

``scripts/seed_sweep.py`` runs ``embodirl train`` once per seed, one after another, each into
``<out>/seed_<s>/``, and prints :func:`format_report` of :func:`summarize_run` over the runs'
``metrics.jsonl``. The summary is what a robustness claim is about:

* per seed: the first evaluation at or above ``bar`` (its training step and the run's minutes since the
  command started), whether every later evaluation stayed at or above ``hold``, the lowest of them, and
  the last evaluation's success;
* over seeds: how many reached the bar, how many reached it and held, the median and worst first step
  (a seed that never reached it counts as worse than any step), and the median and worst final success;
* :func:`plot_curves`: every seed's evaluation curve in one figure, with the bar and the hold line.

Only the steps are comparable across machines; minutes depend on the machine and its load.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from embodirl.runner.metrics_logger import read_metrics

SUCCESS = "eval/success_rate"
MINUTES = "time/elapsed_min"


@dataclass
class SeedResult:
    """One seed's evaluation curve and what it says about the bar (see module docstring)."""

    seed: int
    curve: list[tuple[int, float, float]] = field(default_factory=list)   # (step, minutes, success)
    first_step: int | None = None
    first_minutes: float | None = None
    held: bool = False
    lowest_after: float | None = None
    final: float | None = None
    last_step: int | None = None

    @property
    def reached(self) -> bool:
        return self.first_step is not None


def summarize_curve(seed: int, curve: list[tuple[int, float, float]], bar: float, hold: float) -> SeedResult:
    """``curve``: ``(step, minutes, success)`` per evaluation in step order. A seed holds when every
    evaluation after its first at or above ``bar`` is at or above ``hold`` (vacuously true when the first
    one was the last)."""
    result = SeedResult(seed=seed, curve=list(curve))
    if not curve:
        return result
    result.final, result.last_step = curve[-1][2], curve[-1][0]
    first = next((i for i, (_, _, s) in enumerate(curve) if s >= bar), None)
    if first is None:
        return result
    result.first_step, result.first_minutes = curve[first][0], curve[first][1]
    after = [s for _, _, s in curve[first + 1:]]
    result.lowest_after = min(after) if after else None
    result.held = all(s >= hold for s in after)
    return result


def summarize_run(seed: int, run_dir: str | Path, bar: float, hold: float, *, skip_step0: bool = True) -> SeedResult:
    """:func:`summarize_curve` of the evaluations in ``run_dir/metrics.jsonl`` (the untrained evaluation at
    step 0, when the run made one, is left out with ``skip_step0``)."""
    path = Path(run_dir) / "metrics.jsonl"
    records = read_metrics(path) if path.is_file() else []
    curve = [(int(r["step"]), float(r.get(MINUTES, math.nan)), float(r[SUCCESS]))
             for r in records if SUCCESS in r and not (skip_step0 and int(r["step"]) == 0)]
    return summarize_curve(seed, sorted(curve), bar, hold)


def distribution(results: list[SeedResult]) -> dict:
    """Over seeds: counts, median and worst first step (``None`` when a seed never reached the bar and so is
    the worst; the median is ``None`` when half or more never reached it), final successes."""
    steps = sorted(r.first_step if r.first_step is not None else math.inf for r in results)   # None: not reached
    finals = [r.final for r in results if r.final is not None]
    median = statistics.median_low(steps) if steps else math.inf
    return {"seeds": len(results), "reached": sum(r.reached for r in results),
            "reached_and_held": sum(r.reached and r.held for r in results),
            "median_first_step": None if math.isinf(median) else int(median),
            "worst_first_step": None if not steps or math.isinf(steps[-1]) else int(steps[-1]),
            "median_final": statistics.median(finals) if finals else None,
            "worst_final": min(finals) if finals else None}


def _cell(value, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def format_report(results: list[SeedResult], bar: float, hold: float) -> str:
    """A table, one row per seed, then the distribution (see module docstring)."""
    lines = [f"bar {bar:g} (held: every later evaluation >= {hold:g})",
             "seed | first step >= bar | minutes | held | lowest after | final (step)",
             "---|---|---|---|---|---"]
    for r in results:
        held = ("yes" if r.held else "no") if r.reached else "-"
        lines.append(f"{r.seed} | {_cell(r.first_step, 'd')} | {_cell(r.first_minutes, '.1f')} | {held} | "
                     f"{_cell(r.lowest_after, '.2f')} | {_cell(r.final, '.2f')} ({_cell(r.last_step, 'd')})")
    d = distribution(results)
    lines.append(f"reached {d['reached']}/{d['seeds']}, reached and held {d['reached_and_held']}/{d['seeds']}; "
                 f"first step: median {_cell(d['median_first_step'], 'd')}, worst "
                 f"{_cell(d['worst_first_step'], 'd') if d['reached'] == d['seeds'] else 'never'}; "
                 f"final success: median {_cell(d['median_final'], '.2f')}, worst {_cell(d['worst_final'], '.2f')}")
    return "\n".join(lines)


def write_summary(path: str | Path, results: list[SeedResult], bar: float, hold: float) -> None:
    """The report as JSON: ``{"bar", "hold", "seeds": [SeedResult...], "distribution": {...}}``."""
    Path(path).write_text(json.dumps({"bar": bar, "hold": hold, "seeds": [asdict(r) for r in results],
                                      "distribution": distribution(results)}, indent=1))


def plot_curves(results: list[SeedResult], path: str | Path, bar: float, hold: float, title: str = "",
                start: float | None = None) -> Path:
    """Every seed's evaluation success against its training step in one PNG, with ``bar`` and ``hold`` drawn
    across; a seed that reached the bar and held is a solid line, any other dashed. ``start``: the success the
    runs started from (e.g. their checkpoint's, measured once), drawn at step 0 and joined to each curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for r in results:
        if not r.curve:
            continue
        first = [] if start is None or r.curve[0][0] == 0 else [(0, math.nan, start)]   # every run starts there
        steps = [step for step, _, _ in first + r.curve]
        rates = [100.0 * success for _, _, success in first + r.curve]
        ok = r.reached and r.held
        ax.plot(steps, rates, "o-" if ok else "o--", markersize=3,
                label=f"seed {r.seed}" + ("" if ok else (" (fell)" if r.reached else " (short)")))
    if start is not None:
        ax.plot([0], [100.0 * start], "k*", markersize=8, label=f"start {100 * start:.1f}%")
    ax.axhline(100.0 * bar, color="black", linewidth=0.8, label=f"bar {100 * bar:.1f}%")
    ax.axhline(100.0 * hold, color="black", linewidth=0.8, linestyle=":", label=f"hold {100 * hold:.1f}%")
    ax.set_xlabel("training step")
    ax.set_ylabel("evaluation success (%)")
    highest = max([100.0 * max(bar, hold, start or 0.0)] + [100.0 * x for r in results for _, _, x in r.curve])
    ax.set_ylim(0, min(100.0, 10.0 * math.ceil((highest + 15.0) / 10.0)))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    d = distribution(results)
    ax.set_title(f"{title + ': ' if title else ''}reached and held {d['reached_and_held']}/{d['seeds']}",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
