"""One local Ray shared by consecutive worker tests (starting Ray costs seconds on two cores), stopped when the next
test does not use it: an idle local Ray (GCS, raylet, dashboard and its agent, log and autoscaler monitors) kept
burning ~1.8 CPU-s a minute, and each of the two pytest workers kept its own for the rest of the suite (measured on
a clean clone: 3.5 CPU-s a minute for the two, alive for the last 34 and 41 minutes)."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(trylast=True)   # after the test's own fixtures are torn down; the last test's nextitem is None
def pytest_runtest_teardown(item, nextitem):
    if "ray_local" in item.fixturenames and (nextitem is None or "ray_local" not in nextitem.fixturenames):
        import ray

        if ray.is_initialized():
            ray.shutdown()


@pytest.fixture
def ray_local():
    """A private local Ray with one logical CPU per core (the placement's CPU bundles fit exactly);
    started on first use, or again if another test shut it down."""
    import ray

    from embodirl.workers.ray_cluster import init_ray

    if not ray.is_initialized():
        os.environ.pop("RAY_ADDRESS", None)   # the tests want their own Ray, not a cluster the shell points at
        init_ray(None, num_cpus=os.cpu_count() or 1)
    return ray
