"""Benchmark the batched env layer: ProcessVectorEnv with one sub-process per simulator vs the same
simulators stepped in-process, and the cost of recording video (rendering every step), measured side
by side in one run. Prints low-level steps per second and the ratios.

    .venv/bin/python scripts/bench/bench_vector_env.py --env libero_spatial --num-envs 4
    .venv/bin/python scripts/bench/bench_vector_env.py --env toy_reach --num-envs 16 --chunks 50

Extra Hydra overrides for the env config go after ``--``:
``... --env libero_spatial -- env.train.image_size=[128,128]``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from omegaconf import OmegaConf

from embodirl import runtime


def measure(cfg: dict, *, num_envs: int, chunks: int, chunk_len: int, processes: bool, record: bool) -> dict:
    """Build, reset and step ``chunks`` random chunks; returns timings (build excluded from steps/s)."""
    from embodirl.envs.registry import get_adapter
    from embodirl.envs.vector.vector_env import ProcessVectorEnv

    adapter = get_adapter(cfg["adapter"])
    cfg = dict(cfg, video=dict(cfg["video"], enabled=record, env_ids=list(range(num_envs))))
    if cfg["adapter"] == "toy":
        cfg["processes"] = processes
    start = time.perf_counter()
    venv = adapter.make(cfg, num_envs=num_envs, seed=0)
    if isinstance(venv, ProcessVectorEnv) and venv.processes != processes:
        # adapters choose processes themselves; rebuild with the requested mode from their factories
        factories = venv.env_fns
        venv.close()
        venv = ProcessVectorEnv.from_config(factories, cfg, processes=processes)
    built = time.perf_counter() - start
    rng = np.random.default_rng(0)
    low = np.asarray(venv.spec.action_low, np.float32)
    high = np.asarray(venv.spec.action_high, np.float32)
    try:
        venv.reset(seed=0)
        steps = 0
        start = time.perf_counter()
        for _ in range(chunks):
            actions = rng.uniform(low, high, (num_envs, chunk_len, venv.spec.action_dim)).astype(np.float32)
            _, _, terminated, truncated, info = venv.step(actions * 0.3)
            steps += int(info["steps"].sum())
            done = np.flatnonzero(terminated | truncated)
            if len(done):
                venv.reset(env_ids=done)
        elapsed = time.perf_counter() - start
    finally:
        venv.close()
    return dict(build_s=built, step_s=elapsed, steps=steps, steps_per_s=steps / elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="toy_reach", help="env config option (config/env/<name>.yaml)")
    parser.add_argument("--num-envs", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--chunk-len", type=int, default=8)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the composed config")
    args = parser.parse_args()
    runtime.configure()
    from embodirl.config import compose

    cfg = OmegaConf.to_container(compose([f"env={args.env}", *args.overrides]).env.train, resolve=True)
    cfg["auto_reset"] = False
    print(f"{args.env}: {args.num_envs} envs, {args.chunks} chunks of {args.chunk_len} steps, "
          f"{os.cpu_count()} CPUs")
    rows = {}
    for name, processes, record in (("in-process", False, False), ("sub-processes", True, False),
                                    ("sub-processes + video", True, True)):
        rows[name] = measure(cfg, num_envs=args.num_envs, chunks=args.chunks, chunk_len=args.chunk_len,
                             processes=processes, record=record)
        r = rows[name]
        print(f"  {name:24s} build {r['build_s']:7.2f} s   {r['steps']:6d} steps in {r['step_s']:7.2f} s   "
              f"{r['steps_per_s']:9.1f} steps/s")
    base = rows["in-process"]["steps_per_s"]
    print(f"  speed-up of sub-processes over in-process: {rows['sub-processes']['steps_per_s'] / base:.2f}x")
    video_cost = rows["sub-processes"]["steps_per_s"] / rows["sub-processes + video"]["steps_per_s"]
    print(f"  video recording (every step rendered) costs {video_cost:.2f}x time per step")


if __name__ == "__main__":
    main()
