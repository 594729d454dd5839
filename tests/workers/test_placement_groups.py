"""From ``cluster.component_placement`` to bundles and worker slots (the Ray side is exercised in
test_groups_ray.py on a real local Ray)."""

from __future__ import annotations

import pytest

from embodirl.placement import parse_placement
from embodirl.workers.placement_groups import plan_placement, worker_options


def test_collocated_gpus_share_each_bundle():
    placement = parse_placement({"actor,rollout,env": "all"}, 8, "gpu")
    plan = plan_placement(placement, {"actor": 8, "rollout": 8, "env": 8})
    assert plan.bundles == {0: [{"GPU": 1.0, "CPU": 1.0}] * 8}
    for component in ("actor", "rollout", "env"):
        slots = plan.slots[component]
        assert [s.device for s in slots] == list(range(8))
        assert all(s.num_gpus == pytest.approx(1 / 3) and s.bundle_index == s.device for s in slots)
    # the shares of one bundle add up to the bundle
    assert sum(plan.slot(c, 5).num_gpus for c in ("actor", "rollout", "env")) == pytest.approx(1.0)


def test_hybrid_placement_keeps_components_apart():
    spec = {"env": "0-3", "rollout": "4-7", "actor": "0-7"}
    placement = parse_placement(spec, 8, "gpu")
    plan = plan_placement(placement, {"env": 4, "rollout": 4, "actor": 8})
    assert [s.device for s in plan.slots["env"]] == [0, 1, 2, 3]
    assert [s.device for s in plan.slots["rollout"]] == [4, 5, 6, 7]
    assert all(s.num_gpus == 0.5 for s in plan.slots["env"] + plan.slots["rollout"])   # each shares with an actor rank
    assert all(s.num_gpus == 0.5 for s in plan.slots["actor"])


def test_device_lists_and_round_robin_when_workers_outnumber_devices():
    placement = parse_placement({"env": "0-1,5", "rollout": "3", "actor": "6-7"}, 8, "gpu")
    plan = plan_placement(placement, {"env": 6, "rollout": 2, "actor": 2})
    assert [s.device for s in plan.slots["env"]] == [0, 1, 5, 0, 1, 5]
    assert all(s.num_gpus == 0.5 for s in plan.slots["env"])          # two env workers per device
    assert [s.device for s in plan.slots["rollout"]] == [3, 3]
    assert plan.bundle_devices == {0: [0, 1, 3, 5, 6, 7]}            # unused devices get no bundle


def test_devices_map_to_nodes_node_major():
    placement = parse_placement({"env": "0-3", "rollout": "4-7", "actor": "all"}, 16, "gpu")
    plan = plan_placement(placement, {"env": 4, "rollout": 4, "actor": 16}, num_nodes=2)
    assert len(plan.bundles[0]) == 8 and len(plan.bundles[1]) == 8
    assert all(s.node == 0 for s in plan.slots["env"] + plan.slots["rollout"])
    assert [s.node for s in plan.slots["actor"]] == [0] * 8 + [1] * 8
    assert [s.bundle_index for s in plan.slots["actor"][8:]] == list(range(8))


def test_cpu_machines_get_one_core_bundles():
    placement = parse_placement({"actor,rollout,env": "all"}, 2, "cpu")
    plan = plan_placement(placement, {"env": 2, "rollout": 1, "actor": 1})
    assert plan.bundles == {0: [{"CPU": 1.0}, {"CPU": 1.0}]}
    env0, env1 = plan.slots["env"]
    assert (env0.device, env1.device) == (0, 1)
    assert env0.num_cpus == pytest.approx(1 / 3)       # shares core 0 with the inference worker and actor rank
    assert env1.num_cpus == 1.0                         # alone on core 1
    assert all(s.num_gpus == 0.0 for s in plan.slots["env"])
    assert worker_options(plan, None, "rollout", 0) == {"num_cpus": pytest.approx(1 / 3), "num_gpus": 0.0}
