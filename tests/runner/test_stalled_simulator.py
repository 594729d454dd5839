"""A simulator process that stops answering (a hang, not a crash) is killed after ``env.step_timeout_s``,
replaced, and its episode collected again: a real training run through the CLI with a toy simulator process
that hangs on purpose."""

from __future__ import annotations

import os

import pytest

from embodirl.config import compose, validate
from embodirl.errors import ConfigError
from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

TOY = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.num_envs=4",
       "env.eval.num_envs=4", "runner.progress_bar=false", "runner.logger.tensorboard=false",
       "runner.val_check_interval=0", "runner.save_interval=0"]


def test_a_hung_simulator_is_replaced_and_its_episode_collected_again(tmp_path):
    marker = tmp_path / "hung"
    proc = cli_runs.run(["train", *TOY, "runner.max_steps=2", "env.train.processes=true", "env.train.hang_at_step=2",
                         f"env.train.hang_marker={marker}", "env.train.step_timeout_s=3", "runner.experiment_name=hang"],
                        tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.is_file()                                     # one simulator did hang
    records = read_metrics(tmp_path / "outputs" / "hang" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert sum(r["train/dropped_episodes"] for r in records) >= 1   # its episode was collected again
    assert all(r["train/episodes"] >= 4 for r in records)


@pytest.mark.parametrize("override, key", [
    ("env.train.step_timeout_s=0", "env.train.step_timeout_s"),
    ("env.eval.step_timeout_s=-1", "env.eval.step_timeout_s"),
    ("env.train.hang_at_step=2", "env.hang_at_step"),            # no marker, no processes
])
def test_timeout_and_hang_settings_are_checked(override, key):
    with pytest.raises(ConfigError) as exc:
        validate(compose([*TOY, override]))
    assert key in str(exc.value) and "\n" not in str(exc.value)


def _simulator_processes(root: int) -> list:
    """The simulator processes under ``root``: processes forked under its multiprocessing fork server that fork
    nothing themselves (the server that imported the simulator once and forks the simulators is not one of them:
    freezing it would stall the replacement of a simulator, not a step)."""
    import psutil

    found = []
    for child in psutil.Process(root).children(recursive=True):
        try:
            if "forkserver" in " ".join(child.parent().cmdline()) and not child.children():
                found.append(child)
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
def test_frozen_simulators_are_replaced_within_seconds(tmp_path):
    """The default job (ManiSkill PushCube, state) on 4 simulator processes; after step 2 two of them are frozen
    with SIGSTOP (6 steps remain, 1.1-2.5 s each on the 2-core machine, 2026-12-07: several seconds even on a fast
    machine, so the freeze lands in a collection however long this test takes to find the processes on a busy one;
    it was found within step 3). Each is found hung from its own recent
    step latency (10 s floor; env.step_timeout_s stays 300 s), both in the same wait, killed with SIGKILL and
    replaced, and their episodes collected again: that step takes well under 30 s longer than the others, and no
    frozen process is left behind."""
    import signal
    import statistics
    import time

    import psutil

    out = tmp_path / "run"
    proc = cli_runs.start(["train", "env.train.num_envs=4", "actor.global_batch_size=8", "runner.max_steps=8",
                           "runner.val_check_interval=0", "runner.save_interval=0", "runner.progress_bar=false",
                           "runner.logger.tensorboard=false", f"runner.output_dir={out}"], tmp_path)
    frozen = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.is_file() and any(r["step"] >= 2 for r in read_metrics(metrics)):
                frozen = _simulator_processes(proc.pid)[:2]
                for p in frozen:
                    os.kill(p.pid, signal.SIGSTOP)
                break
            time.sleep(0.2)
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert len(frozen) == 2
    assert "did not answer 'step' within 10.0 s" in output
    assert not [p for p in frozen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    records = read_metrics(out / "metrics.jsonl")
    steps = {r["step"]: r for r in records}
    hit = max(steps, key=lambda s: steps[s]["time/step"])
    usual = statistics.median(r["time/step"] for s, r in steps.items() if s != hit)
    assert hit >= 3 and steps[hit]["train/dropped_episodes"] >= 2
    assert steps[hit]["time/step"] - usual < 30, (steps[hit]["time/step"], usual)
