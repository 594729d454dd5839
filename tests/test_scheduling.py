"""bin/test's scheduling (tests/conftest.py): test files are collected longest first by the seconds a durations
file records, and a run with EMBODIRL_RECORD_DURATIONS=1 writes the seconds of the files it ran into that file,
keeping the other files' entries; each xdist worker computes on EMBODIRL_TEST_TORCH_THREADS torch threads; a run
with EMBODIRL_RECORD_CPU=<file> writes each test's CPU seconds, those of the processes it started included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest as pytest_module

ROOT = Path(__file__).resolve().parents[1]
FILES = ["tests/test_lock.py", "tests/test_packaging.py", "tests/test_runtime.py"]


def pytest(args, durations: Path, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "EMBODIRL_TEST_DURATIONS": str(durations), **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def collected_files(proc) -> list[str]:
    files = []
    for line in proc.stdout.splitlines():
        path = line.split("::", 1)[0]
        if "::" in line and (not files or files[-1] != path):
            files.append(path)
    return files


def test_files_are_collected_longest_first_and_a_new_file_before_them(tmp_path):
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({FILES[0]: 5.0, FILES[1]: 50.0}))       # FILES[2] is not listed: a new file
    proc = pytest(["--collect-only", *FILES], durations)
    assert collected_files(proc) == [FILES[2], FILES[1], FILES[0]]
    durations.write_text(json.dumps({FILES[0]: 50.0, FILES[1]: 5.0, FILES[2]: 1.0}))
    assert collected_files(pytest(["--collect-only", *FILES], durations)) == FILES


def test_a_recording_run_updates_its_files_and_keeps_the_others(tmp_path):
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({FILES[0]: 1234.0, "tests/test_schema.py": 7.0, "tests/removed.py": 3.0}))
    pytest([FILES[0], FILES[1]], durations, EMBODIRL_RECORD_DURATIONS="1")
    recorded = json.loads(durations.read_text())
    assert set(recorded) == {FILES[0], FILES[1], "tests/test_schema.py"}     # a file that is gone is dropped
    assert recorded["tests/test_schema.py"] == 7.0 and 0.0 <= recorded[FILES[0]] < 1234.0
    assert list(recorded) == sorted(recorded, key=lambda f: -recorded[f])    # written longest first


PROBE = "EMBODIRL_THREADS_PROBE"


@pytest_module.mark.skipif(PROBE not in os.environ, reason="run by the next test inside xdist workers")
@pytest_module.mark.parametrize("k", range(4))
def test_worker_threads_probe(k):
    import torch

    out = Path(os.environ[PROBE]) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{k}.json"
    out.write_text(json.dumps({"torch": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}))


def test_xdist_workers_compute_on_the_configured_number_of_threads(tmp_path):
    clean = {k: v for k, v in os.environ.items()          # as bin/test starts: nothing inherited from this run's
             if not k.startswith("PYTEST_XDIST") and k not in (  # own worker
                 "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "EMBODIRL_TEST_TORCH_THREADS")}

    def probe(setting):
        out = tmp_path / str(setting)
        out.mkdir()
        env = {**clean, PROBE: str(out), **({"EMBODIRL_TEST_TORCH_THREADS": setting} if setting else {})}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2",
                               f"{Path(__file__).relative_to(ROOT)}::test_worker_threads_probe"], cwd=ROOT,
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        seen = [json.loads(f.read_text()) for f in sorted(out.iterdir())]
        assert {f.name.split("-")[0] for f in out.iterdir()} <= {"gw0", "gw1"} and len(seen) == 4
        return seen

    assert all(s == {"torch": 1, "omp": "1"} for s in probe(None))          # the default: one thread per worker
    assert all(s == {"torch": 2, "omp": "2"} for s in probe("2"))
    assert all(s["omp"] is None for s in probe("default"))                   # torch's and OpenMP's own choice


CPU_PROBE = "EMBODIRL_CPU_PROBE"
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass"


@pytest_module.mark.skipif(CPU_PROBE not in os.environ, reason="run by the next test inside xdist workers")
@pytest_module.mark.parametrize("seconds", [0.0, 1.5])
def test_cpu_probe(seconds):
    # the CPU is spent by a child process, as the suite's CLI tests spend theirs
    subprocess.run([sys.executable, "-c", BURN.format(s=seconds)], check=True, timeout=120)


def _cgroups_writable() -> bool:
    root = Path("/sys/fs/cgroup")
    base = root if (root / "cgroup.controllers").is_file() else root / "cpuacct"
    return (base / "cgroup.procs").is_file() and os.access(base, os.W_OK)


@pytest_module.mark.skipif(not _cgroups_writable(), reason="needs a writable cgroup (v2, or v1 cpuacct)")
def test_a_cpu_recording_run_charges_each_test_with_the_processes_it_started(tmp_path):
    cpu = tmp_path / "cpu.json"
    proc = pytest(["-n", "2", f"{Path(__file__).relative_to(ROOT)}::test_cpu_probe"], tmp_path / "durations.json",
                  EMBODIRL_RECORD_CPU=str(cpu), **{CPU_PROBE: "1"})
    recorded = json.loads(cpu.read_text())
    idle, busy = (f"tests/test_scheduling.py::test_cpu_probe[{s}]" for s in ("0.0", "1.5"))
    assert set(recorded) == {idle, busy}, recorded
    assert recorded[busy] >= 1.4 and recorded[busy] > recorded[idle] + 1.0, recorded
    assert "CPU seconds by test" in proc.stdout
