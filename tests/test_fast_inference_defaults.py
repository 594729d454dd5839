"""``rollout.merge_lora``, ``rollout.compile`` and ``algorithm.recompute_old_logprob`` default to ``auto``: on a
machine with GPUs, through Ray, the inference copies are merged and compiled and the actor corrects for their
numerics (truncated importance weights); on a CPU, or in one process, all three stay off, so the CPU runs are the
ones they were. The devices are the ones the config is checked against (8 slots standing for 8 GPUs)."""

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
