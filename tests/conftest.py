"""Test-wide set-up: simulator runtime (EGL, local Vulkan), torch threads, a config-compose helper. LIBERO runs on the
original assets scripts/setup.sh installs (no folder to point at)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# bin/test runs two pytest workers on two cores. torch's intra-op pool spin-waits (embodirl.runtime.torch_threads:
# a batch-8 decision took 50 ms on 2 threads beside busy simulators, 0.14 ms on 1), so two workers with a 2-thread
# pool each, plus what they start, burn the cores spinning. Under xdist each worker and the processes it starts
# compute on EMBODIRL_TEST_TORCH_THREADS threads (default 1; `default` keeps torch's and OpenMP's own choice).
# The CLI runs the tests start set their own count (runner.torch_threads, 1 on up to 4 cores). Measured on the
# in-process files (compile, FSDP, ratio-one, π0 LeRobot, SFT learner) under two workers, 1 against torch's default:
# no difference beyond this machine's noise (whole-run wall ratio 0.75-1.30 over two pairs, median 1.03).
_THREADS = os.environ.get("EMBODIRL_TEST_TORCH_THREADS", "1")
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 and _THREADS != "default":
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[_var] = _THREADS
    import torch

    torch.set_num_threads(int(_THREADS))

from embodirl import runtime  # noqa: E402

runtime.configure()


# --- LIBERO's held-out training states: the suite's sets ship with it ----------------------------------------------------
# A LIBERO training run reads its held-out start states from embodirl's cache and samples a missing set first (37-53 s
# wall for 50 states on the 2-core machine CI runs on; embodirl/envs/libero/states.py). The suite's runs use six sets,
# which a clean clone sampled on every CI run; shipping them saved 200-250 CPU-s in two clean-clone runs (2026-12-07).
# tests/envs/fixtures/libero_states holds them under their cache names, and the session copies any the cache lacks
# before the first test. A name carries the identity of what its states depend on (sampler, libero/robosuite/mujoco
# versions, assets, BDDL, official states), so a copy that no longer matches is never read: the run samples, as before.
# tests/envs/test_libero_states.py samples on its own and checks that every shipped set still has its current name.
HELDOUT_STATES = ROOT / "tests" / "envs" / "fixtures" / "libero_states"


def _seed_heldout_states() -> None:
    import shutil

    from embodirl.paths import cache_dir

    try:
        for source in sorted(HELDOUT_STATES.glob("*/*.npz")):
            target = cache_dir() / "libero_states" / source.parent.name / source.name
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                shutil.copyfile(source, partial)
                partial.replace(target)     # a reader sees the whole file or none
    except OSError as exc:                  # an unwritable cache: the runs sample their sets, as without the copies
        import warnings

        warnings.warn(f"held-out LIBERO states not copied into the cache ({exc}); runs will sample them", stacklevel=1)


@pytest.fixture
def own_forkserver():
    """Stop the simulators' forkserver this process inherited, so the test's first vector env starts one with its
    adapter's preload, as a run's does. A process has one forkserver and it keeps the preload it started with: in a
    pytest worker the first vector env (toy, LIBERO) started it without ManiSkill's, and every ManiSkill simulator
    forked from it imported ManiSkill itself (~4 CPU-s each; tests/rollout/test_heldout_starts.py took 122 CPU-s with
    it, 64 without, 2026-12-07 on the 2-core machine). ``_stop`` is how CPython's own tests stop it; a no-op when none
    runs. A run is not affected: its simulators are of one adapter."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()


@pytest.fixture
def compose_cfg():
    """``compose_cfg(*overrides)`` -> the composed (hydra-free) config."""
    from embodirl.config import compose

    return lambda *overrides: compose(list(overrides))


# --- scheduling: the costliest test files start first --------------------------------------------------------------
# bin/test runs two pytest-xdist workers with `--dist loadfile --no-loadscope-reorder`: a file runs on one worker,
# and files are handed out in collection order. xdist's own order (most tests first) put the single-test chains
# (SFT -> RL, the default job: 2-5 minutes each) last, where one worker could run them alone while the other idled.
# Sorting files by their measured seconds, longest first, is the longest-processing-time rule. Measured on a quiet
# clean clone it was no faster (pytest 1621 s against 1586 s): the heaviest files then ran side by side and slowed
# each other (SFT -> RL 750 s instead of 294 s alone), its SFT on 2 spinning threads beside the other worker (now 1,
# as every worker, above). tests/durations.json
# holds those seconds (per file: setup, call and teardown of every test); `EMBODIRL_RECORD_DURATIONS=1 bin/test`
# updates it from the run (EMBODIRL_TEST_DURATIONS names another file). A file it does not list (a new one) goes
# first, where a long test costs least.
DURATIONS = Path(os.environ.get("EMBODIRL_TEST_DURATIONS") or Path(__file__).with_name("durations.json"))


def _file_costs() -> dict[str, float]:
    import json

    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def pytest_collection_modifyitems(config, items):
    costs = _file_costs()
    if costs:
        items.sort(key=lambda item: -costs.get(item.nodeid.split("::", 1)[0], float("inf")))   # stable in a file


_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _seconds[path] = _seconds.get(path, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    _finish_cpu(session)
    # the controller (or a run without workers) sees every report; a worker only its own
    if os.environ.get("EMBODIRL_RECORD_DURATIONS") == "1" and not hasattr(session.config, "workerinput") and _seconds:
        import json

        merged = {**_file_costs(), **{p: round(s, 1) for p, s in _seconds.items()}}   # a partial run updates its files
        merged = {p: s for p, s in merged.items() if (ROOT / p).is_file()}               # and drops removed ones
        ranked = dict(sorted(merged.items(), key=lambda kv: -kv[1]))
        DURATIONS.write_text(json.dumps(ranked, indent=1) + "\n")


# --- CPU per test: what each test costs the machine, every process it starts included --------------------------------
# The suite is bound by two cores, so a test's price is its CPU seconds, not its wall time (which doubles when the other
# worker is busy). `EMBODIRL_RECORD_CPU=<file> bin/test` puts each pytest process in its own cpuacct cgroup (cgroup v1
# or v2; children inherit it, so simulators, Ray daemons and CLI runs count even when they outlive their parent) and
# writes {test id: CPU seconds of setup, call and teardown} to <file>, with a summary of the costliest tests at the end.
# Processes still alive after a test are charged to the tests that follow; `left` counts them.
_CPU_FILE = os.environ.get("EMBODIRL_RECORD_CPU")


class _CpuGroup:
    """A cgroup this process moved into; ``usage()`` is the CPU seconds of everything in it so far."""

    def __init__(self, name: str):
        # beneath the group this process is in, so that an outer measurement still counts this one
        current = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
        v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpuacct")
        v1_key = next((k for k in current if "cpuacct" in k.split(",")), None)
        if (v2 / "cgroup.controllers").is_file():
            self.path, self._usage = v2 / current[""].lstrip("/") / name, self._usage_v2
        elif (v1 / "cpuacct.usage").is_file() and v1_key is not None:
            self.path, self._usage = v1 / current[v1_key].lstrip("/") / name, self._usage_v1
        else:
            raise OSError("no cgroup v2 and no cgroup v1 cpuacct hierarchy under /sys/fs/cgroup")
        self.path.mkdir(exist_ok=True)
        (self.path / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def _usage_v1(self) -> float:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def _usage_v2(self) -> float:
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6

    def usage(self) -> float:
        return self._usage()

    def leave(self) -> None:
        """Move this process back to the parent group and remove this one if nothing is left in it."""
        (self.path.parent / "cgroup.procs").write_text(f"{os.getpid()}\n")
        try:
            self.path.rmdir()
        except OSError:     # processes that outlived the session are still in it
            pass

    def others(self) -> int:
        return sum(1 for pid in (self.path / "cgroup.procs").read_text().split() if int(pid) != os.getpid())


_cpu_group: _CpuGroup | None = None
_cpu_rows: list[dict] = []


def pytest_configure(config):
    global _cpu_group
    if not hasattr(config, "workerinput"):  # once, before any worker starts
        _seed_heldout_states()
    if _CPU_FILE:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        try:
            _cpu_group = _CpuGroup(f"embodirl_tests_{worker}_{os.getpid()}")
        except OSError as exc:
            import warnings

            warnings.warn(f"EMBODIRL_RECORD_CPU: cannot make a cgroup ({exc}); CPU per test is not recorded", stacklevel=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _cpu_group is None:
        yield
        return
    before = _cpu_group.usage()
    yield
    _cpu_rows.append({"test": item.nodeid, "cpu_s": round(_cpu_group.usage() - before, 2), "left": _cpu_group.others()})


def _finish_cpu(session) -> None:
    import json

    if _cpu_group is None:
        return
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:            # an xdist worker hands its rows to the controller (pytest_testnodedown)
        workeroutput["embodirl_cpu"] = json.dumps(_cpu_rows)
        return
    _cpu_rows.sort(key=lambda r: -r["cpu_s"])
    Path(_CPU_FILE).write_text(json.dumps({r["test"]: r["cpu_s"] for r in _cpu_rows}, indent=1) + "\n")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    import json

    _cpu_rows.extend(json.loads(getattr(node, "workeroutput", {}).get("embodirl_cpu", "[]")))


def pytest_unconfigure(config):
    if _cpu_group is not None:
        _cpu_group.leave()


def pytest_terminal_summary(terminalreporter):
    if _cpu_group is None or not _cpu_rows or hasattr(terminalreporter.config, "workerinput"):
        return
    total = sum(r["cpu_s"] for r in _cpu_rows)
    terminalreporter.write_sep("=", f"CPU seconds by test, every process it started: {total:.0f} s in "
                                    f"{len(_cpu_rows)} tests ({_CPU_FILE})")
    for r in _cpu_rows[:40]:
        left = f"  ({r['left']} processes left after it)" if r["left"] else ""
        terminalreporter.write_line(f"{r['cpu_s']:9.1f}  {r['test']}{left}")
