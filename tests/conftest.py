"""Test-wide set-up: simulator runtime (EGL, local Vulkan), LIBERO assets, a config-compose helper."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SHARED_ASSETS = ROOT.parent / "shared" / "libero_assets"
if "EMBODIRL_LIBERO_ASSETS" not in os.environ and _SHARED_ASSETS.is_dir():
    os.environ["EMBODIRL_LIBERO_ASSETS"] = str(_SHARED_ASSETS)
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
    # the controller (or a run without workers) sees every report; a worker only its own
    if os.environ.get("EMBODIRL_RECORD_DURATIONS") == "1" and not hasattr(session.config, "workerinput") and _seconds:
        import json

        merged = {**_file_costs(), **{p: round(s, 1) for p, s in _seconds.items()}}   # a partial run updates its files
        merged = {p: s for p, s in merged.items() if (ROOT / p).is_file()}               # and drops removed ones
        ranked = dict(sorted(merged.items(), key=lambda kv: -kv[1]))
        DURATIONS.write_text(json.dumps(ranked, indent=1) + "\n")
