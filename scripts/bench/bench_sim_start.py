"""Benchmark the start of ManiSkill simulator processes side by side, two ways in turn, each round in a fresh Python
that builds a ProcessVectorEnv of ``--num-envs`` simulators and resets it (the first frame renders). Prints wall
seconds, the CPU seconds of that Python and its simulator processes, and the simulators' private memory (USS,
summed), per round, their medians and the ratios.

``--compare brdf`` (default): SAPIEN's BRDF table at 128 texels on lavapipe (``.deps/vulkan/brdf_lut.so``, the
default) against SAPIEN's own 512 (``EMBODIRL_BRDF_LUT=full``). ``--compare frozen-heap``: the forkserver freezing
what it preloaded (``embodirl/envs/vector/frozen_heap.py``, the default) against not freezing it.

    .venv/bin/python scripts/bench/bench_sim_start.py --env maniskill_pushcube_rgb --num-envs 4 --rounds 3
    .venv/bin/python scripts/bench/bench_sim_start.py --compare frozen-heap --env maniskill_pushcube --num-envs 8 \
        env.train.num_envs=8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import psutil
from embodirl import runtime
runtime.configure()
from embodirl.config import compose
from embodirl.envs.registry import make_env
from embodirl.envs.vector import vector_env
if os.environ.get("BENCH_UNFROZEN") == "1":
    vector_env.FROZEN_HEAP = "gc"     # the forkserver imports gc last instead: nothing is frozen
env = make_env(compose([f"env={sys.argv[1]}", *sys.argv[3:]]).env.train, num_envs=int(sys.argv[2]), seed=0)
env.reset()
procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
cpu = 0.0
for p in procs:
    try:
        t = p.cpu_times()
        cpu += t.user + t.system
    except psutil.NoSuchProcess:
        pass
wall = time.perf_counter() - t0
me = psutil.Process()
sims = [p for p in me.children(recursive=True) if p.ppid() != me.pid]   # forked by the forkserver
uss = sum(p.memory_full_info().uss for p in sims) / 2**20
env.close()
print("RESULT " + json.dumps({"wall_s": wall, "cpu_s": cpu, "sims_uss_mib": uss}))
"""


#: the two ways of each comparison: (name, environment variables), the default first
WAYS = {"brdf": [("small", {"EMBODIRL_BRDF_LUT": "small"}), ("full", {"EMBODIRL_BRDF_LUT": "full"})],
        "frozen-heap": [("frozen", {"BENCH_UNFROZEN": "0"}), ("unfrozen", {"BENCH_UNFROZEN": "1"})]}


def once(env: str, num_envs: int, overrides: list[str], extra_env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, env, str(num_envs), *overrides], capture_output=True,
                          text=True, env={**os.environ, **extra_env})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", choices=sorted(WAYS), default="brdf")
    p.add_argument("--env", default="maniskill_pushcube_rgb")
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("overrides", nargs="*", default=["env.train.image_size=[64,64]"],
                   help="Hydra overrides of the env config (default: env.train.image_size=[64,64])")
    a = p.parse_args()
    ways = WAYS[a.compare]
    (first, _), (second, _) = ways
    rows: dict[str, list[dict]] = {name: [] for name, _ in ways}
    for r in range(a.rounds):
        for name, extra_env in ways:
            res = once(a.env, a.num_envs, a.overrides, extra_env)
            rows[name].append(res)
            print(f"round {r + 1} {name:8s}: wall {res['wall_s']:6.1f} s, cpu {res['cpu_s']:6.1f} s, "
                  f"simulators' private memory {res['sims_uss_mib']:7.0f} MiB", flush=True)
    for key in ("wall_s", "cpu_s", "sims_uss_mib"):
        a_med = statistics.median(x[key] for x in rows[first])
        b_med = statistics.median(x[key] for x in rows[second])
        pairs = [y[key] / x[key] for x, y in zip(rows[first], rows[second])]
        print(f"{key}: median {first} {a_med:.1f}, {second} {b_med:.1f}, {second}/{first} {b_med / a_med:.2f} "
              f"(per round {', '.join(f'{x:.2f}' for x in pairs)})")


if __name__ == "__main__":
    main()
