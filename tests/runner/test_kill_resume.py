"""A training run killed with SIGKILL after a checkpoint resumes where it was and reproduces the
uninterrupted run: the real CLI on the toy task (simulators in sub-processes) with the state policy."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from embodirl import checkpoint_layout as layout
from embodirl.runner import checkpoint as ckpt
from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

BASE = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.num_envs=4",
        "env.eval.num_envs=4", "env.train.processes=true", "runner.progress_bar=false",
        "runner.logger.tensorboard=false", "runner.val_check_interval=0"]
MAX_STEPS, SAVE_INTERVAL = 12, 5
COMPARED = ("train/return", "actor/pg_loss", "critic/value_loss", "actor/approx_kl", "actor/entropy")
START_TIMEOUT_S = 300.0
POLL_S = 0.01


def train(name: str, cwd):
    return cli_runs.start(["train", *BASE, f"runner.max_steps={MAX_STEPS}", f"runner.save_interval={SAVE_INTERVAL}",
                           f"runner.experiment_name={name}"], cwd)


def logged_steps(path) -> list[int]:
    """Steps of the complete lines of a metrics.jsonl that another process is writing."""
    if not path.is_file():
        return []
    text = path.read_text()
    return [json.loads(line)["step"] for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_sigkill_after_checkpoint_then_resume_matches_uninterrupted_run(tmp_path):
    full = train("full", tmp_path)              # the reference, alongside the run that gets killed
    victim = train("part", tmp_path)
    out = tmp_path / "outputs" / "part"
    first_ckpt = ckpt.checkpoint_root(out) / f"step_{SAVE_INTERVAL}" / layout.COMPLETE
    deadline = time.monotonic() + START_TIMEOUT_S
    # kill while a step after the first checkpoint is under way (its predecessor already logged)
    while not (first_ckpt.is_file() and max(logged_steps(out / "metrics.jsonl"), default=0) > SAVE_INTERVAL):
        assert victim.poll() is None, victim.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the run never reached its first checkpoint"
        time.sleep(POLL_S)
    children = psutil.Process(victim.pid).children(recursive=True)
    os.kill(victim.pid, signal.SIGKILL)
    assert victim.wait(timeout=30) == -signal.SIGKILL
    victim.stdout.close()
    assert children, "the toy env with processes=true should run its simulators in sub-processes"
    # the simulator sub-processes (and the fork server) notice their owner is gone and exit
    deadline = time.monotonic() + 30
    while not all(gone(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in children), [p.pid for p in children if not gone(p)]

    resumed_from = ckpt.latest_checkpoint(out)
    k = ckpt.checkpoint_step(resumed_from)
    before = logged_steps(out / "metrics.jsonl")
    assert SAVE_INTERVAL <= k < MAX_STEPS and max(before) > k, (k, before)   # steps after k were logged

    again = cli_runs.run(["train", *BASE, f"runner.max_steps={MAX_STEPS}", f"runner.save_interval={SAVE_INTERVAL}",
                          "runner.experiment_name=part"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {resumed_from.relative_to(tmp_path)} (step {k})" in again.stdout + again.stderr
    assert full.wait(timeout=600) == 0, full.stdout.read()[-3000:]
    full.stdout.close()

    reference = read_metrics(tmp_path / "outputs" / "full" / "metrics.jsonl")
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, MAX_STEPS + 1))   # no step twice
    for a, b in zip(reference, resumed):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
    assert [p.name for p in ckpt.list_checkpoints(out)] == [f"step_{s}" for s in (5, 10, 12)]
    assert not [p for p in ckpt.checkpoint_root(out).iterdir() if p.name.startswith(".")]
