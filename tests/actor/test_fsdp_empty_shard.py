"""Two FSDP2 actor ranks (gloo, CPU) where shards hold no valid decision: a rank whose shard is all
padding still takes part in the step (which matches one process on the whole batch), and a step with no
valid decision on any rank is skipped by every rank alike (no hang, weights and optimizer untouched)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from embodirl import data as D
from embodirl.actor.actor import Actor, prepare_batch

from .helpers import TASKS, TinyTokenPolicy, actor_cfg, grpo, token_batch
from .test_fsdp import free_port

WORLD = 2
CFG = actor_cfg(grpo(), {"micro_batch_size": 2, "optim.lr": 3e-3, "optim.weight_decay": 0.1})


def batches():
    """name -> the whole prepared batch (8 rows: rank 0 takes rows 0-3, rank 1 rows 4-7)."""
    batch = prepare_batch(token_batch(N=8, T=4, policy=TinyTokenPolicy(seed=0), seed=21), CFG["algorithm"])[0]
    one_empty = batch.clone()
    one_empty.get(D.VALID)[4:] = False
    none = batch.clone()
    none.get(D.VALID)[:] = False
    return {"one_rank_empty": one_empty, "all_empty": none}


def _rank_main(rank: int, port: int, out_dir: str):
    from embodirl.actor import fsdp

    torch.set_num_threads(1)
    fsdp.init_process_group(rank=rank, world_size=WORLD, master_addr="127.0.0.1", master_port=port,
                            device=torch.device("cpu"))
    try:
        for name, batch in batches().items():
            actor = Actor(TinyTokenPolicy(seed=0), CFG, task_table=TASKS, device="cpu")
            metrics = actor.update(batch[rank * 4:(rank + 1) * 4])
            full = actor.publish_weights(full=True)[1]
            if rank == 0:
                torch.save({"full": full, "steps": actor.optimizer_steps,
                            "skipped": float(metrics["actor/skipped_empty_steps"])},
                           os.path.join(out_dir, f"{name}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_empty")
    mp.spawn(_rank_main, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return {name: torch.load(out / f"{name}.pt") for name in batches()}


def test_a_rank_with_only_padding_takes_part_in_the_step(results):
    got = results["one_rank_empty"]
    single = Actor(TinyTokenPolicy(seed=0), CFG, task_table=TASKS, device="cpu")
    single.update(batches()["one_rank_empty"])
    want = single.publish_weights(full=True)[1]
    assert got["steps"] == 1 and got["skipped"] == 0.0
    for key in want:
        torch.testing.assert_close(got["full"][key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_step_without_valid_decisions_is_skipped_on_every_rank(results):
    got = results["all_empty"]
    initial = dict(TinyTokenPolicy(seed=0).named_parameters())
    assert got["steps"] == 0 and got["skipped"] == 1.0
    for key, value in got["full"].items():
        torch.testing.assert_close(value, initial[key].detach(), rtol=0, atol=0, msg=key)
