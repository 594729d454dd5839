"""actor.compile: the learner's transformer blocks compiled with torch.compile update the tiny OpenVLA-OFT policy
as the plain learner does, with one set of graphs per block class, in one process and as two FSDP2 ranks.

The comparison is of one AdamW step from the same weights on the same batch. Adam's first step moves each
weight by about ``lr * sign(grad)``, so it turns a rounding difference in a near-zero gradient into a whole step;
the gradients themselves (read by an optimizer pre-step hook, after clipping) and the losses are compared at a
float32 tolerance, and the moved weights only where their gradient is well above that tolerance (elsewhere they
may differ by at most two steps)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from embodirl import data as D
from embodirl.actor import fsdp
from embodirl.actor.actor import Actor, prepare_batch
from embodirl.actor.optim import trainable_named_parameters

from .helpers import OFT_TASKS, actor_cfg, oft_batch, oft_policy, ppo

LR = 1e-3
WORLD = 2
#: compiled and plain forwards round differently (fused float32 kernels; measured: gradients within 5e-6 of each
#: tensor's largest entry, losses within 5e-7): gradients agree to RTOL with a floor of GRAD_FLOOR x the tensor's
#: largest gradient, the losses (means of terms of order one, pg_loss nearly cancelling) to RTOL or LOSS_ATOL
RTOL, GRAD_FLOOR, LOSS_ATOL = 1e-3, 1e-4, 1e-5
LOSS_KEYS = ("actor/pg_loss", "critic/value_loss", "actor/entropy", "actor/grad_norm", "actor/approx_kl")


def config(*, compiled: bool, checkpointing: bool = False, kl_beta: float = 0.0) -> dict:
    """One optimizer step over the whole batch (N = 4 rows), in micro-batches of 2 rows."""
    return actor_cfg(ppo(update_epochs=1, kl_beta=kl_beta),
                     {"global_batch_size": 4, "micro_batch_size": 2, "optim.lr": LR, "optim.value_lr": LR,
                      "compile": compiled, "fsdp.gradient_checkpointing": checkpointing})


def fixed_shape_batch(cfg) -> D.TensorDict:
    """The tiny policy's own trajectories with every decision valid and one instruction for every row, so that
    every micro-batch has the same shapes (no recompilation for a new size)."""
    batch = oft_batch(oft_policy(seed=0), N=4, T=2, seed=21)
    N, T = batch.batch_size
    truncated = torch.zeros(N, T, dtype=torch.bool)
    truncated[:, -1] = True
    batch.set(D.VALID, torch.ones(N, T, dtype=torch.bool))
    batch.set(D.TRUNCATED, truncated)
    batch.set(D.TASK_ID, torch.zeros(N, T, dtype=torch.long))
    return prepare_batch(batch, cfg["algorithm"])[0]


def block_classes(policy) -> list[type]:
    return sorted({type(unit) for unit in fsdp.shard_units(policy)}, key=lambda cls: cls.__name__)


def graphs_per_class(classes) -> dict[str, int]:
    """Dynamo's cached graphs of each block class's own forward (what fsdp.compile_units compiles)."""
    return {cls.__name__: len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(fsdp._own_forward(cls).__code__))
            for cls in classes}


def update_capturing_grads(actor: Actor, batch) -> tuple[dict, dict, dict]:
    """``(metrics, gradients, weights after the step)`` of one update (full tensors, collective under FSDP2)."""
    named = trainable_named_parameters(actor.policy)
    grads: dict[str, torch.Tensor] = {}

    def capture(optimizer, args, kwargs):
        grads.update({name: fsdp.full_tensor(p.grad).clone() for name, p in named if p.grad is not None})

    handle = actor.optimizer.register_step_pre_hook(capture)
    try:
        if actor.cfg.algorithm.kl_active:
            batch = actor.compute_ref_logprob(batch)
        metrics = actor.update(batch)
    finally:
        handle.remove()
    return metrics, grads, actor.gather_trainable()


def assert_same_update(got, want, before: dict[str, torch.Tensor]) -> None:
    (got_metrics, got_grads, got_weights), (metrics, grads, weights) = got, want
    for key in LOSS_KEYS:
        if key in metrics:
            torch.testing.assert_close(got_metrics[key], metrics[key], rtol=RTOL, atol=LOSS_ATOL, msg=key)
    assert set(got_grads) == set(grads) and grads
    moved = 0
    for name, grad in grads.items():
        floor = GRAD_FLOOR * float(grad.abs().max())
        torch.testing.assert_close(got_grads[name], grad, rtol=RTOL, atol=floor, msg=name)
        step, got_step = weights[name] - before[name], got_weights[name] - before[name]
        assert float((got_step - step).abs().max()) <= 2 * LR * (1 + 1e-3), name
        clear = grad.abs() > 100 * floor   # far above the rounding: the same step, up to Adam's eps
        torch.testing.assert_close(got_step[clear], step[clear], rtol=0, atol=1e-3 * LR, msg=name)
        moved += int(clear.sum())
    assert moved > 0


@pytest.mark.slow
def test_compiled_blocks_update_as_the_plain_actor():
    """actor.compile=true: every block's forward is compiled (one graph per block class, plus one for a tower's
    first block, whose input has no gradient), a second update compiles nothing, and the update is the plain one."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    plain_cfg, compiled_cfg = config(compiled=False), config(compiled=True)
    batch = fixed_shape_batch(plain_cfg)
    before = dict((name, p.detach().clone()) for name, p in trainable_named_parameters(oft_policy(seed=0)))
    plain = Actor(oft_policy(seed=0), plain_cfg, task_table=OFT_TASKS, device="cpu")
    want = update_capturing_grads(plain, batch)

    policy = oft_policy(seed=0)
    classes = block_classes(policy)
    graphs_before, frames_before = graphs_per_class(classes), counters["stats"]["unique_graphs"]
    compiled = Actor(policy, compiled_cfg, task_table=OFT_TASKS, device="cpu")
    got = update_capturing_grads(compiled, batch)
    graphs = {name: n - graphs_before[name] for name, n in graphs_per_class(classes).items()}
    assert counters["stats"]["unique_graphs"] - frames_before >= sum(graphs.values())

    assert graphs["LlamaDecoderLayer"] == 1, graphs            # its 2 blocks share one graph
    assert graphs["Dinov2WithRegistersLayer"] == graphs["SiglipEncoderLayer"] == 2, graphs   # 3 blocks each
    assert all(n <= 2 for n in graphs.values()), graphs
    assert_same_update(got, want, before)

    compiled.update(batch)   # same shapes again: the cached graphs serve it
    assert {name: n - graphs_before[name] for name, n in graphs_per_class(classes).items()} == graphs


def test_compile_refuses_transformers_checkpointing_and_a_second_wrap():
    policy = oft_policy(seed=0)
    units = fsdp.shard_units(policy)
    fsdp.enable_gradient_checkpointing(units[:1])
    with pytest.raises(RuntimeError, match="already replaced"):
        fsdp.compile_units(units[:1])
    units[1].gradient_checkpointing = True
    with pytest.raises(RuntimeError, match="actor.fsdp.gradient_checkpointing"):
        fsdp.compile_units(units[1:2])


def test_config_refuses_compile_with_the_models_own_checkpointing():
    from embodirl.config import compose, validate
    from embodirl.errors import ConfigError

    overrides = ["env=toy_reach", "model=openvla_oft_tiny", "actor.compile=true"]
    validate(compose(overrides), check_envs=False, num_devices=1, accelerator="cpu")
    with pytest.raises(ConfigError, match="actor.compile"):
        validate(compose([*overrides, "model.gradient_checkpointing=true"]), check_envs=False, num_devices=1,
                 accelerator="cpu")


# --- two FSDP2 ranks (gloo) with compiled, checkpointed blocks ------------------------------------------------
def _rank_main(rank: int, port: int, out_dir: str):
    torch.set_num_threads(1)
    fsdp.init_process_group(rank=rank, world_size=WORLD, master_addr="127.0.0.1", master_port=port,
                            device=torch.device("cpu"))
    try:
        cfg = config(compiled=True, checkpointing=True, kl_beta=0.1)
        batch = prepare_batch(oft_batch(oft_policy(seed=0), N=4, T=2, seed=21), cfg["algorithm"], kl_coef=0.1)[0]
        rows = batch.batch_size[0] // WORLD
        policy = oft_policy(seed=0)
        classes = block_classes(policy)
        actor = Actor(policy, cfg, task_table=OFT_TASKS, device="cpu")
        assert actor.use_fsdp
        result = update_capturing_grads(actor, batch[rank * rows:(rank + 1) * rows])
        if rank == 0:
            torch.save({"update": result, "graphs": graphs_per_class(classes)}, os.path.join(out_dir, "compiled.pt"))
    finally:
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_compiled_fsdp2_ranks_update_as_one_plain_process(tmp_path):
    """Compiled blocks under fully_shard and gradient checkpointing, with the KL reference forward (adapters off)
    and batches whose sizes change between micro-batches: two gloo ranks update as one plain process. Graphs per
    block class stay bounded: with and without a gradient for the block's input, each at one size and then for
    any size, and the same two for the forwards without autograd (the reference log-probs)."""
    mp.spawn(_rank_main, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    saved = torch.load(tmp_path / "compiled.pt")
    # every block class but SigLIP's pooling head (OpenVLA reads the patch features) has graphs
    assert all(1 <= n <= 6 for name, n in saved["graphs"].items() if "Pooling" not in name), saved["graphs"]
    assert max(saved["graphs"].values()) < torch._dynamo.config.recompile_limit   # no block fell back to eager

    cfg = config(compiled=False, kl_beta=0.1)
    batch = prepare_batch(oft_batch(oft_policy(seed=0), N=4, T=2, seed=21), cfg["algorithm"], kl_coef=0.1)[0]
    before = dict((name, p.detach().clone()) for name, p in trainable_named_parameters(oft_policy(seed=0)))
    plain = Actor(oft_policy(seed=0), cfg, task_table=OFT_TASKS, device="cpu")
    assert not plain.use_fsdp
    assert_same_update(saved["update"], update_capturing_grads(plain, batch), before)
