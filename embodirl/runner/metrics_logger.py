"""Where a run's numbers go: console lines, ``metrics.jsonl`` (always), TensorBoard (default) and
wandb (optional; ``wandb_mode: offline`` needs no network).

``metrics.jsonl`` holds one JSON object per logged step: ``{"step": n, "wall_time": s, <name>: value}``.
When a run resumes from step k, lines for steps after k (written by the interrupted run after its last
checkpoint) are dropped so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

# Shown on the console line, in this order, when present.
CONSOLE_KEYS = ("train/success_rate", "eval/success_rate", "train/return", "train/episode_length",
                "actor/pg_loss", "critic/value_loss", "actor/approx_kl", "actor/entropy",
                "time/step", "env/steps_per_s")


def _scalar(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class MetricsLogger:
    """Fan-out of per-step scalar metrics to every configured sink."""

    def __init__(self, output_dir: str | Path, *, console: bool = True, tensorboard: bool = True,
                 wandb: bool = False, wandb_mode: str = "offline", project: str = "embodirl",
                 run_name: str | None = None, config: Mapping | None = None, resume_step: int | None = None):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / "metrics.jsonl"
        if resume_step is not None:
            self._truncate_after(resume_step)
        self._file = self.path.open("a", encoding="utf-8")
        self.console = console
        self._start = time.time()
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), purge_step=resume_step)
        self._wandb = None
        if wandb:
            import wandb as wandb_lib  # optional extra

            self._wandb = wandb_lib.init(project=project, name=run_name, mode=wandb_mode,
                                         dir=str(self.output_dir), config=dict(config or {}),
                                         resume="allow")

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line).get("step", -1) <= step]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        clean = {k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
        record = {"step": int(step), "wall_time": round(time.time() - self._start, 3), **clean}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self.console:
            shown = [f"{k.split('/', 1)[-1]}={clean[k]:.4g}" for k in CONSOLE_KEYS if k in clean]
            print(f"[step {step:>5}] " + "  ".join(shown), flush=True)
        return record

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a ``metrics.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
