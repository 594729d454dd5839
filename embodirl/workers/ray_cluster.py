"""Starting or joining Ray: one machine by default, an existing cluster when asked.

``cluster.ray_address`` (or ``RAY_ADDRESS`` when the key is null) names a running cluster
(``ray start --head`` on one node, ``ray start --address=<head>:6379`` on the others); without either
embodirl starts a private Ray on this machine. The simulator runtime is configured first so that Ray's
worker processes, started by the local raylet, inherit the rendering set-up.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)


def ray_address(configured: str | None = None) -> str | None:
    """The cluster to join: ``configured`` (``cluster.ray_address``), else ``RAY_ADDRESS``, else None (start one)."""
    return str(configured) if configured else (os.environ.get("RAY_ADDRESS") or None)


def init_ray(configured_address: str | None = None, *, num_cpus: int | None = None, num_gpus: int | None = None,
             **kwargs) -> dict:
    """Start or join Ray (idempotent). Returns ``ray.cluster_resources()``."""
    import ray

    from embodirl import runtime
    from embodirl.channel import segments

    runtime.configure()
    segments.own_run()   # the driver owns the run's shared memory: swept however it exits
    if ray.is_initialized():
        return ray.cluster_resources()
    address = ray_address(configured_address)
    options = dict(include_dashboard=False, log_to_driver=True, configure_logging=False)
    options.update(kwargs)
    if address:
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address, **options)
    else:
        # "local": a new private instance. A bare ray.init() would first join the head recorded in
        # /tmp/ray/ray_current_cluster by any `ray start` (or ray.cluster_utils.Cluster) on this machine
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, **options)
        log.info("started a local Ray instance: %s", _brief(ray.cluster_resources()))
    return ray.cluster_resources()


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _brief(resources: Mapping) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in resources.items() if k in ("CPU", "GPU"))
