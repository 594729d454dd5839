"""Importance ratio 1 at the first minibatch, the first check a researcher runs: an inference worker with its own copy
of the tiny OpenVLA-OFT in bfloat16 collects a batch on the toy task, an FSDP2 actor rank (gloo, one rank, bf16
compute with float32 master weights) updates on it, and the first optimizer step's max |ratio - 1| is measured.

The inference copy holds its adapters in the dtype the actor computes them in (FSDP2's param_dtype), so the two
forwards agree up to bfloat16 rounding in differently shaped batches (the rollout decides for 8 envs at a time,
the actor scores 2 trajectories of 6 decisions); with ``algorithm.recompute_old_logprob`` the actor scores
the batch itself in the first epoch's micro-batches and the ratio is 1 exactly. Before, the inference copy ran its
adapters in float32 (peft upcasts them) while the actor computed in bfloat16: 6.0e-3 here. Two training steps
run, and the second is measured: the first starts from LoRA's B = 0, where the adapters add nothing in any dtype."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from .test_fsdp import free_port

#: half of bfloat16's relative precision (2^-8): kernels that sum in another order for another batch shape may move
#: a log-prob by about that much; the float32-adapter rollout this test replaced measured 6.0e-3 here (5e-3 on the
#: machine that reported it), and this machine measures 0 for the matched dtypes
BF16_RATIO_TOLERANCE = 2e-3
OVERRIDES = ["env=toy_reach", "model=openvla_oft_tiny", "model.dtype=bfloat16", "algorithm=grpo",
             "algorithm.group_size=4", "env.train.use_fixed_reset_state_ids=true", "env.train.num_envs=8",
             "env.train.max_episode_steps=24", "env.train.reward_mode=dense", "model.action_chunk=4",
             "actor.global_batch_size=8", "actor.micro_batch_size=2", "algorithm.update_epochs=1",
             "algorithm.filter_groups.enable=false"]


def _rank(rank: int, port: int, out: str, overrides: list[str]) -> None:
    from embodirl.actor import fsdp
    from embodirl.actor.actor import Actor, prepare_batch
    from embodirl.config import compose
    from embodirl.workers.actor_worker import build_policy
    from embodirl.workers.groups import WorkerGroups

    fsdp.init_process_group(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    results = {}
    try:
        for recompute in (False, True):
            cfg = compose([*overrides, f"algorithm.recompute_old_logprob={str(recompute).lower()}"])
            with WorkerGroups.from_config(cfg, remote=False) as groups:
                spec = groups.env.spec
                policy = groups.inference.workers[0].engine.policy
                dtypes = sorted({str(p.dtype) for p in policy.parameters() if p.requires_grad})
                actor = Actor(build_policy(cfg.model, spec, int(cfg.runner.seed)),
                                  {"algorithm": cfg.algorithm, "actor": cfg.actor}, task_table=spec.task_descriptions)
                # two steps: the second starts from trained adapters (the first from LoRA's B = 0, which adds nothing)
                for _ in range(2):
                    version, tensors = actor.publish_weights(full=True)
                    groups.inference.publish_weights(tensors, version, full=True)
                    prepared, _ = prepare_batch(groups.collect(), cfg.algorithm)
                    metrics = actor.update(prepared)
                results[str(recompute)] = {"error": float(metrics["actor/first_step_ratio_error"]),
                                           "fsdp": actor.use_fsdp, "rollout_trainable_dtypes": dtypes}
    finally:
        fsdp.dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)


@pytest.mark.slow
def test_first_minibatch_ratio_is_one_between_an_inference_worker_and_an_fsdp2_actor(tmp_path):
    out = str(tmp_path / "ratio.json")
    mp.spawn(_rank, args=(free_port(), out, OVERRIDES), nprocs=1, join=True)
    with open(out) as f:
        results = json.load(f)
    print(results)
    for r in results.values():
        assert r["fsdp"] and r["rollout_trainable_dtypes"] == ["torch.bfloat16"]
    assert results["False"]["error"] < BF16_RATIO_TOLERANCE
    assert results["True"]["error"] < 1e-6       # the same forward, in the same micro-batches
