"""One local Ray shared by the worker tests of a session (starting Ray costs seconds on two cores)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def _ray_session():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_local(_ray_session):
    """A private local Ray with one logical CPU per core (the placement's CPU bundles fit exactly);
    started on first use, or again if another test shut it down."""
    import ray

    from embodirl.workers.ray_cluster import init_ray

    if not ray.is_initialized():
        os.environ.pop("RAY_ADDRESS", None)   # the tests want their own Ray, not a cluster the shell points at
        init_ray(None, num_cpus=os.cpu_count() or 1)
    return ray
