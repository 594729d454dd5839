"""The collapse guard's KL and entropy rules trip on values that are not numbers: every comparison with NaN is false,
so ``kl > max_kl`` and ``entropy < min_entropy`` let a NaN through; a run whose KL or entropy turned NaN went on
unguarded. The guard's own bookkeeping, with the typed ``runner.guard`` section of the composed config."""

from __future__ import annotations

import math

import pytest

from embodirl.config import validate
from embodirl.runner.guard import ENTROPY_METRIC, KL_METRIC, CollapseGuard


@pytest.fixture
def guard(compose_cfg):
    cfg = validate(compose_cfg("runner.guard.enabled=true", "runner.guard.max_kl=0.5", "runner.guard.min_entropy=0.1",
                               "algorithm.kl_beta=0.01"), check_envs=False)
    return CollapseGuard(cfg.runner.guard)


@pytest.mark.parametrize("metric, value, words", [
    (KL_METRIC, math.nan, "the KL to the reference policy is nan, not comparable with runner.guard.max_kl=0.5"),
    (KL_METRIC, math.inf, "the KL to the reference policy is inf, above runner.guard.max_kl=0.5"),
    (ENTROPY_METRIC, math.nan, "the policy's entropy is nan, not comparable with runner.guard.min_entropy=0.1"),
    (ENTROPY_METRIC, -math.inf, "the policy's entropy is -inf, below runner.guard.min_entropy=0.1"),
])
def test_a_non_finite_kl_or_entropy_trips_the_guard(guard, metric, value, words):
    healthy = {KL_METRIC: 0.01, ENTROPY_METRIC: 1.0}
    assert guard.after_step(healthy) is None
    assert guard.after_step({**healthy, metric: value}) == words
