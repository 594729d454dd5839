"""``cluster.component_placement``: which devices each component (actor, rollout, env) runs on.

The syntax is RLinf's: a mapping from comma-separated component names to device sets, where a
device set is ``all``, a single id (``3``), a range (``0-3``) or a list of those (``0-3,5``)::

    actor,rollout,env: all          # collocated: every component on every device
    env: 0-3                        # hybrid
    rollout: 4-7
    actor: 0-7

On the command line, where keys cannot hold commas, the same is written as a quoted string (the
inner quotes are Hydra's, the outer ones the shell's):
``'cluster.component_placement="env: 0-3; rollout: 4-7; actor: 0-7"'``.

Device ids are global accelerator ids (node-major: node k holds ids k*G .. k*G+G-1 for G
accelerators per node). On a machine without accelerators the ids name CPU slots (one per core),
so the same configs run on a laptop. This module only parses and checks; Ray placement groups are
built from the result by the worker layer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from embodirl.errors import ConfigError

COMPONENTS = ("actor", "rollout", "env")
_KEY = "cluster.component_placement"
_TOKEN = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


@dataclass(frozen=True)
class Placement:
    """Device ids per component and the device count they were checked against."""

    devices: dict[str, tuple[int, ...]]
    num_devices: int
    accelerator: str  # "gpu" or "cpu"

    def is_collocated(self, a: str, b: str) -> bool:
        return bool(set(self.devices[a]) & set(self.devices[b]))


def parse_device_set(spec: str | int, num_devices: int, key: str = _KEY) -> tuple[int, ...]:
    """``"all" | "3" | "0-3" | "0-3,5"`` -> sorted unique device ids (checked against ``num_devices``)."""
    text = str(spec).strip()
    if text.lower() == "all":
        return tuple(range(num_devices))
    ids: set[int] = set()
    for token in text.split(","):
        match = _TOKEN.match(token)
        if not match:
            raise ConfigError(key, f"cannot parse device set '{text}': use 'all', an id like 3, a range like 0-3, "
                                   "or a list like 0-3,5")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise ConfigError(key, f"range '{token.strip()}' in '{text}' ends before it starts; write it as {hi}-{lo}")
        ids.update(range(lo, hi + 1))
    out_of_range = sorted(i for i in ids if i >= num_devices)
    if out_of_range:
        raise ConfigError(key, f"device set '{text}' names device {out_of_range[0]} but only {num_devices} "
                               f"device(s) are present (ids 0-{num_devices - 1})")
    return tuple(sorted(ids))


def _from_string(text: str) -> dict[str, str]:
    """``"all"`` or ``"env: 0-3; rollout: 4-7; actor: 0-7"`` (the form a command-line override can carry)."""
    if ":" not in text:
        return {",".join(COMPONENTS): text}
    out = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        names, sep, devices = entry.partition(":")
        if not sep:
            raise ConfigError(_KEY, f"cannot parse '{entry}': write entries as 'components: devices' separated by ';'")
        out[names.strip()] = devices.strip()
    return out


def parse_placement(spec: Mapping | str, num_devices: int, accelerator: str = "cpu") -> Placement:
    """Parse the whole mapping (or its string form); every component must be placed exactly once."""
    if isinstance(spec, str):
        spec = _from_string(spec)
    if not isinstance(spec, Mapping) or not spec:
        raise ConfigError(_KEY, "must map components to devices, for example {'actor,rollout,env': 'all'}")
    devices: dict[str, tuple[int, ...]] = {}
    for names, device_spec in spec.items():
        for name in str(names).split(","):
            name = name.strip()
            if name not in COMPONENTS:
                raise ConfigError(f"{_KEY}.{names}", f"unknown component '{name}'; components are {', '.join(COMPONENTS)}")
            if name in devices:
                raise ConfigError(f"{_KEY}.{names}", f"component '{name}' is placed twice")
            devices[name] = parse_device_set(device_spec, num_devices, f"{_KEY}.{names}")
    missing = [c for c in COMPONENTS if c not in devices]
    if missing:
        raise ConfigError(_KEY, f"component(s) {', '.join(missing)} have no devices; add for example '{missing[0]}: all'")
    return Placement(devices=devices, num_devices=num_devices, accelerator=accelerator)


def detect_devices(num_nodes: int = 1, num_gpus_per_node: int | None = None) -> tuple[int, str]:
    """(device count, kind): GPUs across nodes when CUDA is present, else CPU slots of this machine."""
    if num_gpus_per_node is None:
        import torch

        num_gpus_per_node = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus_per_node > 0:
        return num_gpus_per_node * num_nodes, "gpu"
    import os

    return (os.cpu_count() or 1) * num_nodes, "cpu"


def placement_from_config(cluster, num_devices: int | None = None, accelerator: str | None = None) -> Placement:
    """The typed ``cluster`` section's ``component_placement`` (a mapping, or its one-line string form) parsed
    against the devices of ``cluster.num_nodes`` nodes (detected unless ``num_devices`` is given)."""
    if num_devices is None:
        num_devices, accelerator = detect_devices(cluster.num_nodes, cluster.num_gpus_per_node)
    return parse_placement(cluster.component_placement, num_devices, accelerator or "cpu")


def use_ray(cfg) -> bool:
    """Whether the runner collects through Ray worker groups (``cluster.use_ray``; ``auto``: for the policy families
    registered with ``ray`` (the VLAs: OpenVLA-OFT, π0), several env or inference workers, several nodes or a given Ray
    address) or in process (the default job: the state MLP)."""
    from embodirl.registry import POLICIES

    choice = cfg.cluster.use_ray
    if choice != "auto":
        return bool(choice)
    def several(count) -> bool:     # "auto" (not yet decided): one unless the family runs through Ray anyway
        return count != "auto" and int(count) > 1

    return (POLICIES.get(cfg.model.name).ray or several(cfg.env_workers.num_workers)
            or several(cfg.rollout.num_workers) or cfg.cluster.num_nodes > 1
            or cfg.actor.cpu_world_size > 1 or bool(cfg.cluster.ray_address))


def data_parallel_size(cfg, placement: Placement | None = None) -> int:
    """Actor ranks: accelerators given to the actor, or ``actor.cpu_world_size`` on CPU."""
    if placement is not None and placement.accelerator == "gpu":
        return len(placement.devices["actor"])
    return cfg.actor.cpu_world_size
