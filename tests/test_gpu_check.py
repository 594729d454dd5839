"""``scripts/gpu_check.sh --cpu``: the one-command GPU check, in its CPU mode (the tiny preset through the same
steps: dry run, policy and actor benchmarks, a 3-step in-process CLI run with an evaluation and a checkpoint, and
``embodirl eval`` from it, and π0's act and update), so that the script a lent GPU machine runs cannot rot unnoticed.
The CPU mode runs every step and code path at its smallest sizes (``MODES["cpu"]`` in scripts/gpu_check.py): about
2 CPU-minutes, almost all of it the seven Python processes' start-up, imports and model builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_check_cpu_mode_passes_and_writes_its_report(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(out), "--work", str(work)],
                          capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "EMBODIRL_PYTHON": sys.executable})
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and report["mode"] == "cpu" and report["preset"] == "openvla_oft_tiny"
    assert list(report["steps"]) == ["environment", "dry_run", "train", "eval", "policy", "actor", "pi0"]
    assert all(step["ok"] for step in report["steps"].values())
    train = report["steps"]["train"]["result"]
    assert [s["step"] for s in train["steps"]] == [1, 2, 3] and train["eval"]["eval/episodes"] == 32
    assert all(s["actor/first_step_ratio_error"] < 1e-6 for s in train["steps"])   # the rollout acts with the actor's module
    assert report["steps"]["eval"]["result"]["n_episodes"] == 32
    assert report["targets"]["act"]["decisions_per_s"] > 0 and report["targets"]["actor"]["decisions_per_s"] > 0
    pi0 = report["targets"]["pi0"]             # the second VLA family: act at two batch sizes and one update
    assert sorted(pi0["act"]) == ["1", "4"] and all(r["decisions_per_s"] > 0 for r in pi0["act"].values())
    assert pi0["update_decisions_per_s"] > 0 and pi0["update"]["model_tflops"] > 0
    # MFU counts the update once; HFU adds the recomputed forwards of the gradient checkpointing both were run with
    actor = report["targets"]["actor"]
    assert actor["gradient_checkpointing"] and actor["hardware_tflops"] > actor["model_tflops"] > 0
    assert pi0["update"]["gradient_checkpointing"] and pi0["update"]["hardware_tflops"] > pi0["update"]["model_tflops"]
    assert len(list(out.iterdir())) <= 8          # what a lent GPU machine sends back


def test_utilisation_refuses_a_dry_run_of_other_checkpointing():
    """MFU from a dry run without checkpointing and an update timed with it (or the reverse) is refused."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    dry = {"update_model_flops_per_decision": 2e12, "update_hardware_flops_per_decision": 3e12,
           "gradient_checkpointing": True}
    got = gpu_check.utilisation(100.0, dry, {"gradient_checkpointing": True}, 1000.0)
    assert got["mfu"] == pytest.approx(0.2) and got["hfu"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="gradient checkpointing"):
        gpu_check.utilisation(100.0, dry, {"gradient_checkpointing": False}, 1000.0)
    assert gpu_check.checkpointing_of(["--gradient-checkpointing", "off"]) is False
    assert gpu_check.checkpointing_of(["--trajectories", "4"]) is True


def test_gpu_check_stops_at_the_first_failing_step(tmp_path):
    """GPU mode on a machine without CUDA: the first step fails loudly, in one line and in the report."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "EMBODIRL_PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "",
                               "WHEELS": str(tmp_path / "no_wheels")})   # a developer's .whl/ is for Python 3.12
    assert proc.returncode == 1
    assert "step environment failed" in proc.stderr and "use --cpu" in proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["failed"] == "environment" and not report["steps"]["environment"]["ok"]
