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
