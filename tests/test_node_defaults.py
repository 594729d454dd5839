"""A node of GPUs by default. ``rollout.num_workers`` and ``env_workers.num_workers`` default to ``auto``: one
inference worker and one env worker per GPU, beside the actor's FSDP2 ranks on every GPU. ``rollout.merge_lora``,
``rollout.compile`` and ``algorithm.recompute_old_logprob`` default to ``auto``: on a machine with GPUs, through Ray,
the inference copies are merged and compiled and the actor corrects for their numerics (truncated importance
weights). On a CPU, or in one process, all of them stay as they were (one of each worker, nothing merged). The
devices are the ones the config is checked against (8 slots standing for 8 GPUs)."""

from __future__ import annotations

import pytest

from embodirl import schema
from embodirl.actor.settings import ActorSettings
from embodirl.config import compose, validate


def _decided(*overrides: str, accelerator: str | None = "gpu"):
    cfg = compose(["env=toy_reach", *overrides])
    run = schema.check(cfg, num_devices=8, accelerator=accelerator).config
    return run.rollout.merge_lora, run.rollout.compile, run.algorithm.recompute_old_logprob


def test_on_gpus_the_vlas_act_merged_and_compiled_and_the_actor_corrects():
    assert _decided("model=openvla_oft_tiny") == (True, True, True)
    # pi0 trains its action expert in full (no adapter to merge): compiled, corrected
    assert _decided("model=pi0_tiny") == (False, True, True)


def test_on_a_cpu_or_in_one_process_nothing_changes():
    assert _decided("model=openvla_oft_tiny", accelerator="cpu") == (False, False, False)
    assert _decided("model=openvla_oft_tiny", "cluster.use_ray=false") == (False, False, False)
    assert _decided() == (False, False, False)                       # the default job's state policy: in process
    run = validate(compose(["env=toy_reach", "model=openvla_oft_tiny"]), check_envs=False)   # this machine: no GPU
    assert (run.rollout.merge_lora, run.rollout.compile, run.algorithm.recompute_old_logprob) == (False, False, False)


def test_explicit_values_are_kept():
    assert _decided("model=openvla_oft_tiny", "rollout.merge_lora=false") == (False, True, True)
    assert _decided("model=openvla_oft_tiny", "algorithm.recompute_old_logprob=false") == (True, True, False)
    assert _decided("model=openvla_oft_tiny", "rollout.compile=false", "rollout.merge_lora=false") == (False, False, False)
    with pytest.raises(Exception, match="rollout.merge_lora"):       # an explicit true where it cannot apply: refused
        _decided("model=openvla_oft_tiny", "rollout.merge_lora=true", "cluster.use_ray=false")


def test_an_actor_handed_its_sections_alone_reads_auto_as_its_own_log_probs():
    cfg = compose(["env=toy_reach"])
    settings = ActorSettings.from_config({"algorithm": cfg.algorithm, "actor": cfg.actor})
    assert settings.algorithm.recompute_old_logprob is False


def test_every_gpu_of_a_node_gets_an_inference_and_an_env_worker():
    """8 slots standing for the 8 GPUs of a node: with the default placement (every component on every device) the
    actor spans all 8, and there is an inference worker and an env worker on each; on CPU slots one of each."""
    from embodirl.workers.placement_groups import plan_placement

    cfg = compose(["env=libero_10", "model=openvla_oft"])
    ctx = schema.check(cfg, num_devices=8, accelerator="gpu")
    run = ctx.config
    assert (run.rollout.num_workers, run.env_workers.num_workers, ctx.dp, ctx.use_ray) == (8, 8, 8, True)
    plan = plan_placement(ctx.placement, {"actor": ctx.dp, "rollout": run.rollout.num_workers,
                                          "env": run.env_workers.num_workers})
    for component in ("actor", "rollout", "env"):
        assert sorted(slot.device for slot in plan.slots[component]) == list(range(8))
    cpu = schema.check(cfg, num_devices=8, accelerator="cpu").config
    assert (cpu.rollout.num_workers, cpu.env_workers.num_workers) == (1, 1)
    # envs that do not split into whole groups over 8 workers: the most workers that keep whole groups
    odd = schema.check(compose(["env=libero_10", "model=openvla_oft", "env.train.num_envs=48"]), num_devices=8,
                       accelerator="gpu").config
    assert odd.env_workers.num_workers == 6 and odd.rollout.num_workers == 8


def test_doctor_prints_the_plan_of_a_node(tmp_path):
    """``cluster.num_gpus_per_node=8`` declares a node of 8 GPUs: doctor lays every component on all of them."""
    from tests import cli_runs

    out = cli_runs.run(["doctor", "env=toy_reach", "model=openvla_oft_tiny", "cluster.num_gpus_per_node=8"], tmp_path)
    lines = out.stdout.splitlines()
    assert "plan: 8 GPU device(s) through Ray" in lines, out.stdout[-2000:]
    assert any(line.startswith("  actor: 8 rank(s) on GPU 0-7 (FSDP2)") for line in lines)
    assert any(line.startswith("  inference: 8 worker(s) on GPU 0-7") and "merged, compiled" in line for line in lines)
    assert any(line.startswith("  memory: ") and "busiest GPU" in line for line in lines)
