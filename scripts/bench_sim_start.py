"""Benchmark the start of ManiSkill simulator processes on lavapipe with SAPIEN's BRDF table at 128 texels
(``.deps/vulkan/brdf_lut.so``, the default) against SAPIEN's own 512 (``EMBODIRL_BRDF_LUT=full``), side by side:
each round builds a ProcessVectorEnv of ``--num-envs`` simulators in a fresh Python, once each way in turn, and
resets it (the first frame renders). Prints wall seconds and the CPU seconds of that Python and its simulator
processes, per round, their medians and the ratio full/small.

    .venv/bin/python scripts/bench_sim_start.py --env maniskill_pushcube_rgb --num-envs 4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import psutil
from embodirl import runtime
runtime.configure()
from embodirl.config import compose
from embodirl.envs.registry import make_env
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
env.close()
print("RESULT " + json.dumps({"wall_s": wall, "cpu_s": cpu}))
"""


def once(env: str, num_envs: int, overrides: list[str], table: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, env, str(num_envs), *overrides], capture_output=True,
                          text=True, env={**os.environ, "EMBODIRL_BRDF_LUT": table})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="maniskill_pushcube_rgb")
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("overrides", nargs="*", default=["env.train.image_size=[64,64]"],
                   help="Hydra overrides of the env config (default: env.train.image_size=[64,64])")
    a = p.parse_args()
    rows = {"small": [], "full": []}
    for r in range(a.rounds):
        for table in ("small", "full"):
            res = once(a.env, a.num_envs, a.overrides, table)
            rows[table].append(res)
            print(f"round {r + 1} {table:5s}: wall {res['wall_s']:6.1f} s, cpu {res['cpu_s']:6.1f} s", flush=True)
    for key in ("wall_s", "cpu_s"):
        small = statistics.median(x[key] for x in rows["small"])
        full = statistics.median(x[key] for x in rows["full"])
        pairs = [f[key] / s[key] for f, s in zip(rows["full"], rows["small"])]
        print(f"{key}: median small {small:.1f}, full {full:.1f}, full/small {full / small:.2f} "
              f"(per round {', '.join(f'{x:.2f}' for x in pairs)})")


if __name__ == "__main__":
    main()
