"""Preemption through the CLI with real signals: SIGUSR1 (Slurm's ``--signal``) and SIGTERM (Kubernetes, Slurm's end of
a job) each make a training run finish the step under way, write its checkpoint and exit with status 75; the same
command then resumes from that checkpoint, and the run interrupted twice and resumed twice logs the same metrics as
the uninterrupted run beside it (the toy task, simulators in sub-processes, the state policy, in one process)."""

from __future__ import annotations

import signal
import time

import pytest
from test_kill_resume import BASE, COMPARED, POLL_S, START_TIMEOUT_S, logged_steps

from embodirl.runner import checkpoint as ckpt
from embodirl.runner.metrics_logger import read_metrics
from embodirl.runner.preemption import EXIT_PREEMPTED
from tests import cli_runs

MAX_STEPS, SAVE_INTERVAL = 12, 5     # the signals land between the regular checkpoints (5, 10, 12)


def _args(name: str) -> list[str]:
    return ["train", *BASE, "cluster.use_ray=false", f"runner.max_steps={MAX_STEPS}",
            f"runner.save_interval={SAVE_INTERVAL}", f"runner.experiment_name={name}",
            "runner.keep_last=null"]        # every checkpoint kept: the test counts them


def _signal_after(proc, metrics, step: int, sig: int) -> str:
    """Send ``sig`` once ``step`` is logged; the run's whole output."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while max(logged_steps(metrics), default=0) < step:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"the run never logged step {step}"
        time.sleep(POLL_S)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=300)
    return output


@pytest.mark.slow
def test_a_signal_saves_the_step_and_the_resumed_run_matches_the_uninterrupted_one(tmp_path):
    full = cli_runs.start(_args("full"), tmp_path)
    out = tmp_path / "outputs" / "part"
    resumed_at = []
    for after, sig in ((2, signal.SIGUSR1), (7, signal.SIGTERM)):
        proc = cli_runs.start(_args("part"), tmp_path)
        output = _signal_after(proc, out / "metrics.jsonl", after, sig)
        assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
        # the step under way when the signal came was finished and saved (not the regular checkpoint before it)
        latest = ckpt.latest_checkpoint(out)
        k = ckpt.checkpoint_step(latest)
        assert after <= k < MAX_STEPS, (k, output[-3000:])
        assert max(logged_steps(out / "metrics.jsonl")) == k
        lines = [line for line in output.splitlines() if line.startswith("embodirl: ")]
        assert lines[-1] == (f"embodirl: {sig.name} received: stopped after training step {k} with its checkpoint "
                             f"{latest.relative_to(tmp_path)}; run the same command to resume from it"), output[-3000:]
        assert "Traceback" not in output
        resumed_at.append(k)
    again = cli_runs.run(_args("part"), tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"(step {resumed_at[-1]})" in again.stdout + again.stderr
    assert full.wait(timeout=600) == 0, full.stdout.read()[-3000:]
    full.stdout.close()

    reference = read_metrics(tmp_path / "outputs" / "full" / "metrics.jsonl")
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, MAX_STEPS + 1))      # no step lost, none twice
    for a, b in zip(reference, resumed):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
    saved = {ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(out)}
    assert saved == {5, 10, 12, *resumed_at}
