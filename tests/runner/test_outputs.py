"""Run outputs: metrics sinks, atomic checkpoints, the evaluation report."""

import json
import os
import random

import numpy as np
import pytest
import torch

from embodirl.runner import checkpoint as ckpt
from embodirl.runner.eval_report import EpisodeResult, build_eval_info, plot_success, write_eval_info
from embodirl.runner.metrics_logger import MetricsLogger, read_metrics


def test_metrics_jsonl_tensorboard_and_resume_truncation(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, tensorboard=True)
    for step in range(1, 6):
        logger.log(step, {"train/success_rate": step / 10, "actor/policy_loss": torch.tensor(0.5), "bad": float("nan")})
    logger.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[2]["train/success_rate"] == pytest.approx(0.3)
    assert records[2]["bad"] is None and records[2]["nonfinite"] == ["bad"]      # logged as such, not dropped
    assert "success_rate=0.3" in capsys.readouterr().out
    assert any((tmp_path / "tensorboard").iterdir())
    # resume after the checkpoint of step 3: steps 4-5 of the interrupted run are dropped
    logger = MetricsLogger(tmp_path, tensorboard=False, console=False, resume_step=3)
    logger.log(4, {"train/success_rate": 0.9})
    logger.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[-1]["train/success_rate"] == 0.9


def _write(name):
    def write(folder):
        (folder / f"{name}.txt").write_text(name)
    return write


def test_checkpoints_are_atomic_and_latest_ignores_partial(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None
    ckpt.save_checkpoint(tmp_path, 10, {"a": _write("a")})
    ckpt.save_checkpoint(tmp_path, 20, {"a": _write("a"), "b": _write("b")})

    def crash(folder):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        ckpt.save_checkpoint(tmp_path, 30, {"a": _write("a"), "b": crash})
    # a folder renamed into place without its marker (e.g. by hand) does not count either
    (ckpt.checkpoint_root(tmp_path) / "step_40").mkdir()
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest.name == "step_20" and (latest / "b" / "b.txt").read_text() == "b"
    assert ckpt.checkpoint_step(latest) == 20
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.checkpoint_step(ckpt.checkpoint_root(tmp_path) / "step_40")
    ckpt.save_checkpoint(tmp_path, 50, {"a": _write("a")}, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_20", "step_50"]


def test_rng_roundtrip(tmp_path):
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    ckpt.save_rng(tmp_path)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    ckpt.load_rng(tmp_path)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_eval_info_shape_and_plot(tmp_path):
    episodes = [EpisodeResult("libero_10", t, f"task {t}", k, success=(k + t) % 2 == 0, episode_return=float(k),
                              length=10 + k, video_path=f"videos/t{t}_ep{k}.mp4" if k == 0 else None)
                for t in range(3) for k in range(4)]
    info = build_eval_info(episodes, eval_s=1.5)
    assert info["overall"]["n_episodes"] == 12 and info["overall"]["success_rate"] == 0.5
    assert [r["success_rate"] for r in info["per_task"]] == [0.5, 0.5, 0.5]
    assert info["per_suite"]["libero_10"]["n_tasks"] == 3
    assert info["per_task"][1]["video_paths"] == ["videos/t1_ep0.mp4"]
    assert info["per_episode"][5]["return"] == 1.0
    path = write_eval_info(info, tmp_path)
    assert json.loads(path.read_text())["overall"]["eval_s"] == 1.5
    png = plot_success(info, tmp_path / "success.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 1000
