"""Predicted against measured step time for three configs on this machine (``embodirl doctor --bench``'s check).

For each config: ``embodirl train <overrides> runner.predict_step_time=true runner.max_steps=<n>`` (evaluation and
checkpoints off) into a fresh folder: the run calibrates its parts (:mod:`embodirl.calibration`), writes the predicted
step into ``prediction.json``, trains ``n`` steps and adds the measured medians (steps after the first: the first
pays one-off costs) at its end. Calibration and run go back to back in one process, so machine load changes them
alike as far as it can. Prints one row per config: predicted, measured, ratio, the parts and the load.

    .venv/bin/python scripts/bench/bench_predict.py [--steps 4] [--only default,oft_pushcube,oft_libero] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the VLA configs sized for a CPU (as tests/runner/test_vla_cli.py sizes them), in-process (no Ray)
VLA_SMALL = ["model=openvla_oft_tiny", "algorithm=grpo", "algorithm.group_size=2", "env.train.num_envs=2",
             "env.eval.num_envs=1", "env.train.use_fixed_reset_state_ids=true", "env.train.max_episode_steps=16",
             "env.eval.max_episode_steps=16", "env.train.image_size=[64,64]", "env.eval.image_size=[64,64]",
             "cluster.use_ray=false"]
CONFIGS = {
    "default": [],                                                     # the README's first command: state PushCube
    "oft_pushcube": ["env=maniskill_pushcube_rgb", *VLA_SMALL],
    "oft_libero": ["env=libero_10", "env.train.task_ids=[0]", "env.eval.task_ids=[0]", *VLA_SMALL],
}
RUN = ["runner.val_check_interval=0", "runner.save_interval=0", "runner.progress_bar=false",
       "runner.logger.tensorboard=false", "runner.predict_step_time=true"]
TOLERANCE = 0.25


def run_one(name: str, overrides: list[str], steps: int, out: Path) -> dict:
    folder = out / name
    args = ["train", *overrides, *RUN, f"runner.max_steps={steps}", f"runner.output_dir={folder}"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "embodirl.cli", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: embodirl train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    record = json.loads((folder / "prediction.json").read_text())
    record["wall_s"] = time.perf_counter() - t0
    record["load_after"] = os.getloadavg()[0]
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", default=",".join(CONFIGS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_predict_"))
    rows = []
    for name in args.only.split(","):
        record = run_one(name, CONFIGS[name], args.steps, out)
        rows.append((name, record))
        p, m, c = record["predicted"], record["measured"], record["calibration"]
        print(f"[{name}] load {c['load']:.1f} -> {record['load_after']:.1f}; predicted {p['step_s']:.3f} s "
              f"(collect {p['collect_s']:.3f}, update {p['update_s']:.3f}, sync {p['sync_s']:.4f}; bottleneck "
              f"{p['bottleneck']}); measured {m['step_s']:.3f} s (collect {m['collect_s']:.3f}, update "
              f"{m['update_s']:.3f}, sync {m['sync_s']:.4f}; first step {m['first_step_s']:.3f} s, excluded)",
              flush=True)
    print(f"\n{'config':<14}{'predicted s':>12}{'measured s':>12}{'ratio':>8}{'collect p/m':>16}{'update p/m':>16}"
          f"{'load':>12}  within 25 %")
    ok = True
    for name, record in rows:
        p, m, c = record["predicted"], record["measured"], record["calibration"]
        ratio = p["step_s"] / m["step_s"]
        within = abs(ratio - 1.0) <= TOLERANCE
        ok &= within
        print(f"{name:<14}{p['step_s']:>12.3f}{m['step_s']:>12.3f}{ratio:>8.2f}"
              f"{p['collect_s']:>8.2f}/{m['collect_s']:<7.2f}{p['update_s']:>8.2f}/{m['update_s']:<7.2f}"
              f"{c['load']:>5.1f}->{record['load_after']:<5.1f} {'yes' if within else 'NO'}")
    print(f"\nmedian over steps 2..{args.steps} (step 1 excluded: first calls, simulator warm-up); folders in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
