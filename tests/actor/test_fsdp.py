"""Two FSDP2 actor processes (gloo, CPU) give the same update as one plain process.

One ``torch.multiprocessing.spawn`` of 2 ranks runs several scenarios in the same process group:
each rank takes its half of the rows of a prepared batch, computes reference log-probs (collective),
updates and publishes (gathering the DTensor shards); rank 0 saves what it published."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from embodirl.actor.actor import Actor, prepare_batch

from .helpers import OFT_TASKS, TASKS, TinyTokenPolicy, actor_cfg, grpo, oft_batch, oft_policy, ppo, token_batch

WORLD = 2


def scenarios():
    """name -> (policy kind, actor cfg)."""
    fp32 = {"micro_batch_size": 2, "optim.lr": 3e-3}
    return {
        # transformer-like blocks as FSDP units, PPO with value loss, KL loss (reference forward),
        # gradient checkpointing and CPU offload (neither may change the numbers)
        "token_ppo_kl": ("token", actor_cfg(ppo(kl_beta=0.1, entropy_bonus=0.01),
                                              {**fp32, "fsdp.gradient_checkpointing": True,
                                               "fsdp.cpu_offload": True})),
        "token_grpo_seqmean": ("token", actor_cfg(grpo(loss_agg_func="seq-mean-token-mean", update_epochs=2),
                                                    fp32)),
        # the moving average evaluation acts with (actor.ema_decay): averaged, swapped and saved shard by shard
        "token_grpo_ema": ("token", actor_cfg(grpo(), {**fp32, "ema_decay": 0.5})),
        # bf16 compute with fp32 master weights and fp32 reduction
        "token_ppo_bf16": ("token", actor_cfg(ppo(), {**fp32, "fsdp.param_dtype": "bfloat16"})),
        # the real tiny OpenVLA-OFT: transformers blocks (DINOv2, SigLIP, Llama) as units, peft LoRA
        # with fully trained value head and proprio projector, KL to the adapter-disabled model
        "oft_ppo_kl": ("oft", actor_cfg(ppo(kl_beta=0.1, update_epochs=1),
                                          {"global_batch_size": 4, "micro_batch_size": 1, "optim.lr": 1e-3})),
    }


def make_policy(kind: str):
    return TinyTokenPolicy(seed=0) if kind == "token" else oft_policy(seed=0)


def prepared_batch(kind: str, cfg):
    if kind == "token":
        batch = token_batch(N=8, T=4, policy=TinyTokenPolicy(seed=0), seed=21)
    else:
        batch = oft_batch(oft_policy(seed=0), N=4, T=2, seed=21)
    return prepare_batch(batch, cfg["algorithm"], kl_coef=float(cfg["algorithm"]["kl_beta"]))[0]


def task_table(kind: str):
    return TASKS if kind == "token" else OFT_TASKS


def run_update(actor: Actor, batch):
    if actor.cfg.algorithm.kl_active:
        batch = actor.compute_ref_logprob(batch)
    metrics = actor.update(batch)
    version, state = actor.publish_weights()
    return metrics, version, state


def _rank_main(rank: int, port: int, out_dir: str):
    from embodirl.actor import fsdp

    torch.set_num_threads(1)
    fsdp.init_process_group(rank=rank, world_size=WORLD, master_addr="127.0.0.1", master_port=port,
                            device=torch.device("cpu"))
    try:
        for name, (kind, cfg) in scenarios().items():
            batch = prepared_batch(kind, cfg)
            rows = batch.batch_size[0] // WORLD
            shard = batch[rank * rows:(rank + 1) * rows]
            actor = Actor(make_policy(kind), cfg, task_table=task_table(kind), device="cpu")
            assert actor.use_fsdp
            metrics, version, state = run_update(actor, shard)
            full = actor.publish_weights(full=True)[1]
            result = {"metrics": metrics, "version": version, "state": state, "full": full}
            if name == "token_grpo_seqmean":  # checkpoint round trip of sharded weights and optimizer
                saved = actor.state_dict()
                restored = Actor(make_policy(kind), cfg, task_table=task_table(kind), device="cpu")
                restored.load_state_dict(saved)
                for resumed in (actor, restored):
                    run_update(resumed, shard)
                result["resumed"] = [x.publish_weights(full=True)[1] for x in (actor, restored)]
            if name == "token_grpo_ema":
                result["ema"] = average_swap_and_save(actor, shard, cfg, os.path.join(out_dir, "ema_ckpt"))
            if name == "token_ppo_bf16":  # collocated placement: parked in host buffers and back, twice
                result["parked"] = park_twice_and_update(actor, shard, cfg)
            if rank == 0:
                torch.save(result, os.path.join(out_dir, f"{name}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def average_swap_and_save(actor: Actor, shard, cfg, folder: str) -> dict:
    """A second update, then the average as evaluation and a checkpoint see it, the module while swapped and after
    swapping back, and a fresh 2-rank actor's average after loading the sharded checkpoint (DCP)."""
    from embodirl.actor.sharded_state import load_actor, save_actor

    run_update(actor, shard)
    out = {"evaluated": actor.gather_trainable(evaluated=True), "weights": actor.gather_trainable()}
    assert actor.swap_ema()
    out["swapped"] = actor.publish_weights(full=True)[1]
    assert not actor.swap_ema()
    out["back"] = actor.publish_weights(full=True)[1]
    save_actor(actor, folder)
    restored = Actor(make_policy("token"), cfg, task_table=TASKS, device="cpu")
    load_actor(restored, folder)
    out["loaded"] = restored.gather_trainable(evaluated=True)
    return out


def park_twice_and_update(actor: Actor, shard, cfg) -> dict:
    """The worker's offload/onload moves (HostParking) on DTensor shards and Adam state, then one more update;
    the same update without the moves is the reference."""
    from embodirl.workers.parking import HostParking

    twin = Actor(make_policy("token"), cfg, task_table=TASKS, device="cpu")
    run_update(twin, shard)
    parking, layouts = HostParking(), []
    for _ in range(2):
        parking.offload(actor.policy, actor.optimizer)
        locals_ = [p._local_tensor for p in actor.policy.parameters()]
        layouts.append((parking.host_bytes, len(parking._slots), sum(parking._parked(t) for t in locals_)))
        parking.onload(actor.policy, "cpu", actor.optimizer)
    still_parked = sum(parking._parked(p._local_tensor) for p in actor.policy.parameters())
    return {"layouts": layouts, "still_parked": still_parked, "moved": len(locals_),
            "after": [x.publish_weights(full=True)[1] for x in (actor, twin)],
            "updated": [run_update(x, shard)[2] for x in (actor, twin)]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_rank_main, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return {**{name: torch.load(out / f"{name}.pt") for name in scenarios()}, "_dir": out}


@pytest.mark.slow
def test_parking_in_host_buffers_changes_nothing(two_rank_results):
    """Collocated placement's offload/onload (HostParking): FSDP2 shards and Adam state go into host buffers laid
    out at the first offload and reused at the second, come back, and the next update is the one without moves."""
    got = two_rank_results["token_ppo_bf16"]["parked"]
    (bytes1, slots1, parked1), (bytes2, slots2, parked2) = got["layouts"]
    assert bytes1 == bytes2 > 0 and slots1 == slots2 > 0       # no new buffers at the second offload
    assert parked1 == parked2 > 0 and got["still_parked"] == 0
    for parked, twin in (got["after"], got["updated"]):
        assert set(parked) == set(twin) and parked
        for key, value in twin.items():
            torch.testing.assert_close(parked[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["token_ppo_kl", "token_grpo_seqmean", "oft_ppo_kl"])
def test_two_fsdp_ranks_match_one_process(two_rank_results, name):
    kind, cfg = scenarios()[name]
    single = Actor(make_policy(kind), cfg, task_table=task_table(kind), device="cpu")
    assert not single.use_fsdp
    metrics, version, state = run_update(single, prepared_batch(kind, cfg))
    got = two_rank_results[name]
    assert got["version"] == version == 1
    assert set(got["state"]) == set(state) and state  # the same changed tensors, by name
    for key, value in state.items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-4, atol=1e-6, msg=key)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/clip_fraction", "actor/entropy", "actor/decisions"):
        torch.testing.assert_close(got["metrics"][key], metrics[key], rtol=1e-4, atol=1e-6, msg=key)
    if name != "token_grpo_seqmean":
        for key in ("critic/value_loss", "actor/kl"):
            torch.testing.assert_close(got["metrics"][key], metrics[key], rtol=1e-4, atol=1e-6, msg=key)
    if name == "token_ppo_kl":
        assert got["metrics"]["actor/kl"] > 0  # second epoch: the adapter has moved away from the reference


@pytest.mark.slow
def test_the_moving_average_on_two_ranks(two_rank_results):
    """actor.ema_decay under FSDP2: each rank averages its shards; the gathered average is the one-process average, the
    swap puts exactly it into the module and back, and the sharded checkpoint restores it on 2 ranks and on 1."""
    from embodirl.actor.sharded_state import load_actor

    kind, cfg = scenarios()["token_grpo_ema"]
    single = Actor(make_policy(kind), cfg, task_table=TASKS, device="cpu")
    batch = prepared_batch(kind, cfg)
    for _ in range(2):
        run_update(single, batch)
    got = two_rank_results["token_grpo_ema"]["ema"]
    want = single.gather_trainable(evaluated=True)
    assert set(got["evaluated"]) == set(want)
    moved = [k for k in want if not torch.equal(want[k], single.gather_trainable()[k])]
    assert moved, "the average should differ from the weights after two updates"
    for key, value in want.items():
        torch.testing.assert_close(got["evaluated"][key], value, rtol=1e-4, atol=1e-6, msg=key)
    for key in want:
        torch.testing.assert_close(got["swapped"][key], got["evaluated"][key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(got["back"][key], got["weights"][key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(got["loaded"][key], got["evaluated"][key], rtol=0, atol=0, msg=key)
    one = Actor(make_policy(kind), cfg, task_table=TASKS, device="cpu")     # the 2-rank checkpoint on 1 rank
    load_actor(one, two_rank_results["_dir"] / "ema_ckpt")
    for key, value in one.gather_trainable(evaluated=True).items():
        torch.testing.assert_close(value, got["evaluated"][key], rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_bf16_mixed_precision_update(two_rank_results):
    """bf16 compute, fp32 master weights: published tensors stay fp32 and the update points the same
    way as the fp32 single-process update."""
    kind, cfg = scenarios()["token_ppo_bf16"]
    fp32_cfg = {**cfg, "actor": {**cfg["actor"], "fsdp": {**cfg["actor"]["fsdp"], "param_dtype": None}}}
    initial = dict(make_policy(kind).named_parameters())
    _, _, state = run_update(Actor(make_policy(kind), fp32_cfg, task_table=TASKS, device="cpu"),
                             prepared_batch(kind, fp32_cfg))
    got = two_rank_results["token_ppo_bf16"]["full"]
    for key, value in state.items():
        assert got[key].dtype == torch.float32
        want = (value - initial[key].detach()).flatten()
        have = (got[key] - initial[key].detach()).flatten()
        assert torch.nn.functional.cosine_similarity(want, have, dim=0) > 0.9, key


@pytest.mark.slow
def test_sharded_learner_state_round_trip(two_rank_results):
    """state_dict() gathers the sharded weights and optimizer moments; a fresh sharded actor that
    loads them continues exactly like the original."""
    original, restored = two_rank_results["token_grpo_seqmean"]["resumed"]
    assert original.keys() == restored.keys()
    for key in original:
        torch.testing.assert_close(restored[key], original[key], rtol=0, atol=0, msg=key)
