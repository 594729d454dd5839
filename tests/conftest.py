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

from embodirl import runtime  # noqa: E402

runtime.configure()


@pytest.fixture
def compose_cfg():
    """``compose_cfg(*overrides)`` -> the composed (hydra-free) config."""
    from embodirl.config import compose

    return lambda *overrides: compose(list(overrides))


#: The longest test files (about 1.5-5.5 minutes each on CI's 2-core machine), in the order pytest-xdist hands them
#: out first. It gives out whole files in the collection order (bin/test turns off its own reordering, which puts
#: files with many tests first and so left the one-test files of several minutes to run alone at the end while the
#: other worker idled). Everything else keeps its order after these.
LONG_FIRST = (
    "tests/sft/test_sft_to_rl.py",
    "tests/runner/test_vla_cli.py",
    "tests/runner/test_actor_group_cli.py",
    "tests/sft/test_sft_cli.py",
    "tests/runner/test_default_job.py",
    "tests/envs/test_libero_oft_protocol.py",
    "tests/runner/test_eval_paths.py",
    "tests/runner/test_pi0_cli.py",
    "tests/actor/test_compile.py",
    "tests/test_gpu_check.py",
)


def pytest_collection_modifyitems(config, items):
    missing = [f for f in LONG_FIRST if not (ROOT / f).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONG_FIRST names files that do not exist: {missing}")
    rank = {f: i for i, f in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))   # stable: the rest keep their order
