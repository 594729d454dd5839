"""The actor as Ray actor ranks, through the CLI: two gloo FSDP2 ranks train like one, checkpoints move
between rank counts, a killed rank ends or restarts the run, and a two-node Ray cluster places env
workers, inference workers and actor ranks where ``cluster.component_placement`` says."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from test_vla_cli import CLEANUP_DEADLINE_S, TOY, _session_members, cli

from embodirl.channel import segments
from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

RUN_TIMEOUT_S = 600.0
# one optimizer step per epoch (global batch = the rollout), several micro-batches: a step's gradient is
# the same sum whatever the split, so 1 and 2 ranks give the same numbers up to float rounding. The state
# normaliser is on: its statistics are merged over the ranks, written into FSDP2's sharded parameters,
# published to the inference worker and carried by the checkpoints that move between rank counts.
EQUAL = [*TOY, "cluster.use_ray=true", "actor.global_batch_size=4", "actor.micro_batch_size=1",
         "algorithm.update_epochs=2", "model.obs_norm=true"]
COMPARED = ("train/return", "train/success_rate", "actor/pg_loss", "critic/value_loss", "actor/approx_kl",
            "actor/entropy", "actor/grad_norm", "actor/clip_fraction", "critic/explained_variance")


#: a ratio at the clip boundary may fall on either side after a difference of float rounding: one token's worth
CLIP_FRACTION_ATOL = 0.05


def _close(a: list[dict], b: list[dict], keys=COMPARED) -> None:
    """The first step tightly (one update from the same weights: only the split's summation order differs); later
    steps start from weights that already differ by rounding, which grows ~5-10x per step, so within 1e-3."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for i, (ra, rb) in enumerate(zip(a, b)):
        rel, abs_tol = (1e-4, 1e-6) if i == 0 else (1e-3, 1e-5)
        for key in keys:
            tol = max(abs_tol, CLIP_FRACTION_ATOL) if key == "actor/clip_fraction" and i else abs_tol
            assert math.isclose(ra[key], rb[key], rel_tol=rel, abs_tol=tol), (ra["step"], key, ra[key], rb[key])


def _start(args: list[str], cwd, run_id: str, env_extra: dict | None = None):
    env = {**os.environ, segments.RUN_ENV: run_id, **(env_extra or {})}
    if not env_extra or "RAY_ADDRESS" not in env_extra:
        env.pop("RAY_ADDRESS", None)
    return cli_runs.start(args, cwd, env=env, new_session=True)


def _finish(proc, run_id: str) -> str:
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            output, _ = proc.communicate()
        deadline = time.monotonic() + CLEANUP_DEADLINE_S
        while (left := _session_members(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for member in left:
            member.kill()
        segments.sweep(segments.run_prefix(run_id))
    assert not left, f"processes left running: {[(p.pid, p.name()) for p in left]}"
    return output


def _kill_rank_after_checkpoint(proc, out: Path, rank: int = 1) -> int:
    """SIGKILL actor rank ``rank`` once step 2's checkpoint is complete (mid-run); returns its pid."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    marker = out / "checkpoints" / "step_2" / "COMPLETE"
    while not marker.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.is_file(), "the run ended before its step-2 checkpoint"
    pid = json.loads((out / "placement.json").read_text())["actor"][rank]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow
@pytest.mark.parametrize("restarts", [1, 0])
def test_a_killed_actor_rank_restarts_the_run_or_ends_it_in_one_sentence(tmp_path, restarts):
    run = f"k{restarts}{os.urandom(3).hex()}"
    name = f"kill{restarts}"
    out = tmp_path / "outputs" / name
    proc = _start(["train", *TOY, "actor.cpu_world_size=2", "runner.max_steps=6", "runner.save_interval=2",
                   f"runner.max_restarts={restarts}", f"runner.experiment_name={name}"], tmp_path, run)
    killed = _kill_rank_after_checkpoint(proc, out)
    output = _finish(proc, run)
    lines = [line for line in output.splitlines() if line.startswith("embodirl: actor rank 1")]
    assert lines and f"pid {killed}" in lines[0], output[-3000:]
    if restarts:
        assert proc.returncode == 0, output[-3000:]
        assert "restarting (1 of 1) from" in lines[0]
        records = [r for r in read_metrics(out / "metrics.jsonl") if "train/return" in r]
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
        assert [r["actor/version"] for r in records] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        assert (out / "checkpoints" / "step_6" / "COMPLETE").is_file()
        placement = json.loads((out / "placement.json").read_text())
        assert killed not in [a["pid"] for a in placement["actor"]]        # new ranks after the restart
    else:
        assert proc.returncode == 1, output[-3000:]
        assert len(lines) == 1 and "the last complete checkpoint is" in lines[0], lines
        assert "runner.max_restarts" in lines[0] and "Traceback" not in output
        # the checkpoint is intact: a later run resumes from it
        latest = sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))[-1]
        assert (latest / "COMPLETE").is_file()
        resumed = cli(["train", *TOY, "actor.cpu_world_size=2", f"runner.max_steps={int(latest.name[5:]) + 1}",
                       "runner.save_interval=2", f"runner.experiment_name={name}"], tmp_path, f"{run}r")
        assert "resumed from" in resumed


@pytest.fixture(scope="module")
def two_node_cluster():
    """A local Ray cluster of two nodes (2 CPU slots each), as `ray start` would make on two machines. The tests
    below it join it: one Ray start for the module instead of one per run (the killed-rank tests above start their
    own, whose processes must all be gone when the run ends)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def _placed(out: Path) -> dict[str, list[int]]:
    placement = json.loads((out / "placement.json").read_text())
    return {component: [w["slot"] for w in workers] for component, workers in placement.items()}


@pytest.mark.slow
@pytest.mark.parametrize("mode, options, slots", [
    # collocated: phases take turns on the same slots; the actor's state waits in host memory during rollouts
    ("collocated", ["cluster.component_placement=all", "actor.enable_offload=true", "rollout.enable_offload=true"],
     {"env": [0], "rollout": [0], "actor": [0, 1]}),
    # hybrid: env and rollout pipelined on their own slots, the actor on all
    ("hybrid", ['cluster.component_placement="env: 0; rollout: 1; actor: 0-1"', "rollout.pipeline_stage_num=2"],
     {"env": [0], "rollout": [1], "actor": [0, 1]}),
])
def test_placement_modes_run_where_they_say(tmp_path, mode, options, slots, two_node_cluster):
    """On the module's Ray cluster (the default cluster.num_nodes=1: two slots of one node, as on a private Ray of a
    2-core machine), not a private Ray started for each mode."""
    cli(["train", *TOY, f"cluster.ray_address={two_node_cluster.address}", "actor.cpu_world_size=2",
         "runner.max_steps=2", *options, f"runner.experiment_name={mode}"], tmp_path, f"p{mode[:3]}{os.urandom(3).hex()}")
    out = tmp_path / "outputs" / mode
    assert _placed(out) == slots
    records = [r for r in read_metrics(out / "metrics.jsonl") if "train/return" in r]
    assert [r["actor/world_size"] for r in records] == [2.0, 2.0]
    # with offload, step 2's update found the actor's state put away after step 1's publication
    assert [r["actor/onloaded"] for r in records] == ([0.0, 1.0] if mode == "collocated" else [0.0, 0.0])


@pytest.mark.slow
def test_two_ranks_train_as_one_and_checkpoints_move_between_rank_counts(tmp_path, two_node_cluster):
    """The four runs join the module's Ray cluster instead of starting a private Ray each (one Ray start instead of
    four): with the default cluster.num_nodes=1 each run's workers share two slots of one node, as on a private Ray
    of a 2-core machine, and what they compare does not depend on who started Ray."""
    run = os.urandom(3).hex()
    joined = [f"cluster.ray_address={two_node_cluster.address}"]
    for ranks in (1, 2):
        cli(["train", *EQUAL, *joined, f"actor.cpu_world_size={ranks}", "runner.max_steps=3",
             f"runner.experiment_name=r{ranks}"], tmp_path, f"r{ranks}{run}")
    one = read_metrics(tmp_path / "outputs" / "r1" / "metrics.jsonl")
    two = read_metrics(tmp_path / "outputs" / "r2" / "metrics.jsonl")
    assert [r["actor/world_size"] for r in one] == [1.0] * 3
    assert [r["actor/world_size"] for r in two] == [2.0] * 3
    _close(one, two)
    placement = json.loads((tmp_path / "outputs" / "r2" / "placement.json").read_text())
    assert [a["rank"] for a in placement["actor"]] == [0, 1] and all(a["fsdp"] for a in placement["actor"])
    assert len({a["pid"] for a in placement["actor"]}) == 2
    # the 2-rank checkpoint of step 2 resumed by 1 rank (and the 1-rank one by 2) continues the run
    for ranks, source, straight in ((1, "r2", two), (2, "r1", one)):
        name = f"from_{source}"
        cli(["train", *EQUAL, *joined, f"actor.cpu_world_size={ranks}", "runner.max_steps=3", f"runner.experiment_name={name}",
             f"runner.resume_dir={tmp_path / 'outputs' / source / 'checkpoints' / 'step_2'}"], tmp_path,
            f"{name}{run}")
        resumed = read_metrics(tmp_path / "outputs" / name / "metrics.jsonl")
        assert [r["actor/world_size"] for r in resumed] == [float(ranks)]
        assert [r["actor/version"] for r in resumed] == [3.0]
        _close(resumed, straight[2:])


# docs/cluster.md, "Starting a cluster": the CPU-size example, exactly
README_CLUSTER_EXAMPLE = ["train", "cluster.num_nodes=2", 'cluster.component_placement="env: 0,2; rollout: 0; actor: 2-3"',
                          "env_workers.num_workers=2", "env.train.num_envs=8", "actor.cpu_world_size=2",
                          "runner.max_steps=2"]


@pytest.mark.slow
def test_cli_on_a_two_node_cluster_places_components_and_uses_both_transports(tmp_path, two_node_cluster):
    run = f"m{os.urandom(3).hex()}"
    proc = _start([*README_CLUSTER_EXAMPLE, "runner.experiment_name=cluster", "runner.progress_bar=false",
                   "runner.save_interval=2"], tmp_path, run, {"RAY_ADDRESS": two_node_cluster.address})
    output = _finish(proc, run)
    assert proc.returncode == 0, output[-4000:]
    out = tmp_path / "outputs" / "cluster"
    placement = json.loads((out / "placement.json").read_text())
    # the node ids as the cluster's own processes hold them (no driver of this process joins the cluster to ask)
    head = two_node_cluster.head_node.node_id
    [other] = [node.node_id for node in two_node_cluster.worker_nodes]
    # placement node 0 is the driver's (head) node: env worker 0 and the inference worker; node 1: env worker 1
    # and both actor ranks
    assert [e["node_id"] for e in placement["env"]] == [head, other]
    assert [r["node_id"] for r in placement["rollout"]] == [head]
    assert [a["node_id"] for a in placement["actor"]] == [other, other]
    records = [r for r in read_metrics(out / "metrics.jsonl") if "train/return" in r]
    assert [r["actor/world_size"] for r in records] == [2.0, 2.0]
    for record in records:
        # observations: env worker 0 streams through shared memory, env worker 1 through the object store
        assert record["transport/shm_batches"] > 0 and record["transport/object_store_batches"] > 0
        # weights: rank 0 (node 1) to the inference worker (node 0) through the object store
        assert record["sync/object_store_workers"] == 1.0 and record["sync/shm_workers"] == 0.0
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file()
    shutil.rmtree(out / "checkpoints")


@pytest.mark.slow
def test_disaggregated_placement_on_two_nodes(tmp_path, two_node_cluster):
    """Every component on its own slots: env worker on slot 0, inference worker on 1 (node 0), actor ranks
    on 2-3 (node 1); an impossible placement for this cluster is one sentence before any worker starts."""
    run = f"d{os.urandom(3).hex()}"
    common = [*TOY, "cluster.num_nodes=2", "actor.cpu_world_size=2", "runner.max_steps=2"]
    proc = _start(["train", *common, 'cluster.component_placement="env: 0; rollout: 1; actor: 2-3"',
                   "runner.experiment_name=disagg"], tmp_path, run, {"RAY_ADDRESS": two_node_cluster.address})
    output = _finish(proc, run)
    assert proc.returncode == 0, output[-4000:]
    out = tmp_path / "outputs" / "disagg"
    assert _placed(out) == {"env": [0], "rollout": [1], "actor": [2, 3]}
    placement = json.loads((out / "placement.json").read_text())
    assert placement["env"][0]["node_id"] == placement["rollout"][0]["node_id"] != placement["actor"][0]["node_id"]
    # three nodes asked of a two-node cluster: refused before any worker starts
    proc = _start(["train", *TOY, "cluster.num_nodes=3", 'cluster.component_placement="env: 0; rollout: 1; actor: 4"',
                   "runner.experiment_name=three"], tmp_path, run, {"RAY_ADDRESS": two_node_cluster.address})
    output = _finish(proc, run)
    assert proc.returncode == 2, output[-3000:]
    assert "embodirl: cluster.num_nodes: the placement puts workers on 3 node(s) but the Ray cluster has 2 alive" \
        in output and "Traceback" not in output
    assert not (tmp_path / "outputs" / "three" / "metrics.jsonl").exists()
