"""Starting Ray versus joining a running cluster (``cluster.ray_address`` / ``RAY_ADDRESS``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from embodirl.workers.ray_cluster import ray_address

DOCTOR_TOY = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true"]


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


def test_the_shared_memory_cleanup_stays_first_in_line_for_sigterm_after_ray_init(ray_local):
    """``ray.init`` installs a SIGTERM handler of its own (``sys.exit``) that does not call the one before: the
    shared-memory cleanup's handler, installed first, is put back on top, and calls Ray's after releasing."""
    import signal

    from embodirl.channel import segments

    assert signal.getsignal(signal.SIGTERM) is segments._on_sigterm
    assert getattr(segments._previous_sigterm, "__module__", "").startswith("ray.")


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


def test_joining_a_head_with_token_authentication(tmp_path):
    """Since Ray 2.59 a local Ray writes ~/.ray/auth_token and `ray start` then turns token authentication on; a
    driver joining with only RAY_ADDRESS was refused with a traceback (Ray 2.60: ``InvalidAuthToken``). Now that is
    one sentence naming the key and the fix (RAY_AUTH_MODE=token), and the fix joins. The head (a process of its
    own: Ray reads the mode once per process) has its own token file, not the user's.

    A refused join is Ray's GCS connect loop giving up: one try a second, 20 by default, so each refused process
    waited ~20 s (the test took ~70 s wall on the 2-core machine, 2026-12-07). The drivers here get two tries
    (``RAY_gcs_server_port_wait_time_s=2``, Ray's own knob for that loop): the head is up before they start, and a
    refusal raises the same error after the last try as after the 20th. ``doctor`` checks the toy env's config, which
    leaves out the ManiSkill rows (a Vulkan probe in a child process: ~4 CPU-s a run) and keeps the ray row. The test
    then took ~22 s wall; the file 36 CPU-s instead of 43 (one run each)."""
    token = tmp_path / "auth_token"
    token.write_text("embodirl-test-" + os.urandom(16).hex())
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    head_code = textwrap.dedent("""
        import sys
        from ray.cluster_utils import Cluster
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        print(cluster.address, flush=True)
        sys.stdin.read()          # until the test closes it
        cluster.shutdown()
    """)
    head = subprocess.Popen([sys.executable, "-c", head_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
    driver_code = textwrap.dedent("""
        import json, ray
        from embodirl.errors import ConfigError
        from embodirl.workers.ray_cluster import init_ray
        try:
            init_ray(None)
        except ConfigError as exc:
            print(json.dumps({"refused": str(exc)}), flush=True)
        else:
            @ray.remote
            def answer():
                return 42
            print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "task": ray.get(answer.remote())}),
                  flush=True)
            ray.shutdown()
    """)
    try:
        address = head.stdout.readline().strip()
        answers, doctor = [], []
        for extra in ({}, {"RAY_AUTH_MODE": "token"}):
            env = {**base, "RAY_ADDRESS": address, "RAY_AUTH_TOKEN_PATH": str(token),
                   "RAY_gcs_server_port_wait_time_s": "2", **extra}
            out = subprocess.run([sys.executable, "-c", driver_code], env=env, capture_output=True, text=True,
                                 timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            answers.append(json.loads(out.stdout.strip().splitlines()[-1]))
            out = subprocess.run([sys.executable, "-m", "embodirl.cli", "doctor", "cluster.use_ray=true", *DOCTOR_TOY],
                                 env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
            doctor.append([line for line in out.stdout.splitlines() if line.startswith("ray ")]
                          + [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("fix: ")][-1:])
    finally:
        head.communicate("", timeout=120)
    refused = answers[0]["refused"]
    assert refused.startswith(f"cluster.ray_address (from RAY_ADDRESS): cannot join the Ray cluster at {address} "
                              "(InvalidAuthToken: "), refused
    assert "run with RAY_AUTH_MODE=token" in refused and "\n" not in refused
    assert answers[1] == {"gcs": address, "task": 42}
    # `embodirl doctor` joins as the run does and reports the same sentence in its ray row, then passes with the fix
    (refused_row, fix), (joined_row, *_) = doctor
    assert refused_row.split()[:2] == ["ray", "FAIL"] and f"cannot join the Ray cluster at {address} (InvalidAuthToken:" \
        in refused_row, doctor
    assert fix.startswith("fix: the cluster authenticates with a token") and "RAY_AUTH_MODE=token" in fix, doctor
    assert joined_row.split()[:2] == ["ray", "PASS"] and f"1 node(s), 0 GPU(s), 1 CPU(s) at {address}" in joined_row, doctor
