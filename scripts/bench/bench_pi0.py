"""Benchmark the π0 policy (embodirl/models/pi0/): decisions per second of ``policy.act`` and FLOPs per decision.

    .venv/bin/python scripts/bench/bench_pi0.py [--preset pi0_tiny] [--device cpu] [--batches 1 8] [--rounds 5]
    python scripts/bench/bench_pi0.py --preset pi0 --device cuda --batches 1 8 32 64      # full size on a GPU

Random weights in the preset's dtype (bfloat16 for ``pi0``), a LIBERO-like observation (two 256 px cameras, an 8-D
state, one instruction). For each batch: the median time of a sampled ``act`` (Flow-SDE, or ``--method flow_noise``)
and of a greedy one, decisions/s, the FLOPs of one decision (``torch.utils.flop_counter``) and, on a GPU, the
fraction of the bf16 peak and the peak memory. ``--compile`` compiles the transformer blocks first
(``rollout.compile``). Prints one JSON document (and writes it to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from embodirl.config import compose
from embodirl.envs.base import EnvSpec
from embodirl.models.base import SamplingParams
from embodirl.models.registry import make_policy, model_config

LIBERO_LIKE = EnvSpec(action_dim=7, max_episode_steps=520, task_descriptions=["put the bowl on the plate"],
                      camera_names=["agentview", "wrist"], image_size=(256, 256), state_dim=8, name="libero_10")
INSTRUCTION = "put both the alphabet soup and the tomato sauce in the basket"
#: dense bf16 tensor-core peaks (NVIDIA's data sheets), TFLOP/s, by device-name fragment (as scripts/gpu_check.py)
BF16_PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "L4": 121.0}


def observation(batch: int) -> dict:
    h, w = LIBERO_LIKE.image_size
    return {"images": torch.randint(0, 256, (batch, 2, 3, h, w), dtype=torch.uint8),
            "state": torch.randn(batch, LIBERO_LIKE.state_dim), "instruction": [INSTRUCTION] * batch}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def flops_per_decision(policy, batch: int) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        policy.act(observation(batch), SamplingParams(), return_value=True)
    return counter.get_total_flops() / batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="pi0_tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="override the preset's dtype")
    parser.add_argument("--method", default="flow_sde", choices=["flow_sde", "flow_noise"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="compile the transformer blocks (rollout.compile)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    overrides = [f"model={args.preset}", f"model.flow.method={args.method}", f"model.device={args.device}"]
    if args.dtype:
        overrides.append(f"model.dtype={args.dtype}")
    model = model_config(compose(overrides).model)
    torch.manual_seed(0)
    start = time.perf_counter()
    policy = make_policy(model, LIBERO_LIKE).eval()
    sync(device)
    report: dict = {"preset": args.preset, "device": str(device), "dtype": model.dtype, "method": args.method,
                    "build_s": time.perf_counter() - start,
                    "parameters": sum(p.numel() for p in policy.parameters()),
                    "trainable": sum(p.numel() for p in policy.parameters() if p.requires_grad),
                    "denoising_steps": policy.num_steps, "chunk": [policy.chunk_size, policy.max_action_dim]}
    if device.type == "cuda":
        name = torch.cuda.get_device_properties(device).name
        report["gpu"] = name
        peak = os.environ.get("GPU_BF16_PEAK_TFLOPS")
        report["bf16_peak_tflops"] = float(peak) if peak else next(
            (v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
    if args.compile:
        report["compiled_blocks"] = policy.compile_blocks_()
    rows = []
    for batch in args.batches:
        obs = observation(batch)

        def sampled_act(obs=obs):
            policy.act(obs, SamplingParams(), return_value=True)

        def greedy_act(obs=obs):
            policy.act(obs, SamplingParams(greedy=True))

        first = timed(sampled_act, device)
        greedy_act()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sampled = [timed(sampled_act, device) for _ in range(args.rounds)]
        greedy = [timed(greedy_act, device) for _ in range(args.rounds)]
        t = statistics.median(sampled)
        row = {"batch": batch, "decisions_per_s": batch / t, "ms_per_call": 1e3 * t,
               "greedy_decisions_per_s": batch / statistics.median(greedy), "first_call_s": first}
        if not args.compile:            # the flop counter runs the eager graph; count once, uncompiled
            row["flops_per_decision"] = flops_per_decision(policy, batch)
            if report.get("bf16_peak_tflops"):
                row["fraction_of_bf16_peak"] = row["flops_per_decision"] * row["decisions_per_s"] / (
                    report["bf16_peak_tflops"] * 1e12)
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        rows.append(row)
        print(json.dumps(row), flush=True)
    report["act"] = rows
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
