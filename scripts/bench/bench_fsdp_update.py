#!/usr/bin/env python
"""Benchmark of the actor: decisions/s and peak memory of one update, one process vs FSDP2 ranks.

The same prepared trajectory batch (actions sampled from the policy itself, random rewards) is
trained on by

* 1 process  - the plain actor (no torch.distributed);
* 2 FSDP2 processes - two gloo ranks on this machine, each with half of the rows.

Each rank gets ``--threads-per-rank`` torch threads (default 1, like one accelerator per rank; on a
shared machine multi-threaded CPU kernels measure mostly contention). ``--threads-per-rank 0`` splits
the machine's cores between the ranks instead (same total compute for every setting).

Each setting runs in fresh processes: one warm-up update, then ``--repeats`` timed updates; the
settings alternate for ``--rounds`` rounds and each keeps its fastest round. Actor
decisions/s = valid decisions x update epochs (summed over ranks) / seconds per update. Memory: the
peak resident set size of each rank over its lifetime (model build included), and on GPU torch's peak
allocation. Ratios are of numbers measured side by side in one run.

Usage::

    python scripts/bench_actor.py                       # tiny OpenVLA-OFT preset, CPU, worlds 1 and 2
    python scripts/bench_actor.py --algorithm grpo --trajectories 16 --decisions 8
    # on a GPU machine: one FSDP2 update of the full-size preset, random weights, bf16 compute
    python scripts/bench_actor.py --preset full --device cuda --worlds 1 --force-fsdp \\
        --param-dtype bfloat16 --trajectories 2 --decisions 4 --micro-batch 1 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from embodirl import data as D  # noqa: E402

PRESETS = {"tiny": "openvla_oft_tiny", "full": "openvla_oft"}
TASKS = ["pick up the black bowl and place it on the plate", "open the top drawer of the cabinet"]
CAMERAS = ["agentview", "wrist"]
STATE_DIM = 8       # LIBERO's proprio size
ACTION_DIM = 7      # LIBERO's action size
SEED = 0


def compose_cfg(args) -> dict:
    from omegaconf import OmegaConf

    from embodirl.config import compose

    cfg = OmegaConf.to_container(compose([f"model={PRESETS[args.preset]}", f"algorithm={args.algorithm}"]),
                                 resolve=False)
    model = cfg["model"]
    if args.device == "cuda":
        model["dtype"] = "bfloat16" if args.param_dtype in (None, "bfloat16") else args.param_dtype
    actor = cfg["actor"]
    actor.update(global_batch_size=args.trajectories, micro_batch_size=args.micro_batch, seed=SEED)
    actor["fsdp"].update(enabled=True if args.force_fsdp else "auto", param_dtype=args.param_dtype,
                         gradient_checkpointing=args.gradient_checkpointing)
    algorithm = cfg["algorithm"]
    algorithm.update(update_epochs=args.epochs, group_size=2 if args.algorithm == "grpo" else 1)
    return {"model": model, "algorithm": algorithm, "actor": actor}


def env_spec(model: dict):
    from embodirl.envs.base import EnvSpec

    size = int(model["image_size"])
    return EnvSpec(action_dim=ACTION_DIM, max_episode_steps=512, task_descriptions=TASKS,
                   camera_names=CAMERAS, image_size=(size, size), state_dim=STATE_DIM, name="bench")


def build_policy(cfg: dict, device: str):
    from embodirl.models.openvla_oft import build_policy as build

    torch.manual_seed(SEED)
    return build(cfg["model"], env_spec(cfg["model"]), device=device)


def make_batch(cfg: dict, args, device: str) -> D.TensorDict:
    """N x T decisions whose actions, log-probs and values come from the policy; random rewards."""
    from embodirl.actor.actor import prepare_batch
    from embodirl.models.base import SamplingParams

    policy = build_policy(cfg, device)
    N, T = args.trajectories, args.decisions
    size = int(cfg["model"]["image_size"])
    g = torch.Generator().manual_seed(SEED)
    images = torch.randint(0, 256, (N, T, len(CAMERAS), 3, size, size), generator=g, dtype=torch.uint8)
    state = torch.randn(N, T, STATE_DIM, generator=g)
    task_id = torch.arange(N) % len(TASKS)
    outs = []
    with torch.no_grad():
        for n in range(N):
            obs = {D.IMAGES: images[n], D.STATE: state[n], D.TASK_ID: task_id[n].expand(T),
                   "instruction": [TASKS[int(task_id[n])]] * T}
            outs.append({k: v.float().cpu() if v.is_floating_point() else v.cpu()
                         for k, v in policy.act(obs, SamplingParams(), return_value=True).items()})
    del policy
    fields = {k: torch.stack([o[k] for o in outs]) for k in outs[0]}
    fields.update({D.IMAGES: images, D.STATE: state, D.TASK_ID: task_id,
                   D.REWARD: torch.randn(N, T, generator=g), D.VALID: torch.ones(N, T, dtype=torch.bool),
                   D.TERMINATED: torch.zeros(N, T, dtype=torch.bool), D.TRUNCATED: torch.zeros(N, T, dtype=torch.bool),
                   D.GROUP_ID: torch.arange(N) // cfg["algorithm"]["group_size"]})
    batch = D.make_trajectory(fields, extras={D.BOOTSTRAP_VALUE: torch.zeros(N)})
    return prepare_batch(batch, cfg["algorithm"])[0]


def rank_main(rank: int, world: int, port: int, args, batch_path: str, out_path: str):
    from embodirl.actor import fsdp
    from embodirl.actor.actor import Actor

    torch.set_num_threads(args.threads_per_rank or max(1, (os.cpu_count() or 1) // world))
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if world > 1 or args.force_fsdp:
        fsdp.init_process_group(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, device=device)
    cfg = compose_cfg(args)
    batch = torch.load(batch_path, weights_only=False)
    rows = batch.batch_size[0] // world
    shard = batch[rank * rows:(rank + 1) * rows]
    policy = build_policy(cfg, "cpu" if args.device == "cpu" else str(device))
    n_params = sum(p.numel() for p in policy.parameters())
    n_trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    actor = Actor(policy, cfg, task_table=TASKS, device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, metrics = [], {}
    for i in range(args.repeats + (1 if args.warmup else 0)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        metrics = actor.update(shard)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i > 0 or not args.warmup:
            times.append(time.perf_counter() - start)
    actor.publish_weights()
    result = {
        "rank": rank, "world": world, "seconds": sum(times) / len(times),
        "decisions": float(metrics["actor/decisions"]), "peak_rss_mib": resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss / 1024, "params": n_params, "trainable": n_trainable,
        "torch_peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "grad_norm": float(metrics["actor/grad_norm"]), "fsdp": actor.use_fsdp,
    }
    with open(f"{out_path}.{rank}", "w") as handle:
        json.dump(result, handle)
    if fsdp.is_distributed():
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, args, batch_path: str, tmp: str) -> list[dict]:
    out = os.path.join(tmp, f"world{world}.json")
    mp.spawn(rank_main, args=(world, free_port(), args, batch_path, out), nprocs=world, join=True)
    return [json.load(open(f"{out}.{r}")) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--algorithm", choices=["ppo", "grpo"], default="ppo")
    parser.add_argument("--trajectories", type=int, default=8, help="N rows of the batch (global batch)")
    parser.add_argument("--decisions", type=int, default=4, help="T decisions per trajectory")
    parser.add_argument("--epochs", type=int, default=1, help="algorithm.update_epochs")
    parser.add_argument("--micro-batch", type=int, default=2, help="actor.micro_batch_size (trajectories per rank)")
    parser.add_argument("--repeats", type=int, default=2, help="timed updates after the warm-up")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of all settings (best kept)")
    parser.add_argument("--worlds", default="1,2", help="actor process counts to compare")
    parser.add_argument("--threads-per-rank", type=int, default=1,
                        help="torch threads per rank (0: this machine's cores divided by the ranks)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--force-fsdp", action="store_true", help="FSDP2 also with one process")
    parser.add_argument("--param-dtype", default=None, help="actor.fsdp.param_dtype (e.g. bfloat16)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.trajectories % max(worlds) or (args.trajectories // max(worlds)) < 1:
        parser.error("--trajectories must split evenly over the largest world size")

    cfg = compose_cfg(args)
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_update_") as tmp:
        batch_path = os.path.join(tmp, "batch.pt")
        torch.save(make_batch(cfg, args, "cuda" if args.device == "cuda" else "cpu"), batch_path)
        # settings alternate round by round so that load changes on a shared machine hit all of them;
        # each setting keeps its fastest round
        results: dict[int, list[dict]] = {}
        for _ in range(args.rounds):
            for w in worlds:
                ranks = run_world(w, args, batch_path, tmp)
                if w not in results or max(r["seconds"] for r in ranks) < max(r["seconds"] for r in results[w]):
                    results[w] = ranks

    first = results[worlds[0]][0]
    print(f"actor benchmark: {args.preset} OpenVLA-OFT ({first['params'] / 1e6:.1f}M parameters, "
          f"{first['trainable'] / 1e3:.1f}k trainable), {args.algorithm}, N={args.trajectories} trajectories x "
          f"T={args.decisions} decisions, {args.epochs} epoch(s), micro-batch {args.micro_batch}, "
          f"{args.device} ({os.cpu_count()} cores, {args.threads_per_rank or 'cores/ranks'} thread(s) per rank), "
          f"best of {args.rounds} round(s) x {args.repeats} update(s), "
          f"torch {torch.__version__}")
    print(f"{'setup':<18}{'decisions/s':>13}{'s/update':>10}{'peak RSS/rank':>16}{'peak RSS sum':>15}"
          f"{'torch peak/rank':>17}")
    summary = {}
    for w in worlds:
        ranks = results[w]
        seconds = max(r["seconds"] for r in ranks)
        decisions = ranks[0]["decisions"]  # actor/decisions is already global
        rss = max(r["peak_rss_mib"] for r in ranks)
        torch_peak = ranks[0]["torch_peak_mib"]
        summary[w] = (decisions / seconds, rss)
        label = "1 process" if w == 1 and not ranks[0]["fsdp"] else f"{w} FSDP2 process{'es' if w > 1 else ''}"
        peak = f"{torch_peak:,.0f} MiB" if torch_peak is not None else "-"
        print(f"{label:<18}{decisions / seconds:>13.2f}{seconds:>10.2f}{rss:>12,.0f} MiB"
              f"{sum(r['peak_rss_mib'] for r in ranks):>11,.0f} MiB{peak:>17}")
    if len(worlds) > 1:
        base = worlds[0]
        for w in worlds[1:]:
            print(f"ratio {w} vs {base}: decisions/s x{summary[w][0] / summary[base][0]:.2f}, "
                  f"peak RSS per rank x{summary[w][1] / summary[base][1]:.2f}")


if __name__ == "__main__":
    main()
