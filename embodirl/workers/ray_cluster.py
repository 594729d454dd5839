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
        join_auth()
        try:
            ray.init(address=address, **options)
        except ConnectionError as exc:
            from embodirl.errors import ConfigError

            where = "cluster.ray_address" if configured_address else "cluster.ray_address (from RAY_ADDRESS)"
            root = exc
            while root.__cause__ is not None:   # Ray chains the reason (refused token, no answer) under its own
                root = root.__cause__
            reason = (str(root).strip().splitlines() or [type(root).__name__])[-1].strip()
            raise ConfigError(where, f"cannot join the Ray cluster at {address} ({reason}); start it with "
                                     "`ray start --head`, or unset RAY_ADDRESS / cluster.ray_address to start a "
                                     "private Ray") from None
    else:
        # "local": a new private instance. A bare ray.init() would first join the head recorded in
        # /tmp/ray/ray_current_cluster by any `ray start` (or ray.cluster_utils.Cluster) on this machine
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, **options)
        log.info("started a local Ray instance: %s", _brief(ray.cluster_resources()))
    return ray.cluster_resources()


def join_auth() -> None:
    """Before joining a cluster: turn Ray's token authentication on as ``ray start`` does. Since Ray 2.59 a new
    local Ray writes a token to ~/.ray/auth_token, and ``ray start`` then enables token authentication whenever a
    token exists and ``RAY_AUTH_MODE`` is unset; a driver joining with ``ray.init(address=...)`` does not, so on
    Ray 2.60 it was refused (``InvalidAuthToken``) by the head it was told to join. Ray's own rule is applied
    (a driver sending a token to a cluster without authentication is accepted); an explicit ``RAY_AUTH_MODE`` wins,
    and a Ray without the rule is left alone."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _brief(resources: Mapping) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in resources.items() if k in ("CPU", "GPU"))
