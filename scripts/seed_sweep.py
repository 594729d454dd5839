"""Run one job over several seeds, one after another, and print how robust its learning is.

    .venv/bin/python scripts/seed_sweep.py --seeds 1-10 --out outputs/sweep [embodirl train overrides ...]
    .venv/bin/python scripts/seed_sweep.py --seeds 1-10 --out outputs/sweep --summarize   # only read the runs

Each seed runs ``embodirl train runner.seed=<s> runner.output_dir=<out>/seed_<s> <overrides>`` (the default
job without overrides), its console output in ``<out>/seed_<s>.log``. A seed whose run already finished
(``<out>/seed_<s>/sweep_done``) is not run again, so an interrupted sweep goes on where it stopped. Then, per
seed: the step and minutes at which greedy evaluation success first reached ``--bar``, whether every later
evaluation stayed at or above ``--hold``, the lowest of them and the final success; and over the seeds the
counts, median and worst first step, median and worst final success (:mod:`embodirl.runner.seed_sweep`).
``<out>/summary.json`` holds the same, ``<out>/curves.png`` every seed's evaluation curve with the bar and the
hold line (``--title`` heads it; ``--start`` draws the success the runs started from at step 0). Exit status 0
when every run finished (whatever it learned).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from embodirl.runner.seed_sweep import format_report, plot_curves, summarize_run, write_summary

DONE = "sweep_done"


def parse_seeds(text: str) -> list[int]:
    """``"1-10"``, ``"1,3,5"`` or ``"1-3,7"`` -> the seeds in order."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return seeds


def run_seed(seed: int, out: Path, overrides: list[str]) -> int:
    run_dir = out / f"seed_{seed}"
    if (run_dir / DONE).is_file():
        print(f"seed {seed}: already done ({run_dir})", flush=True)
        return 0
    command = [sys.executable, "-m", "embodirl.cli", "train", f"runner.seed={seed}",
               f"runner.output_dir={run_dir}", "runner.progress_bar=false", *overrides]
    print(f"seed {seed}: {' '.join(command[2:])}", flush=True)
    started = time.perf_counter()
    with open(out / f"seed_{seed}.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    minutes = (time.perf_counter() - started) / 60
    if code == 0:
        (run_dir / DONE).write_text(f"{minutes:.2f} minutes\n")
    print(f"seed {seed}: exit {code} after {minutes:.1f} min (log: {out / f'seed_{seed}.log'})", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1-10", help="seeds to run: 1-10, 1,3,5 or 1-3,7 (default 1-10)")
    parser.add_argument("--out", type=Path, default=Path("outputs/seed_sweep"), help="folder of the runs")
    parser.add_argument("--bar", type=float, default=0.8, help="success that counts as reached (default 0.8)")
    parser.add_argument("--hold", type=float, default=0.75, help="every later evaluation must stay at or above "
                                                                 "this (default 0.75)")
    parser.add_argument("--summarize", action="store_true", help="only summarise the runs already in --out")
    parser.add_argument("--title", default="", help="heading of <out>/curves.png")
    parser.add_argument("--start", type=float, default=None, help="success the runs started from (their "
                                                                     "checkpoint's), drawn at step 0 of curves.png")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        parser.error(f"unknown option {bad[0]}; embodirl overrides are key=value")
    for name in ("bar", "hold", "start"):
        value = getattr(args, name)
        if value is not None and not 0.0 <= value <= 1.0:
            parser.error(f"--{name} is {value}; give a success rate between 0 and 1 (0.8, not 80)")
    seeds = parse_seeds(args.seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    if not args.summarize:
        failed = [s for s in seeds if run_seed(s, args.out, overrides) != 0]
    results = [summarize_run(s, args.out / f"seed_{s}", args.bar, args.hold) for s in seeds]
    print(format_report(results, args.bar, args.hold))
    write_summary(args.out / "summary.json", results, args.bar, args.hold)
    plot_curves(results, args.out / "curves.png", args.bar, args.hold, args.title, args.start)
    if failed:
        print(f"runs that failed: seeds {failed} (see their logs)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
