"""From a parsed ``cluster.component_placement`` to Ray placement groups and worker options.

:func:`embodirl.placement.parse_placement` gives each component (actor, rollout, env) a set of global
device ids (node-major: node k holds ids ``k*G .. k*G+G-1``). Here every device used by any component
becomes one Ray *bundle* - ``{"GPU": 1, "CPU": c}`` on GPU machines, ``{"CPU": 1}`` (one core) on
CPU machines - grouped in one ``STRICT_PACK`` placement group per node, so the bundles of a node's
devices land on one machine. Worker ``r`` of a component is pinned to its devices round-robin
(``devices[r % len(devices)]``). Workers that share a device (collocated placement, or more workers
than devices) split its bundle: each asks for ``1 / sharers`` of the bundle's GPU and CPU, so Ray
admits all of them and the phases run one after another on the same hardware.

Nothing here validates the placement against the machine: ``embodirl.config.validate`` already did
(impossible placements are rejected before any worker starts); a placement group that Ray still
cannot schedule (a cluster smaller than declared) raises :class:`PlacementUnavailable` after a timeout.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from embodirl.placement import Placement

log = logging.getLogger(__name__)

DEFAULT_CPUS_PER_GPU_BUNDLE = 1.0
DEFAULT_READY_TIMEOUT_S = 120.0


class PlacementUnavailable(RuntimeError):
    """Ray could not reserve the requested bundles within the timeout."""


@dataclass(frozen=True)
class WorkerSlot:
    """Where worker ``rank`` of a component runs: device, node, bundle and its share of the bundle."""

    component: str
    rank: int
    device: int
    node: int
    bundle_index: int          # index inside its node's placement group
    num_gpus: float
    num_cpus: float


@dataclass
class PlacementPlan:
    """Bundles per node and the slot of every worker (pure data; :func:`create_placement_groups`
    turns it into Ray objects)."""

    accelerator: str
    bundles: dict[int, list[dict[str, float]]] = field(default_factory=dict)   # node -> bundles
    bundle_devices: dict[int, list[int]] = field(default_factory=dict)         # node -> device per bundle
    slots: dict[str, list[WorkerSlot]] = field(default_factory=dict)           # component -> per rank

    def slot(self, component: str, rank: int) -> WorkerSlot:
        return self.slots[component][rank]


def plan_placement(placement: Placement, num_workers: dict[str, int], *, num_nodes: int = 1,
                   cpus_per_gpu_bundle: float = DEFAULT_CPUS_PER_GPU_BUNDLE) -> PlacementPlan:
    """Plan bundles and worker slots for ``num_workers`` (component -> count) on ``placement``.

    ``num_workers`` may omit components (no workers of that kind in this group)."""
    per_node = max(placement.num_devices // max(num_nodes, 1), 1)
    gpu = placement.accelerator == "gpu"
    # which worker ranks sit on which device
    assignment: dict[str, list[int]] = {}
    sharers: dict[int, int] = defaultdict(int)
    for component, count in num_workers.items():
        devices = placement.devices[component]
        if count and not devices:
            raise ValueError(f"component '{component}' has {count} worker(s) but no devices")
        assignment[component] = [devices[r % len(devices)] for r in range(count)]
        for device in assignment[component]:
            sharers[device] += 1
    plan = PlacementPlan(accelerator=placement.accelerator)
    index: dict[int, int] = {}
    for device in sorted(sharers):
        node = device // per_node
        bundle = {"GPU": 1.0, "CPU": float(cpus_per_gpu_bundle)} if gpu else {"CPU": 1.0}
        plan.bundles.setdefault(node, []).append(bundle)
        plan.bundle_devices.setdefault(node, []).append(device)
        index[device] = len(plan.bundles[node]) - 1
    for component, assigned in assignment.items():
        slots = []
        for rank, device in enumerate(assigned):
            node = device // per_node
            bundle = plan.bundles[node][index[device]]
            share = 1.0 / sharers[device]
            slots.append(WorkerSlot(component, rank, device, node, index[device],
                                    num_gpus=bundle.get("GPU", 0.0) * share, num_cpus=bundle["CPU"] * share))
        plan.slots[component] = slots
    return plan


def cluster_nodes() -> list[dict]:
    """Alive Ray nodes, the driver's first, then the others by node id: the plan's node 0, 1, ..."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return sorted(alive, key=lambda n: (n["NodeID"] != here, n["NodeID"]))


def check_cluster(plan: PlacementPlan, nodes: list[dict]) -> None:
    """Refuse, in one sentence and before any worker starts, a plan the cluster cannot hold."""
    from embodirl.errors import ConfigError

    used = sorted(plan.bundles)
    if used and used[-1] >= len(nodes):
        raise ConfigError("cluster.num_nodes", f"the placement puts workers on {used[-1] + 1} node(s) but the Ray "
                                               f"cluster has {len(nodes)} alive; start more nodes (ray start "
                                               "--address=...) or change cluster.component_placement")
    for node in used:
        have = nodes[node].get("Resources", {})
        for key, need in _total(plan.bundles[node]).items():
            if have.get(key, 0.0) + 1e-9 < need:
                raise ConfigError("cluster.component_placement",
                                  f"node {node} ({nodes[node]['NodeID'][:12]}) has {key}={have.get(key, 0.0):g} but "
                                  f"the placement needs {need:g} there; change the placement or the node's resources")


def create_placement_groups(plan: PlacementPlan, *, timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> dict:
    """One ``STRICT_PACK`` placement group per node of the plan, reserved before returning. On a
    cluster the plan's node k is pinned to the k-th alive node (the driver's node first), so that
    placement decides which components share a node (and thus shared memory)."""
    import ray
    from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

    nodes = cluster_nodes()
    check_cluster(plan, nodes)
    pin = len(plan.bundles) > 1 or max(plan.bundles, default=0) > 0
    groups = {}
    for node, bundles in sorted(plan.bundles.items()):
        selector = [{NODE_ID_LABEL_KEY: nodes[node]["NodeID"]}] * len(bundles) if pin else None
        groups[node] = placement_group(bundles, strategy="STRICT_PACK", name=f"embodirl-node{node}",
                                       bundle_label_selector=selector)
    try:
        ray.get([pg.ready() for pg in groups.values()], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        available = ray.available_resources()
        remove_placement_groups(groups)
        wanted = {node: _total(bundles) for node, bundles in plan.bundles.items()}
        raise PlacementUnavailable(
            f"Ray could not reserve the placement's bundles within {timeout_s:g}s: wanted per node {wanted}, "
            f"the cluster has {_round(available)} free; check cluster.component_placement and cluster.num_nodes"
        ) from None
    return groups


def worker_options(plan: PlacementPlan, groups: dict | None, component: str, rank: int) -> dict:
    """``ray.remote(...).options(**worker_options(...))`` for worker ``rank`` of ``component``.

    Without placement groups (``groups=None``) only the resource shares are set."""
    slot = plan.slot(component, rank)
    options: dict[str, Any] = {"num_cpus": slot.num_cpus, "num_gpus": slot.num_gpus}
    if groups is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=groups[slot.node], placement_group_bundle_index=slot.bundle_index)
    return options


def remove_placement_groups(groups: dict) -> None:
    from ray.util.placement_group import remove_placement_group

    for pg in groups.values():
        try:
            remove_placement_group(pg)
        except Exception as exc:
            log.debug("removing placement group failed: %s", exc)


def _total(bundles: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] += value
    return dict(total)


def _round(resources: dict) -> dict:
    return {k: round(v, 2) for k, v in resources.items() if k in ("CPU", "GPU")}
