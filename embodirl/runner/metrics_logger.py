"""Where a run's numbers go: console lines, ``metrics.jsonl`` (always), TensorBoard (default) and
wandb (optional; ``wandb_mode: offline`` needs no network). Besides scalars, TensorBoard and wandb get the
run's hyper-parameters (:meth:`MetricsLogger.log_hparams`), pictures such as the learning curve
(:meth:`MetricsLogger.log_image`) and evaluation videos (:meth:`MetricsLogger.log_video`; an animated GIF in
an image summary, what TensorBoard's video panel reads, encoded here without moviepy).

``metrics.jsonl`` holds one JSON object per logged step: ``{"step": n, "wall_time": s, <name>: value}``. A value that
is not a finite number (a NaN loss, an infinite KL) is written as ``null`` and its name listed in the record's
``nonfinite`` (``{"actor/entropy": null, "nonfinite": ["actor/entropy"]}``; JSON has no NaN), and TensorBoard, wandb
and the console get it as it is. When a run resumes from step k, lines for steps after k (written by the interrupted
run after its last checkpoint) are dropped so the file reads as one uninterrupted run. Every record is flushed and
fsync'ed as it is appended, and the file is rewritten on resume through a temporary file and a rename, so a power loss
or a full disk costs at most the line being written: a torn line (not JSON) is skipped with a warning when the file is
read.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

# Shown on the console line, in this order, when present.
CONSOLE_KEYS = ("train/success_rate", "eval/success_rate", "train/return", "train/episode_length",
                "sft/loss", "sft/token_accuracy", "sft/action_l1",
                "actor/pg_loss", "critic/value_loss", "actor/approx_kl", "actor/entropy",
                "time/step", "env/steps_per_s")


def _scalar(value) -> float | None:
    """``value`` as a float (NaN and infinities included); None when it is not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _record(step: int, wall_time: float, values: Mapping[str, float], **extra) -> dict:
    """A ``metrics.jsonl`` record: non-finite values as ``null``, named in ``nonfinite`` (see module docstring)."""
    nonfinite = [k for k, v in values.items() if not math.isfinite(v)]
    record = {"step": int(step), "wall_time": wall_time, **extra,
              **{k: (v if math.isfinite(v) else None) for k, v in values.items()}}
    if nonfinite:
        record["nonfinite"] = nonfinite
    return record


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
        """Keep the records up to ``step`` (and drop torn lines): a temporary file renamed over the old one."""
        if not self.path.exists():
            return
        kept = [record for record in read_metrics(self.path) if record.get("step", -1) <= step]
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with tmp.open("w", encoding="utf-8") as handle:
            handle.write("".join(json.dumps(record) + "\n" for record in kept))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.output_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _append(self, record: dict) -> None:
        """One line, on disk before the call returns."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def log(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        clean = {k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
        record = _record(step, round(time.time() - self._start, 3), clean)
        self._append(record)
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

    def event(self, step: int, kind: str, message: str, metrics: Mapping[str, float] | None = None) -> dict:
        """Something that happened to the run (the collapse guard's trip): one ``metrics.jsonl`` record with
        ``event`` and ``message`` beside its scalars, a console line, and TensorBoard text."""
        clean = {k: v for k, v in ((k, _scalar(v)) for k, v in (metrics or {}).items()) if v is not None}
        record = _record(step, round(time.time() - self._start, 3), clean, event=kind, message=message)
        self._append(record)
        if self._tb is not None:
            self._tb.add_text(f"events/{kind}", message, global_step=step)
            for key, value in clean.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({**clean, f"events/{kind}": message}, step=step)
        print(f"[{kind}] {message}", flush=True)
        return record

    def log_hparams(self, config: Mapping) -> None:
        """The run's config: flattened ``a.b.c`` values in TensorBoard's HParams panel and as YAML text
        (wandb has it from ``init``)."""
        if self._tb is None:
            return
        from torch.utils.tensorboard.summary import hparams

        flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flatten(config).items()}
        experiment, start, end = hparams(flat, {"eval/success_rate": float("nan")})
        writer = self._tb.file_writer
        assert writer is not None        # SummaryWriter opens its file writer when it is made
        for summary in (experiment, start, end):
            writer.add_summary(summary)
        import yaml

        self._tb.add_text("config", "```\n" + yaml.safe_dump(dict(config), sort_keys=False) + "```")
        self._tb.flush()

    def log_image(self, tag: str, path: str | Path, step: int) -> None:
        """A PNG (e.g. ``learning_curve.png``) under ``tag``."""
        if self._tb is None and self._wandb is None:
            return
        import numpy as np
        from PIL import Image

        image = np.asarray(Image.open(path).convert("RGB"))                          # (h, w, 3) uint8
        if self._tb is not None:
            self._tb.add_image(tag, image, global_step=step, dataformats="HWC")
            self._tb.flush()
        if self._wandb is not None:
            import wandb as wandb_lib

            self._wandb.log({tag: wandb_lib.Image(str(path))}, step=step)

    def log_video(self, tag: str, path: str | Path, step: int, fps: float = 10.0, max_side: int = 256) -> None:
        """An mp4 (an evaluation episode) under ``tag``, downscaled to at most ``max_side`` pixels."""
        if self._tb is None and self._wandb is None:
            return
        import imageio.v3 as iio
        from PIL import Image

        frames = [Image.fromarray(f) for f in iio.imread(path)]                        # T x (h, w, 3)
        scale = min(1.0, max_side / max(frames[0].size))
        if scale < 1.0:
            size = (max(1, int(frames[0].width * scale)), max(1, int(frames[0].height * scale)))
            frames = [f.resize(size) for f in frames]
        if self._tb is not None:
            import io

            from tensorboard.compat.proto.summary_pb2 import Summary

            buffer = io.BytesIO()
            frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:],
                           duration=int(1000 / fps), loop=0)
            image = Summary.Image(height=frames[0].height, width=frames[0].width, colorspace=3,
                                  encoded_image_string=buffer.getvalue())
            writer = self._tb.file_writer
            assert writer is not None    # SummaryWriter opens its file writer when it is made
            writer.add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)
            self._tb.flush()
        if self._wandb is not None:
            import wandb as wandb_lib

            self._wandb.log({tag: wandb_lib.Video(str(path), fps=int(fps), format="mp4")}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def flatten(tree: Mapping, prefix: str = "") -> dict:
    """A nested mapping's leaves under dotted names (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``), each after ``prefix``."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a ``metrics.jsonl``; a line that is not JSON (torn by a power loss or a full disk while it
    was written) is skipped with a warning naming it."""
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            log.warning("%s: line %d is not a JSON record (a write cut short); skipped", path, number)
            continue
        records.append(record)
    return records
