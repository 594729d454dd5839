"""Ray runs through the CLI whose workers are alive but stuck, or whose driver is killed: an inference worker frozen
with SIGSTOP is found past its deadline and the run rebuilds its workers from the last checkpoint and goes on (then a
SIGTERM stops it with its checkpoint and status 75: preemption on Ray, whose own SIGTERM handler would exit with 15);
an actor rank frozen with SIGSTOP stops the run with one sentence naming it; after ``kill -9`` of the driver no Ray
process of the run is left. Each ends within 60 s (30 s for the driver's processes) with nothing of its session left
running (the state policy on the toy task: env workers, an inference worker and two actor ranks as Ray workers)."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from test_vla_cli import TOY, _session_members

from embodirl.channel import segments
from embodirl.runner import checkpoint as ckpt
from embodirl.runner.metrics_logger import read_metrics
from embodirl.runner.preemption import EXIT_PREEMPTED
from tests import cli_runs

# a 6 s floor: far above these calls' times (0.01-0.5 s), also on a loaded two-core machine, and short enough to leave
# the rebuild of every worker group (a new Ray, two actor ranks) most of the 60 s
RAY = [*TOY, "cluster.use_ray=true", "actor.cpu_world_size=2", "runner.worker_deadline.floor_s=6"]
START_TIMEOUT_S = 300.0
RECOVER_S = 60.0           # from the SIGSTOP to a step trained by the rebuilt workers, or to the run's end
GONE_S = 30.0              # from the driver's SIGKILL to no process of its run


def _start(args: list[str], cwd, run_id: str):
    env = {**os.environ, segments.RUN_ENV: run_id}
    env.pop("RAY_ADDRESS", None)
    return cli_runs.start(["train", *RAY, *args], cwd, env=env, new_session=True)


def _wait_for(condition, proc, what: str, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: " + proc.communicate()[0][-3000:]
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} within {timeout:.0f} s: " + proc.communicate()[0][-3000:])
        time.sleep(0.1)


def _train_steps(out) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    text = path.read_text()
    return [json.loads(line)["step"] for line in text[: text.rfind("\n") + 1].splitlines() if '"train/return"' in line]


def _nothing_left(proc, run_id: str, within: float) -> None:
    deadline = time.monotonic() + within
    while (left := _session_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    names = [(p.pid, p.name()) for p in left]
    for member in left:          # this test started them: do not leave them to others
        member.kill()
    shm = segments.listing(segments.run_prefix(run_id))
    segments.sweep(segments.run_prefix(run_id))
    assert not names, f"processes left running: {names}"
    assert shm == [], shm


def _freeze(out, component: str, rank: int) -> int:
    pid = json.loads((out / "placement.json").read_text())[component][rank]["pid"]
    os.kill(pid, signal.SIGSTOP)
    return pid


@pytest.mark.slow
def test_a_stopped_inference_worker_restarts_the_run_from_its_checkpoint_then_sigterm_saves(tmp_path):
    run = f"hi{os.urandom(3).hex()}"
    out = tmp_path / "outputs" / "rollout"
    proc = _start(["runner.max_steps=200", "runner.max_restarts=1", "runner.experiment_name=rollout"], tmp_path, run)
    try:
        _wait_for(lambda: (ckpt.checkpoint_root(out) / "step_2" / "COMPLETE").is_file(), proc, "step-2 checkpoint")
        frozen = _freeze(out, "rollout", 0)
        stopped_at = time.monotonic()
        before = max(_train_steps(out))
        # found past its deadline, every worker group rebuilt from the latest checkpoint, and training goes on
        _wait_for(lambda: json.loads((out / "placement.json").read_text())["rollout"][0]["pid"] != frozen
                  and max(_train_steps(out)) > before, proc, "step trained after the restart", RECOVER_S)
        recovered_s = time.monotonic() - stopped_at
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        _nothing_left(proc, run, 30.0)
    lines = [line for line in output.splitlines() if line.startswith("embodirl: ")]
    # found by the driver's wait or by the env worker's wait for its answer, whichever deadline came first
    assert lines[0].startswith(f"embodirl: inference worker 0 (pid {frozen}, node ") and "stopped) did not " in lines[0]
    assert lines[0].count("inference worker") == 1, lines[0]
    assert "runner.worker_deadline.floor_s=6" in lines[0] and "restarting (1 of 1) from" in lines[0], lines
    assert not psutil.pid_exists(frozen) or psutil.Process(frozen).status() == psutil.STATUS_ZOMBIE
    assert recovered_s < RECOVER_S
    # SIGTERM on Ray: the step under way finished, saved, status 75
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    latest = ckpt.latest_checkpoint(out)
    assert lines[-1].startswith(f"embodirl: SIGTERM received: stopped after training step {ckpt.checkpoint_step(latest)}")
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "train/return" in r]
    assert steps == list(range(1, ckpt.checkpoint_step(latest) + 1)), steps     # each step once, up to the last saved


@pytest.mark.slow
def test_a_stopped_actor_rank_stops_the_run_with_one_sentence(tmp_path):
    run = f"ha{os.urandom(3).hex()}"
    out = tmp_path / "outputs" / "actor"
    proc = _start(["runner.max_steps=200", "runner.worker_deadline.action=stop", "runner.experiment_name=actor"],
                  tmp_path, run)
    try:
        _wait_for(lambda: (ckpt.checkpoint_root(out) / "step_2" / "COMPLETE").is_file(), proc, "step-2 checkpoint")
        frozen = _freeze(out, "actor", 1)
        stopped_at = time.monotonic()
        output, _ = proc.communicate(timeout=RECOVER_S)
        ended_s = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        _nothing_left(proc, run, 30.0)
    assert proc.returncode == 1 and ended_s < RECOVER_S, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("embodirl: ")]
    assert len(lines) == 1 and "Traceback" not in output, output[-3000:]
    assert lines[0].startswith(f"embodirl: actor rank 1 (pid {frozen}, node ") and "stopped) did not finish" in lines[0]
    assert "the last complete checkpoint is outputs/actor/checkpoints/step_" in lines[0]
    assert lines[0].endswith("(runner.worker_deadline.action=stop)")


@pytest.mark.slow
def test_after_kill_9_of_the_driver_no_ray_process_of_the_run_is_left(tmp_path):
    run = f"hk{os.urandom(3).hex()}"
    out = tmp_path / "outputs" / "killed"
    proc = _start(["runner.max_steps=200", "runner.save_interval=0", "runner.experiment_name=killed"], tmp_path, run)
    try:
        _wait_for(lambda: _train_steps(out), proc, "training step")
        ray_processes = [p for p in _session_members(proc.pid) if "ray" in p.name().lower()]
        assert ray_processes, "the run should have Ray's daemons and workers in its session"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        proc.stdout.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    _nothing_left(proc, run, GONE_S)
