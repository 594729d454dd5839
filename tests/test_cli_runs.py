"""The suite's ``embodirl`` runner (tests/cli_runs.py): a run forked from the zygote answers as a real
``python -m embodirl.cli`` process does (status, standard output and error, working directory), a run with an
environment of its own gets a real process, and a timeout kills the run and raises as ``subprocess.run`` does; a
started run (``cli_runs.start``) answers as ``subprocess.Popen`` does, in a session of its own when asked."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from tests import cli_runs

TOY = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "runner.progress_bar=false"]


def _real(args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([*cli_runs.EXE, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args", [["train", "env.train.reward_coef=nan"], ["train", "--cfg", "job", *TOY],
                                  ["fit"], ["--help"]])
def test_a_forked_run_answers_as_a_real_process(tmp_path, args):
    forked, real = cli_runs.run(args, tmp_path), _real(args, tmp_path)
    assert cli_runs._zygote is not None and cli_runs._zygote.alive()
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert list(tmp_path.iterdir()) == []


def test_a_run_writes_where_it_is_started_and_one_with_its_own_environment_gets_a_real_process(tmp_path):
    args = [*TOY, "env.train.num_envs=2", "runner.max_steps=1", "runner.val_check_interval=0",
            "runner.save_interval=0", "runner.logger.tensorboard=false"]
    forked = cli_runs.run(["train", *args, "runner.experiment_name=a"], tmp_path, expect=0)
    assert (tmp_path / "outputs" / "a" / "metrics.jsonl").is_file()
    assert cli_runs._zygote.serves(dict(os.environ))
    own = {**os.environ, "EMBODIRL_PROGRESS_INTERVAL_S": "0"}     # read once, when embodirl.progress is imported
    assert not cli_runs._zygote.serves(own)
    real = cli_runs.run(["train", *args, "runner.experiment_name=b"], tmp_path, env=own, expect=0)
    assert "rollout: decision 1 of" in real.stdout + real.stderr          # progress lines due at once
    assert "rollout: decision" not in forked.stdout + forked.stderr       # every 30 s


def test_a_timeout_kills_the_run_and_raises(tmp_path):
    before = {p.pid for p in psutil.Process(cli_runs._get_zygote().proc.pid).children()}
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        cli_runs.run(["train", *TOY, "runner.max_steps=100000"], tmp_path, timeout=5)
    assert time.monotonic() - started < 60
    deadline = time.monotonic() + 30
    while {p.pid for p in psutil.Process(cli_runs._zygote.proc.pid).children()} - before:
        assert time.monotonic() < deadline, "the timed-out run is still alive"
        time.sleep(0.2)


def test_a_started_run_answers_as_a_popen_does(tmp_path):
    args = ["train", "env.train.reward_coef=nan"]
    forked = cli_runs.start(args, tmp_path)
    assert isinstance(forked, cli_runs._Started)
    real = subprocess.Popen([*cli_runs.EXE, *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert forked.communicate(timeout=300) == real.communicate(timeout=300)
    assert forked.returncode == real.returncode == 2
    assert forked.poll() == forked.wait() == 2


def test_a_started_run_leads_its_own_session_and_ends_by_a_signal(tmp_path):
    proc = cli_runs.start(["train", *TOY, "runner.max_steps=100000", "runner.logger.tensorboard=false"], tmp_path,
                          new_session=True, default_sigint=True)
    assert os.getsid(proc.pid) == proc.pid and proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(timeout=1)
    metrics = tmp_path / "outputs"
    deadline = time.monotonic() + 120
    while not list(metrics.rglob("metrics.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)          # Ctrl-C: the run ends itself
    output, _ = proc.communicate(timeout=120)
    assert "embodirl: interrupted" in output and proc.returncode not in (0, None)
    stuck = cli_runs.start(["train", *TOY, "runner.max_steps=100000"], tmp_path)
    stuck.kill()
    assert stuck.wait(timeout=60) == -signal.SIGKILL
