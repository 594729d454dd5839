"""The prediction as a table (``embodirl doctor --bench [--gpus N] [overrides]``) and as ``prediction.json`` in a run
folder.

``prediction.json``::

    {"calibration": {...}, "recipe": {...}, "predicted": {...}, "measured": {...}, "ratio": {...}}

A run with ``runner.predict_step_time: true`` calibrates before its first step and writes the first three; every
training run writes ``measured`` at its end: the medians of ``time/collect``, ``time/update``,
``time/publish_weights`` and ``time/step`` from ``metrics.jsonl`` over its steps after the first (the first pays one-off
costs: a policy's first calls, compilation, simulators' first scenes; a run of one step keeps it), and ``ratio``,
predicted over measured, when there is a prediction.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
from pathlib import Path

from embodirl.calibration.measure import Calibration, calibrate
from embodirl.calibration.predict import Recipe, predict
from embodirl.errors import ConfigError

log = logging.getLogger(__name__)
FILE = "prediction.json"
#: metrics.jsonl key of each predicted part
MEASURED_KEYS = {"collect_s": "time/collect", "update_s": "time/update", "sync_s": "time/publish_weights",
                 "step_s": "time/step"}


def bench_args(args: list[str]) -> tuple[list[str], int]:
    """(overrides, gpus) from the words after ``embodirl doctor``: ``--bench``, ``--gpus N`` and Hydra overrides."""
    overrides, gpus, rest = [], 1, iter(args)
    for arg in rest:
        if arg == "--bench":
            continue
        if arg == "--gpus" or arg.startswith("--gpus="):
            value = arg.split("=", 1)[1] if "=" in arg else next(rest, "")
            if not value.isdigit() or int(value) < 1:
                raise ConfigError("", f"--gpus takes a number of devices (1 or more), got {value!r}")
            gpus = int(value)
        elif arg.startswith("-"):
            raise ConfigError("", f"embodirl doctor --bench takes Hydra overrides and --gpus N; {arg} is not one")
        else:
            overrides.append(arg)
    return overrides, gpus


def bench(cfg, *, gpus: int = 1) -> dict:
    """Calibrate ``cfg`` on this machine and predict its step: the ``prediction.json`` record (without ``measured``)."""
    cal = calibrate(cfg)
    recipe = Recipe.from_config(cfg)
    prediction = predict(cal, recipe, gpus=gpus)
    return {"calibration": cal.as_dict(), "recipe": recipe.as_dict(), "predicted": prediction.as_dict()}


def format_table(record: dict) -> str:
    """The calibration and the prediction, one row a quantity."""
    c, r, p = record["calibration"], record["recipe"], record["predicted"]
    cal = Calibration(**c)
    lines = [f"machine: {c['cores']} cores, load {c['load']:.1f}, policy on {c['device']}; calibration "
             f"{c['seconds']:.0f} s with {c['envs']} simulators",
             f"recipe: N={r['num_envs']} envs = {r['env_workers']} env workers x {r['stages']} stages x "
             f"{r['envs_per_stage']}, T={r['decisions']} decisions x H={r['chunk']}, rollout_epoch={r['rollout_epoch']}, "
             f"update_epochs={r['update_epochs']}, group_size={r['group_size']}, "
             f"{r['inference_workers']} inference worker(s)", "",
             f"{'part':<26}{'measured rate':>28}{'s / step':>12}",
             f"{'env physics':<26}{cal.physics_ms:>21.2f} ms/step{'':>12}",
             f"{'render (per camera)':<26}"
             + (f"{cal.render_ms:>20.2f} ms/frame" if cal.cameras else f"{'- (state obs)':>28}")
             + f"{'':>12}",
             f"{'env (chunks + resets)':<26}{cal.chunk_ms:>20.2f} ms/chunk{p['env_s']:>12.3f}",
             f"{'inference (act)':<26}{cal.act_per_s:>13.1f} dec/s at b={cal.act_batch:<4}{p['inference_s']:>12.3f}",
             f"{'collect (overlapped)':<26}{'':>28}{p['collect_s']:>12.3f}",
             f"{'update':<26}{cal.update_per_s:>18.1f} dec-pass/s{p['update_s']:>12.3f}",
             f"{'sync weights':<26}{cal.sync_s:>23.4f} s pub{p['sync_s']:>12.3f}",
             f"{'step':<26}{'':>28}{p['step_s']:>12.3f}", "",
             f"bottleneck: {p['bottleneck']} ({p['bound_s']:.3f} s); the step is {p['step_over_bound']:.2f}x that bound",
             f"runner.max_steps={p['max_steps']} on {p['gpus']} device(s): {p['wall_h'] * 60:.1f} min wall-clock, "
             f"{p['device_hours']:.2f} device-hours"]
    if "measured" in record:
        m = record["measured"]
        lines.append("measured (median, steps after the first): " + ", ".join(
            f"{k} {m[k]:.3f} s" for k in MEASURED_KEYS if k in m))
    return "\n".join(lines)


def measured_times(metrics_path: Path) -> dict | None:
    """Medians of the run's phase times (see module docstring); None without training steps."""
    rows = []
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "time/step" in row:
                rows.append(row)
    if not rows:
        return None
    kept = rows[1:] if len(rows) > 1 else rows
    out = {name: statistics.median(r.get(key, 0.0) for r in kept) for name, key in MEASURED_KEYS.items()}
    out.update(steps=len(rows), first_step_excluded=len(rows) > 1, first_step_s=rows[0]["time/step"])
    return out


def write_prediction(cfg, run_dir: Path) -> dict:
    """``runner.predict_step_time``: calibrate and write ``prediction.json`` before the run's first step."""
    record = bench(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / FILE).write_text(json.dumps(record, indent=1))
    print(format_table(record), file=sys.stderr, flush=True)
    return record


def record_measured(run_dir: Path) -> dict | None:
    """At a run's end: its measured phase times into ``prediction.json`` (made when there is none), with the
    predicted / measured ratios when a prediction is there."""
    measured = measured_times(run_dir / "metrics.jsonl")
    if measured is None:
        return None
    path = run_dir / FILE
    record = json.loads(path.read_text()) if path.exists() else {}
    record["measured"] = measured
    predicted = record.get("predicted")
    if predicted:
        record["ratio"] = {k: predicted[k] / measured[k] for k in MEASURED_KEYS if measured.get(k)}
    path.write_text(json.dumps(record, indent=1))
    return record

