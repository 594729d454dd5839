"""``embodirl eval`` in this process and on Ray workers is one evaluation: the training collector with the
evaluation sampling and one report builder. Through the CLI, the two paths write the same report (the same
fields, the same episodes with the same outcomes), and both honour the evaluation sampling: a temperature
of 0 samples the greedy actions, a temperature of 1 does not, and ``rollout.top_k=1`` draws the same actions
whatever the generator."""

from __future__ import annotations

import json
import math
import os

import pytest

from tests import cli_runs

# dense rewards: an episode's return traces its whole trajectory, so equal returns mean equal episodes
TOY = ["env=toy_reach", "env.train.num_envs=2", "env.eval.num_envs=2", "env.train.num_tasks=2", "env.eval.num_tasks=2",
       "env.eval.reward_mode=dense", "env.eval.step_size=0.3", "runner.eval_episodes_per_task=2",
       "runner.eval_num_videos=1", "runner.progress_bar=false", "runner.logger.tensorboard=false"]
STATE = ["env.train.state_obs=true", "env.eval.state_obs=true"]
TINY_VLA = ["model=openvla_oft_tiny", "env.eval.max_episode_steps=16", "env.train.max_episode_steps=16"]
TIMING = ("eval_s", "eval_ep_s")        # wall-clock: the only fields allowed to differ


@pytest.fixture(scope="module")
def ray_head():
    """One local Ray for the module's Ray evaluations to join (``cluster.ray_address``), with the slots a private Ray
    of the run would have (one per core): one Ray start instead of one per Ray run (three). What they compare does
    not depend on who started Ray; tests/workers/test_ray_cluster.py covers starting and joining. The file took 59
    CPU-s and 65 s wall instead of 67 and 75 (the 2-core machine, 2026-12-07, one run each)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": os.cpu_count() or 1, "include_dashboard": False})
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


def on(path: str, ray_head: str) -> list[str]:
    """The overrides that run the evaluation in this process (``local``) or on the module's Ray (``ray``)."""
    return ["cluster.use_ray=false"] if path == "local" else ["cluster.use_ray=true", f"cluster.ray_address={ray_head}"]


def evaluate(tmp_path, name: str, *overrides: str) -> dict:
    cli_runs.run(["eval", *TOY, *overrides, f"runner.experiment_name={name}"], tmp_path, expect=0)
    return json.loads((tmp_path / "outputs" / name / "eval_info.json").read_text())


def without_timing(info: dict) -> dict:
    """The report without wall-clock fields."""
    return {**info, "overall": {k: v for k, v in info["overall"].items() if k not in TIMING}}


def assert_same_report(a: dict, b: dict, where: str = "") -> None:
    """Equal reports: every non-float equal, floats equal to float32 rounding (a policy copied into a Ray worker
    may sum in another order: the last bits of a return may differ; rounding both to fixed digits would not hide
    that, a value next to a rounding boundary flips)."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), where
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same_report(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_report(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def returns(info: dict) -> list[float]:
    return [round(e["return"], 9) for e in info["per_episode"]]


@pytest.mark.slow
def test_in_process_and_ray_evaluation_write_the_same_report(tmp_path, ray_head):
    local = evaluate(tmp_path, "local", *STATE, *on("local", ray_head))
    ray = evaluate(tmp_path, "ray", *STATE, *on("ray", ray_head))
    assert set(local["overall"]) == set(ray["overall"]) and set(TIMING) <= set(local["overall"])
    for key in ("per_episode", "per_task"):
        assert [sorted(e) for e in local[key]] == [sorted(e) for e in ray[key]], key
    assert len(local["per_episode"]) == 4 and len(set(returns(local))) == 4    # four different episodes
    # the same episodes, outcomes, lengths, returns, seeds, videos and summaries on both paths
    assert_same_report(without_timing(local), without_timing(ray))
    assert len(ray["overall"]["video_paths"]) == 1
    assert (tmp_path / "outputs" / "ray" / ray["overall"]["video_paths"][0]).is_file()
    # evaluation sampling: temperature 0 is greedy on both paths; temperature 1 samples other actions
    cold = {path: evaluate(tmp_path, f"cold_{path}", *STATE, *on(path, ray_head),
                           "runner.eval_greedy=false", "rollout.temperature=0") for path in ("local", "ray")}
    assert_same_report(without_timing(cold["local"]), without_timing(cold["ray"]))
    assert_same_report(without_timing(cold["local"]), without_timing(local))
    warm = evaluate(tmp_path, "warm_local", *STATE, *on("local", ray_head), "runner.eval_greedy=false")
    assert returns(warm) != returns(local)


@pytest.mark.slow
def test_top_k_is_honoured_by_both_evaluation_paths(tmp_path, ray_head):
    """The tiny VLA's token sampling at temperature 1: ``rollout.top_k=1`` keeps only the most likely action
    bin, so both paths draw the same actions although their generators differ (a Ray inference worker seeds
    its own). Without it the draw is another one: sampling the whole distribution differs from its top bin, so
    a path that ignored ``top_k`` could not match the other. (Greedy decoding is OFT's argmax over the whole
    vocabulary by default, which an untrained model's top action bin need not be.)"""
    runs = {(path, top_k): evaluate(tmp_path, f"{path}_{top_k}", *TINY_VLA, *on(path, ray_head),
                                    "runner.eval_greedy=false", f"rollout.top_k={top_k}")
            for path, top_k in (("local", "1"), ("ray", "1"), ("local", "null"))}
    assert_same_report(without_timing(runs["local", "1"]), without_timing(runs["ray", "1"]))
    assert returns(runs["local", "null"]) != returns(runs["local", "1"])
    # greedy over the action bins (model.greedy_decoding=action_bins) is that top bin too; OFT's greedy over the
    # whole vocabulary (the default) is not, for an untrained model
    bins = evaluate(tmp_path, "local_bins", *TINY_VLA, *on("local", ray_head), "model.greedy_decoding=action_bins")
    vocabulary = evaluate(tmp_path, "local_vocabulary", *TINY_VLA, *on("local", ray_head))
    assert returns(bins) == returns(runs["local", "1"]) != returns(vocabulary)
