"""Starting Ray versus joining a running cluster (``cluster.ray_address`` / ``RAY_ADDRESS``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from embodirl.workers.ray_cluster import ray_address


def test_address_precedence(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(None) is None                       # start a private Ray
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address(None) == "10.0.0.1:6379"
    assert ray_address("head:6379") == "head:6379"        # the config key wins


def test_a_second_driver_joins_the_running_cluster(ray_local):
    address = ray_local.get_runtime_context().gcs_address
    code = textwrap.dedent("""
        import json, ray
        from embodirl.workers.ray_cluster import init_ray
        init_ray(None)
        print(json.dumps({"gcs": ray.get_runtime_context().gcs_address,
                          "nodes": len(ray.nodes())}), flush=True)
    """)
    env = dict(os.environ, RAY_ADDRESS=address)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    joined = json.loads(out.stdout.strip().splitlines()[-1])
    assert joined == {"gcs": address, "nodes": 1}


def test_without_an_address_a_run_starts_its_own_ray_beside_a_running_head():
    """A head started on this machine (``ray start --head``, or ``ray.cluster_utils.Cluster`` as the cluster tests
    use) is recorded in /tmp/ray/ray_current_cluster, where a bare ``ray.init()`` looks first. A run with no
    address must start its own Ray beside it, not join it (and lose its workers when that cluster stops)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        code = textwrap.dedent("""
            import json, ray
            from embodirl.workers.ray_cluster import init_ray
            init_ray(None, num_cpus=1)
            print(json.dumps({"gcs": ray.get_runtime_context().gcs_address}), flush=True)
            ray.shutdown()
        """)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        started = json.loads(out.stdout.strip().splitlines()[-1])
        assert started["gcs"] != cluster.address
    finally:
        cluster.shutdown()
