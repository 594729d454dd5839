"""The full-size dry run on the meta device (embodirl/tools/dry_run.py): OpenVLA-OFT at 7.7 B parameters acts,
scores its actions, takes an actor update and publishes its adapter without memory or a GPU, so a tensor left on the CPU
inside the policy, its normalisers, tokenizer, processor or loss fails here (it crashed the first action on an
H200 at d1d7c5b: the normalisers stayed on the CPU - this test fails there). The same run counts FLOPs and bytes,
and ``embodirl doctor``'s memory estimate must lie within 15 % of its bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from embodirl.tools.dry_run import MetaDryRun, dry_run, format_report
from embodirl.tools.memory_plan import memory_plan, model_size

GIB = 1024**3


@pytest.mark.slow
@pytest.mark.parametrize("decisions", [8, 64])
def test_full_size_openvla_oft_dry_run_and_doctor_estimate(compose_cfg, decisions):
    """64 decisions per micro-batch is the LIBERO recipe's (micro-batch of one 512-step trajectory); 8 checks the
    estimate's other end. ~25 s each."""
    cfg = compose_cfg("env=libero_10", "model=openvla_oft", f"rollout.max_decisions={decisions}")
    report = dry_run(cfg)
    print(format_report(report))
    assert report.params > 7.6e9 and 100e6 < report.trainable < 200e6   # LoRA rank 32 on every linear + heads
    # ~608 tokens through 7.6 B parameters: 2 FLOPs per parameter and token, plus attention
    assert 8.0e12 < report.act_flops_per_decision < 10.0e12, report.act_flops_per_decision
    # model FLOPs: forward and backward of the activations (the frozen weights get no gradient), about two forwards;
    # hardware FLOPs add gradient checkpointing's recomputed forward of every block: about three
    assert report.gradient_checkpointing
    assert 1.9 < report.update_model_flops_per_decision / report.act_flops_per_decision < 2.2
    assert 2.8 < report.update_hardware_flops_per_decision / report.act_flops_per_decision < 3.3
    # the adapter and the trainable heads in float32, what an H200 run published (501 MiB)
    assert report.published_bytes == pytest.approx(501.3 * 1024**2, rel=0.01)
    assert report.grad_bytes == report.trainable * 4 and report.optimizer_bytes == report.trainable * 8
    doctor = memory_plan(cfg, model_size(cfg), "cpu")["actor"]
    assert doctor == pytest.approx(report.update_peak_bytes, rel=0.15), (doctor / GIB, report.update_peak_bytes / GIB)


def test_a_normaliser_left_on_the_cpu_fails_the_dry_run(compose_cfg):
    """The bug class the dry run exists for: the tiny preset built on meta acts; with its proprio normaliser made
    on the CPU instead (as d1d7c5b made it) the first action raises."""
    from embodirl.models.normalization import BoundsNormalizer

    cfg = compose_cfg("env=libero_10", "model=openvla_oft_tiny")
    report = dry_run(cfg)
    assert report.act_flops_per_decision > 0 and report.published_tensors > 0
    from embodirl.models.base import SamplingParams
    from embodirl.models.registry import make_policy, model_config
    from embodirl.tools.dry_run import _observation, dry_run_spec

    model = dataclasses.replace(model_config(cfg.model), device="meta")
    spec = dry_run_spec(cfg)
    policy = make_policy(model, spec)
    assert policy.proprio_normalizer.low.is_meta and policy.images.means.is_meta
    assert policy.action_tokenizer.centers.is_meta
    policy.proprio_normalizer = BoundsNormalizer.identity(spec.state_dim)   # created on the CPU
    with MetaDryRun(), pytest.raises(RuntimeError, match="device cpu is not on the expected device meta"):
        policy.act(_observation(spec, 2), SamplingParams())


def test_the_default_jobs_state_policy_dry_run(compose_cfg):
    report = dry_run(compose_cfg())
    assert report.params == report.trainable > 0          # every weight of the MLP trains
    assert report.act_flops_per_decision > 0 and report.update_model_flops_per_decision > report.act_flops_per_decision
    # no gradient checkpointing: nothing is recomputed
    assert not report.gradient_checkpointing
    assert report.update_hardware_flops_per_decision == report.update_model_flops_per_decision
    assert report.published_bytes == report.trainable * 4
    # actor.ema_decay: the average is one more fp32 copy of the trainable tensors, made and exchanged on meta too
    averaged = dry_run(compose_cfg("actor.ema_decay=0.9"))
    assert report.ema_bytes == 0 and averaged.ema_bytes == report.trainable * 4
    assert averaged.update_peak_bytes == report.update_peak_bytes + averaged.ema_bytes


def test_meta_dry_run_answers_host_reads():
    x = torch.empty(3, 4, device="meta")
    with MetaDryRun():
        assert bool((x > 0).all()) is True
        assert x.cpu().shape == (3, 4) and x.cpu().device.type == "cpu"
        assert (x > 0).nonzero().shape == (12, 2)


#: the π0 variants of the dry run: RLinf's recipe (the expert trains, PaliGemma frozen) with each method and with
#: gradient checkpointing, and the LoRA option on every linear layer
PI0_VARIANTS = {"expert_sde": [], "expert_sde_checkpointing": ["actor.fsdp.gradient_checkpointing=true"],
                "expert_noise": ["model.flow.method=flow_noise"],
                "lora_checkpointing": ["model.train_expert=false", "model.lora.enabled=true",
                                       "actor.fsdp.gradient_checkpointing=true"]}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(PI0_VARIANTS))
def test_full_size_pi0_dry_run_and_doctor_estimate(compose_cfg, variant):
    """π0 at 3.5 B parameters (transformers' PI0ForConditionalGeneration) on meta with the LIBERO recipe: it acts, is
    evaluated, takes an update of one 48-decision trajectory per micro-batch and publishes; doctor's estimate follows
    the trainable set and is within 15 % of the dry run's bytes. 5-20 s each."""
    cfg = compose_cfg("env=libero_10", "model=pi0", *PI0_VARIANTS[variant])
    report = dry_run(cfg)
    print(format_report(report))
    assert 3.4e9 < report.params < 3.6e9
    # ~560 prefix tokens through PaliGemma (~2.9 B) once, the 0.3 B expert over 51 tokens 4 times
    assert 2.6e12 < report.act_flops_per_decision < 3.1e12, report.act_flops_per_decision
    ratio = report.update_hardware_flops_per_decision / report.act_flops_per_decision
    assert (report.update_hardware_flops_per_decision > report.update_model_flops_per_decision) == ("checkpointing" in variant)
    if variant.startswith("expert"):
        # RLinf's trainable set: the Gemma-300M expert and its projections in full (not its unused token embedding)
        assert 300e6 < report.trainable < 330e6, report.trainable
        assert report.grad_bytes == report.trainable * 4 and report.published_bytes == report.trainable * 4
        # the frozen VLM runs forward only: an update is the prefix once plus the expert's forward and backward
        assert 0.95 < ratio < (1.3 if variant == "expert_noise" else 1.1), ratio
    else:
        assert 50e6 < report.trainable < 100e6                     # LoRA rank 32 on every linear layer + heads
        assert ratio > 2.5                                          # backward through the VLM, recomputed
    doctor = memory_plan(cfg, model_size(cfg), "cpu")["actor"]
    assert doctor == pytest.approx(report.update_peak_bytes, rel=0.15), (doctor / GIB, report.update_peak_bytes / GIB)
