"""Starting or joining Ray: one machine by default, an existing cluster when asked.

``cluster.ray_address`` (or ``RAY_ADDRESS`` when the key is null) names a running cluster
(``ray start --head`` on one node, ``ray start --address=<head>:6379`` on the others); without either
embodirl starts a private Ray on this machine. The simulator runtime is configured first so that Ray's
worker processes, started by the local raylet, inherit the rendering set-up. A local Ray started here goes with the
driver however it ends (:mod:`embodirl.workers.reaper`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

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
    options: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True, configure_logging=False)
    options.update(kwargs)
    if address:
        log.info("joining the Ray cluster at %s", address)
        try:
            ray.init(address=address, **options)
        except ConnectionError as exc:
            raise join_refused(address, exc, configured=bool(configured_address)) from None
    else:
        # "local": a new private instance. A bare ray.init() would first join the head recorded in
        # /tmp/ray/ray_current_cluster by any `ray start` (or ray.cluster_utils.Cluster) on this machine
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, **options)
        log.info("started a local Ray instance: %s", _brief(ray.cluster_resources()))
        from embodirl.workers import reaper

        reaper.start()    # its daemons and agents go with this process, even after a kill -9
    # ray.init replaced the shared-memory cleanup's SIGTERM handler with its own (which exits without calling the
    # one before): put the cleanup back on top, calling Ray's after it
    segments.keep_sigterm_hook()
    return ray.cluster_resources()


def join_refused(address: str, exc: BaseException, *, configured: bool):
    """The :class:`ConfigError` for a join Ray refused: its root reason, and the fix. Since Ray 2.59 a local Ray
    writes a token to ~/.ray/auth_token and ``ray start`` then turns token authentication on (unless
    ``RAY_AUTH_MODE`` says otherwise), while a driver joins without one unless ``RAY_AUTH_MODE=token``: the
    README's ``ray start --head`` + ``RAY_ADDRESS=auto embodirl train`` was refused with a traceback. The driver
    cannot tell the head's mode before it joins, and a driver in token mode cannot run workers on a head without
    authentication, so the mode is the user's to set; the sentence says which."""
    from embodirl.errors import ConfigError

    key = "cluster.ray_address" if configured else "cluster.ray_address (from RAY_ADDRESS)"
    root = exc
    while root.__cause__ is not None:   # Ray chains the reason (a refused token, no answer) under its own
        root = root.__cause__
    text = str(root)
    reason = (text.strip().splitlines() or [type(root).__name__])[0].strip().split(". ")[0]
    if "InvalidAuthToken" in text or type(root).__name__ == "AuthenticationError":
        reason = "InvalidAuthToken: the head refused a driver without its token"
        fix = ("the cluster authenticates with a token (`ray start` turns this on when ~/.ray/auth_token exists): "
               "run with RAY_AUTH_MODE=token and the head's token in ~/.ray/auth_token or RAY_AUTH_TOKEN")
    else:
        fix = "start it with `ray start --head`, or unset RAY_ADDRESS / cluster.ray_address to start a private Ray"
    return ConfigError(key, f"cannot join the Ray cluster at {address} ({reason}); {fix}")


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _brief(resources: Mapping) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in resources.items() if k in ("CPU", "GPU"))
