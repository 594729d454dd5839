#!/usr/bin/env python
"""Benchmark of the worker layer; every ratio comes from measurements taken side by side in one run.

1. channel   - observation batches of 16 envs x two 224x224 RGB cameras (4.8 MB) from a producer
               actor (env worker) to a consumer actor (inference worker), which reads each in place:
                 stream: the shared-memory ring as a queue (send/recv), no Ray message per batch -
                         how env workers reach an inference worker on their node;
                 ref:    the ring's reference as the argument of one Ray call per batch (shown for
                         comparison: Ray's per-call cost alone);
                 ray:    the batch as the argument of one Ray call (Ray's object store) - the path
                         between nodes.
               Target: stream >= 3x the throughput of ray.
2. pipeline  - one env worker and one inference worker (Ray actors) collecting the same N envs for T
               decisions with rollout.pipeline_stage_num S = 1 and S = 2. Env and policy costs are made
               comparable two ways:
                 real:  the toy simulator rendering at a calibrated image size (CPU) and the tiny
                        OpenVLA-OFT preset (CPU, one thread) - both compete for this machine's cores;
                 sleep: fixed per-env latencies in the simulator and the policy (a simulator on its own
                        cores and a GPU policy), which isolates the pipeline's overlap from core contention.
               Env-only and policy-only times are the summed env-step and inference times of the S = 1
               run. Targets: S=2 >= 1.6x faster than S=1, and S=2 within 1.15x of max(env-only,
               policy-only).
   records   - (how results travel back) a LIBERO-sized trajectory (8 envs x 65 decisions x two 256x256
               cameras) returned by an env worker to the driver: the TensorDict itself vs the packed
               numpy form the worker groups use.
3. cleanup   - a training-like run (Ray, env + inference workers, shared-memory rings) killed with SIGKILL
               and with Ctrl-C (SIGINT) mid-rollout: counts the run's entries left in /dev/shm.

Usage: python scripts/bench/bench_workers.py [--part all|channel|pipeline|cleanup] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout (scripts/bench/..)
sys.path.insert(0, ROOT)

from embodirl import runtime  # noqa: E402

runtime.configure()

import ray  # noqa: E402
import torch  # noqa: E402

from embodirl.channel import segments  # noqa: E402
from embodirl.channel.shm_channel import ShmChannel, ShmReader, ShmRef  # noqa: E402

CHANNEL_ENVS, CHANNEL_CAMERAS, CHANNEL_SIZE = 16, 2, 224


# --------------------------------------------------------------------------------------------------
# 1. channel
# --------------------------------------------------------------------------------------------------
class Consumer:
    """An inference worker's side of the transport: read the batch (zero-copy), touch it, release it."""

    def __init__(self):
        self.reader = ShmReader()

    @staticmethod
    def _touch(obs) -> int:
        # every path hands over read-only numpy views (ring slot / object-store buffer): read in place
        return int(obs["images"][:, :, 0, ::16, ::16].sum()) + int(obs["task_id"].sum())

    def consume(self, payload) -> int:
        if not isinstance(payload, ShmRef):
            return self._touch(payload)
        try:
            return self._touch(self.reader.read(payload))
        finally:
            self.reader.release(payload)

    def drain(self, info, n: int) -> float:
        """Receive ``n`` streamed batches; returns the wall-clock time of the last one."""
        for _ in range(n):
            ref, _ = self.reader.recv(info, timeout=120)
            try:
                self._touch(self.reader.read(ref))
            finally:
                self.reader.release(ref)
        return time.time()


class Producer:
    """An env worker's side: a fresh batch per decision, at most ``in_flight`` batches pending."""

    def __init__(self, process_vars, in_flight: int):
        os.environ.update(process_vars)
        rng = np.random.default_rng(0)
        B, V, S = CHANNEL_ENVS, CHANNEL_CAMERAS, CHANNEL_SIZE
        self.batches = [{"images": rng.integers(0, 256, size=(B, V, 3, S, S), dtype=np.uint8),   # (B, V, C, h, w)
                         "state": rng.standard_normal((B, 8)).astype(np.float32),               # (B, S)
                         "task_id": np.arange(B, dtype=np.int64)} for _ in range(2)]
        self.channel = ShmChannel(self.batches[0], num_slots=in_flight, tag="bench")
        self.in_flight = in_flight

    def info(self):
        return self.channel.info

    def stream(self, n: int) -> float:
        """Send ``n`` batches through the ring (the ring's free slots bound those in flight); returns
        the wall-clock start time."""
        t0 = time.time()
        for i in range(n):
            self.channel.send(self.batches[i % 2], timeout=120)
        return t0

    def call(self, consumer, mode: str, n: int) -> float:
        """One Ray call per batch carrying a ring reference (``ref``) or the batch itself (``ray``)."""
        pending = []
        t0 = time.perf_counter()
        for i in range(n):
            batch = self.batches[i % 2]
            pending.append(consumer.consume.remote(self.channel.put(batch) if mode == "ref" else batch))
            if len(pending) >= self.in_flight:
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done)
        ray.get(pending)
        return time.perf_counter() - t0

    def close(self):
        self.channel.close()


def bench_channel(n: int, in_flight: int, repeats: int) -> dict:
    from embodirl.workers import process_env

    producer = ray.remote(Producer).options(num_cpus=0.5).remote(process_env.forwarded(), in_flight)
    consumer = ray.remote(Consumer).options(num_cpus=0.5).remote()
    info = ray.get(producer.info.remote())
    nbytes = CHANNEL_ENVS * CHANNEL_CAMERAS * 3 * CHANNEL_SIZE * CHANNEL_SIZE

    def run(mode: str, count: int) -> float:
        if mode == "stream":
            end = consumer.drain.remote(info, count)
            start = ray.get(producer.stream.remote(count))
            return ray.get(end) - start
        return ray.get(producer.call.remote(consumer, mode, count))

    modes = ("stream", "ref", "ray")
    for mode in modes:                                                # warm-up
        run(mode, 10)
    times = {mode: [] for mode in modes}
    for _ in range(repeats):                                          # interleaved: same machine load
        for mode in modes:
            times[mode].append(run(mode, n))
    ray.get(producer.close.remote())
    for actor in (producer, consumer):
        ray.kill(actor)
    best = {mode: min(ts) for mode, ts in times.items()}
    out = {"batch_mb": nbytes / 1e6, "n": n}
    for mode, t in best.items():
        out[f"{mode}_batches_per_s"] = n / t
        out[f"{mode}_gb_per_s"] = n * nbytes / t / 1e9
    out["ratio"] = best["ray"] / best["stream"]
    return out


class TrajectoryHolder:
    """An env worker at the end of a rollout: returns its trajectory either way."""

    def __init__(self, N: int, T: int, size: int):
        from embodirl import data as D

        rng = np.random.default_rng(0)
        fields = {D.IMAGES: torch.from_numpy(rng.integers(0, 256, (N, T, 2, 3, size, size), dtype=np.uint8)),
                  D.REWARD: torch.zeros(N, T), D.ACTION_CHUNK: torch.zeros(N, T, 8, 7),
                  D.ACTION_TOKENS: torch.zeros(N, T, 56, dtype=torch.int64),
                  D.TERMINATED: torch.zeros(N, T, dtype=torch.bool),
                  D.TRUNCATED: torch.zeros(N, T, dtype=torch.bool), D.VALID: torch.ones(N, T, dtype=torch.bool),
                  D.TASK_ID: torch.zeros(N, dtype=torch.int64)}
        self.traj = D.make_trajectory(fields)

    def tensordict(self):
        return self.traj

    def packed(self):
        from embodirl.workers.transport import pack_trajectory

        return pack_trajectory(self.traj)


def bench_records(repeats: int) -> dict:
    from embodirl.workers.transport import unpack_trajectory

    N, T, size = 8, 65, 256
    holder = ray.remote(TrajectoryHolder).options(num_cpus=0.5).remote(N, T, size)
    ray.get(holder.packed.remote())
    times = {"tensordict": [], "packed": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        ray.get(holder.tensordict.remote())
        times["tensordict"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        unpack_trajectory(ray.get(holder.packed.remote()))      # includes the copy out of the object store
        times["packed"].append(time.perf_counter() - t0)
    ray.kill(holder)
    best = {k: min(v) for k, v in times.items()}
    return {"mb": N * T * 2 * 3 * size * size / 1e6, **best, "ratio": best["tensordict"] / best["packed"]}


# --------------------------------------------------------------------------------------------------
# 2. pipeline
# --------------------------------------------------------------------------------------------------
def _sleepy_sim_cls():
    from embodirl.envs.toy import ToySimEnv

    class SleepyToySimEnv(ToySimEnv):
        """The toy simulator plus a fixed latency per chunk (a simulator running on its own core)."""

        def __init__(self, cfg, seed=0, latency_s=0.0):
            super().__init__(cfg, seed)
            self.latency_s = latency_s

        def step_chunk(self, actions, render_all=False):
            time.sleep(self.latency_s)
            return super().step_chunk(actions, render_all)

    return SleepyToySimEnv


def sleepy_env_builder(latency_s: float):
    def build(env_cfg, *, num_envs, seed, env_offset=0):
        from embodirl.envs.vector.vector_env import ProcessVectorEnv

        cls = _sleepy_sim_cls()
        factories = [functools.partial(cls, env_cfg, seed=seed + env_offset + i, latency_s=latency_s)
                     for i in range(num_envs)]
        return ProcessVectorEnv.from_config(factories, env_cfg, env_offset=env_offset, processes=False)
    return build


def sleepy_policy(model_cfg, spec, latency_per_env_s: float):
    """The state policy plus a latency growing with the batch (a policy served by a GPU)."""
    from embodirl.models.base import Policy
    from embodirl.models.registry import make_policy

    class SleepyPolicy(Policy):
        def __init__(self, inner, latency):
            super().__init__()
            self.inner, self.latency = inner, latency
            self.action_chunk, self.action_dim = inner.action_chunk, inner.action_dim
            self.action_field, self.value_type = inner.action_field, inner.value_type

        def act(self, obs, sampling, *, return_value=False):
            time.sleep(self.latency * len(obs["task_id"]))
            return self.inner.act(obs, sampling, return_value=return_value)

        def score_actions(self, obs, actions, **kwargs):
            return self.inner.score_actions(obs, actions, **kwargs)

    return SleepyPolicy(make_policy(model_cfg, spec), latency_per_env_s)


def _collect_with_stages(cfg, S: int, N: int, T: int, *, env_builder=None, policy=None, rounds: int = 2):
    from omegaconf import OmegaConf

    from embodirl.workers import process_env
    from embodirl.workers.env_group import EnvWorkerGroup
    from embodirl.workers.inference_group import InferenceGroup
    from embodirl.workers.inference_worker import sampling_from_config
    from embodirl.workers.layout import SlotLayout

    layout = SlotLayout(num_env_workers=1, num_stages=S, envs_per_stage=N // S, num_inference_workers=1,
                           num_decisions=T)
    env_cfg = OmegaConf.to_container(cfg.env.train, resolve=True)
    # fractional CPUs: both actors fit a 2-core Ray; the OS, not Ray, shares the cores
    env_group = EnvWorkerGroup(env_cfg, layout, remote=True, return_value=False, use_shm=True,
                               process_vars=process_env.forwarded(), env_builder=env_builder)
    inference_group = InferenceGroup(cfg.model, env_group.spec, num_workers=1, engine="huggingface",
                                       sampling=sampling_from_config(cfg.rollout), remote=True,
                                       process_vars=process_env.forwarded(), policy=policy)
    env_group.attach(inference_group)
    try:
        env_group.collect()                      # warm-up (first-call costs, allocations)
        best = None
        for _ in range(rounds):
            t0 = time.perf_counter()
            env_group.collect()
            wall = time.perf_counter() - t0
            stats = ray.get(env_group.workers[0].last_stats.remote())
            if best is None or wall < best[0]:
                best = (wall, stats)
        return best
    finally:
        env_group.close()
        inference_group.close()


def bench_pipeline(load: str, N: int, T: int, rounds: int, latency_s: float = 0.010) -> dict:
    from embodirl.config import compose
    from embodirl.envs.registry import make_env
    from embodirl.models.registry import make_policy

    # Every episode runs exactly T decisions (no early success): both runs do the same env work.
    if load == "real":
        size = calibrate_image_size(N)
        model, H = "openvla_oft_tiny", 8
        overrides = [f"env.train.image_size=[{size},{size}]"]
        note = f"toy simulator rendering {size}x{size} (CPU) + OpenVLA-OFT tiny (CPU, 1 thread)"
    else:
        model, H = "state_mlp", 4
        overrides = ["env.train.state_obs=true"]
        note = f"{latency_s * 1e3:.0f} ms per env per chunk in the simulator and in the policy"
    cfg = compose(["env=toy_reach", f"model={model}", "env.train.ignore_terminations=true",
                   f"env.train.max_episode_steps={T * H}", *overrides])
    spec = make_env(cfg.env.train, num_envs=1, seed=0).spec
    if load == "real":   # the same weights in both runs
        kwargs = dict(policy=make_policy(cfg.model, spec))
    else:
        kwargs = dict(env_builder=sleepy_env_builder(latency_s), policy=sleepy_policy(cfg.model, spec, latency_s))
    results = {}
    for S in (1, 2):
        wall, stats = _collect_with_stages(cfg, S, N, T, rounds=rounds, **kwargs)
        results[S] = {"wall": wall, "env": stats.env_s, "infer": stats.infer_s, "wait": stats.wait_s}
    one, two = results[1], results[2]
    bound = max(one["env"], one["infer"])
    return {"note": note, "N": N, "T": T, "s1": one, "s2": two, "speedup": one["wall"] / two["wall"],
            "vs_bound": two["wall"] / bound, "bound": bound}


def _spin(seconds_of_work: int) -> float:
    a = np.random.default_rng(0).random((300, 300, 3))
    t0 = time.perf_counter()
    for _ in range(seconds_of_work):
        (a * 1.1 + 0.5).sum()
    return time.perf_counter() - t0


def cpu_overlap_ceiling(work: int = 1500) -> float:
    """How much faster two CPU-bound processes finish side by side than one after the other on this
    machine right now: the most that overlapping a CPU-bound env with a CPU-bound policy can give."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(2) as pool:
        pool.map(_spin, [10, 10])
        t0 = time.perf_counter()
        pool.map(_spin, [work])
        pool.map(_spin, [work])
        sequential = time.perf_counter() - t0
        t0 = time.perf_counter()
        pool.map(_spin, [work, work])
        parallel = time.perf_counter() - t0
    return sequential / parallel


def calibrate_image_size(N: int, rounds: int = 3) -> int:
    """Image size at which stepping N toy envs costs about as much as the tiny VLA deciding for them
    (both on one thread; rendering cost grows with the pixel count, refined over a few rounds)."""
    from embodirl.config import compose
    from embodirl.envs.registry import make_env
    from embodirl.models.base import SamplingParams
    from embodirl.models.registry import make_policy
    from embodirl.rollout.inference import act

    def timed(fn, repeats):
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    size = 128
    try:
        for _ in range(rounds):
            cfg = compose(["env=toy_reach", "model=openvla_oft_tiny", f"env.train.image_size=[{size},{size}]"])
            env = make_env(cfg.env.train, num_envs=N, seed=0)
            obs, _ = env.reset(seed=0)
            policy = make_policy(cfg.model, env.spec)
            zeros = np.zeros((N, int(cfg.model.action_chunk), env.spec.action_dim), np.float32)
            policy_s = timed(lambda: act(policy, obs, env.spec.task_descriptions, SamplingParams()), 3)  # noqa: B023 (called here)
            env_s = timed(lambda: env.step(zeros), 5)  # noqa: B023 (called here)
            env.close()
            size = int(min(max(size * math.sqrt(policy_s / max(env_s, 1e-6)), 32), 1024))
    finally:
        torch.set_num_threads(threads)
    return size


# --------------------------------------------------------------------------------------------------
# 3. cleanup
# --------------------------------------------------------------------------------------------------
_RUN = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from embodirl.config import compose
    from embodirl.workers.groups import WorkerGroups
    cfg = compose(["env=toy_reach", "model=state_mlp", "env.train.state_obs=true", "env.train.num_envs=8",
                   "actor.global_batch_size=8", "env_workers.num_workers=2", "rollout.pipeline_stage_num=2",
                   "env.train.max_episode_steps=100000"])
    groups = WorkerGroups.from_config(cfg, remote=True)
    print("ready", flush=True)
    while True:
        groups.collect()
""")


def bench_cleanup(sig: signal.Signals) -> dict:
    import psutil

    run = "bench" + os.urandom(3).hex()
    before = set(os.listdir(segments.SHM_DIR))
    env = dict(os.environ, EMBODIRL_SHM_RUN=run)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-c", _RUN.format(root=ROOT)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    prefix = segments.run_prefix(run)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the run did not start")
        deadline = time.monotonic() + 120
        while len(segments.listing(prefix)) < 6 and time.monotonic() < deadline:   # two rings + their FIFOs
            time.sleep(0.05)
        during = len(segments.listing(prefix))
        family = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(proc.pid, sig)
        proc.wait(60)
        deadline = time.monotonic() + 30
        while segments.listing(prefix) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = segments.listing(prefix)
        other_new = sorted(set(os.listdir(segments.SHM_DIR)) - before - set(left))
    finally:
        if proc.poll() is None:
            proc.kill()
        # Ray's own daemons of the killed run are not the subject here: end them
        for pid in locals().get("family", []):
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        segments.sweep(prefix)
    return {"signal": sig.name, "during": during, "left": left, "other_new": other_new}


# --------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="all", choices=["all", "channel", "pipeline", "cleanup"])
    parser.add_argument("--quick", action="store_true", help="fewer batches and decisions")
    parser.add_argument("--load", default="both", choices=["both", "real", "sleep"], help="pipeline cost model")
    parser.add_argument("--latency-ms", type=float, default=10.0,
                        help="sleep model: latency per env per chunk in the simulator and in the policy")
    args = parser.parse_args()
    quick = args.quick

    if args.part in ("all", "channel", "pipeline"):
        from embodirl.workers.ray_cluster import init_ray

        init_ray({}, num_cpus=os.cpu_count() or 1)
    if args.part in ("all", "channel"):
        r = bench_channel(n=60 if quick else 200, in_flight=4, repeats=2 if quick else 3)
        print(f"channel: {CHANNEL_ENVS} envs x {CHANNEL_CAMERAS} cameras x 3x{CHANNEL_SIZE}x{CHANNEL_SIZE} uint8 "
              f"({r['batch_mb']:.1f} MB per batch), {r['n']} batches, 4 in flight")
        rate = {m: f"{r[m + '_batches_per_s']:8.1f} batches/s  ({r[m + '_gb_per_s']:.2f} GB/s)"
                for m in ("stream", "ref", "ray")}
        print(f"  shared-memory stream        : {rate['stream']}")
        print(f"  ring reference per Ray call : {rate['ref']}")
        print(f"  Ray object store per call   : {rate['ray']}")
        print(f"  ratio stream / object store : {r['ratio']:.2f}x   (target >= 3)")
        r = bench_records(repeats=2 if quick else 4)
        print(f"records: a {r['mb']:.0f} MB trajectory from an env worker to the driver: "
              f"TensorDict {r['tensordict']:.3f}s, packed numpy {r['packed']:.3f}s ({r['ratio']:.1f}x)")
    if args.part in ("all", "pipeline"):
        loads = ["real", "sleep"] if args.load == "both" else [args.load]
        for load in loads:
            r = bench_pipeline(load, N=8, T=12 if quick else 30, rounds=1 if quick else 2,
                               latency_s=args.latency_ms / 1e3)
            s1, s2 = r["s1"], r["s2"]
            print(f"pipeline ({load}): {r['note']}; N={r['N']} envs, T={r['T']} decisions, "
                  "1 env worker + 1 inference worker")
            print(f"  S=1: {s1['wall']:.2f}s  (env-only {s1['env']:.2f}s, policy-only {s1['infer']:.2f}s)")
            print(f"  S=2: {s2['wall']:.2f}s  (env {s2['env']:.2f}s, policy {s2['infer']:.2f}s, "
                  f"waiting {s2['wait']:.2f}s)")
            print(f"  speed-up S=2 vs S=1          : {r['speedup']:.2f}x  (target >= 1.6)")
            print(f"  S=2 / max(env-only, policy) : {r['vs_bound']:.2f}   (target <= 1.15)")
            if load == "real":
                print(f"  (two CPU-bound processes side by side finish {cpu_overlap_ceiling():.2f}x faster than "
                      "one after the other on this machine now: the ceiling for overlapping CPU-bound env and policy)")
    if args.part in ("all", "channel", "pipeline"):
        ray.shutdown()
    if args.part in ("all", "cleanup"):
        for sig in (signal.SIGKILL, signal.SIGINT):
            r = bench_cleanup(sig)
            print(f"cleanup ({'Ctrl-C' if sig == signal.SIGINT else 'SIGKILL'} mid-rollout): {r['during']} run entries "
                  f"in /dev/shm during the run, {len(r['left'])} left after it ({r['left'] or 'none'}); "
                  f"other new /dev/shm entries: {r['other_new'] or 'none'}")


if __name__ == "__main__":
    main()
