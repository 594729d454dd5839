"""Simulator benchmarks: every comparison is measured side by side in one run (the modes alternate
chunk by chunk, so load from other processes hits both alike) and printed as a table of rates and ratios.

Parts (``--parts``, comma-separated; default: all):

* ``render``    LIBERO-10 task, two cameras (128x128), chunks of 8 random actions: the adapter rendering
                at decisions only vs the adapter rendering every step (``render_all``) vs the stock LIBERO
                env stepped the way OpenVLA-OFT's evaluation does (cameras every step). Target >= 5x.
                Every mode must prove it rendered: its images change from one to the next and none is
                blank, else the part stops with an error (a stale GL context renders nothing, fast).
* ``reset``     LIBERO episode start: OFT's hard reset (rebuilds the MuJoCo model and renderer) +
                ``set_init_state`` + 10 settle steps with cameras, vs the adapter's cheap reset (soft
                reset, same init state, settle steps rendering once).
* ``processes`` ProcessVectorEnv with 2 sub-processes vs 1 (LIBERO-10, cameras off: CPU-bound physics).
                Target >= 1.7x on 2 free cores.
* ``maniskill`` ManiSkill PickCube-v1 env-steps/s with state and with rgb observations (one process each,
                through the registered adapter).
* ``assets``    LIBERO's original assets (installed from the registry) against another asset folder
                (``--standins``, e.g. the stand-ins of ``../shared/libero_assets`` earlier versions used): the
                scene build, physics-only steps/s (cameras off) and steps/s rendering two cameras at decisions, for
                ``--assets-task`` (default ``libero_spatial:0``, whose black bowl is a 180,960-vertex scan).

    .venv/bin/python scripts/bench/bench_envs.py                       # everything (a few minutes)
    .venv/bin/python scripts/bench/bench_envs.py --parts render,reset --chunks 40
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from embodirl import runtime

PARTS = ("render", "reset", "processes", "maniskill", "assets")
SETTLE_ACTION = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0]


def env_config(option: str, **overrides) -> dict:
    from embodirl.config import compose

    cfg = OmegaConf.to_container(compose([f"env={option}"]).env.train, resolve=True)
    cfg.update(overrides)
    return cfg


def random_chunk(rng: np.random.Generator, chunk_len: int, spec) -> np.ndarray:
    """Random actions ``[H, A]`` within the spec's bounds, arm motions scaled down to stay in the workspace."""
    low = np.broadcast_to(np.asarray(spec.action_low, np.float64), (spec.action_dim,))
    high = np.broadcast_to(np.asarray(spec.action_high, np.float64), (spec.action_dim,))
    chunk = rng.uniform(low, high, size=(chunk_len, spec.action_dim))
    chunk[:, :-1] *= 0.3
    return chunk


class RenderProof:
    """Evidence that a mode rendered: images seen, how many differ from the one before, how many are blank.
    A mode whose images never change did not render (a gated or stale camera returns the same buffer)."""

    def __init__(self):
        self.images = 0
        self.changed = 0
        self.blank = 0
        self._last: np.ndarray | None = None

    def see(self, image: np.ndarray) -> None:
        image = np.asarray(image)
        self.images += 1
        self.blank += int(image.std() < 1.0)
        self.changed += int(self._last is not None and not np.array_equal(image, self._last))
        self._last = image.copy()

    def check(self, mode: str) -> str:
        if self.images < 2 or self.changed < self.images - 1 - self.images // 10 or self.blank:
            raise RuntimeError(f"render benchmark: mode '{mode}' did not render: {self.images} images, "
                               f"{self.changed} changed from the previous one, {self.blank} blank")
        return f"{self.images} images, {self.changed} changed"


class Timer:
    """Accumulates wall seconds, this process's CPU seconds (all threads: llvmpipe renders with
    several) and steps of one mode."""

    def __init__(self):
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.steps = 0
        self.calls = 0

    def time(self, fn: Callable[[], int]) -> None:
        start, cpu_start = time.perf_counter(), time.process_time()
        steps = fn()
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.process_time() - cpu_start
        self.steps += steps
        self.calls += 1

    @property
    def cpu_rate(self) -> float:
        return self.steps / self.cpu_seconds

    @property
    def rate(self) -> float:
        return self.steps / self.seconds

    @property
    def per_call(self) -> float:
        return self.seconds / self.calls


# --------------------------------------------------------------------------------------------------
def bench_render(args, rows: list) -> None:
    from embodirl.envs.libero.simulator import LiberoSimEnv

    cfg = env_config("libero_10", image_size=[args.image_size] * 2, task_ids=[args.task])
    env = LiberoSimEnv(cfg, seed=0)
    from libero.libero.envs import OffScreenRenderEnv

    stock = OffScreenRenderEnv(bddl_file_name=str(env.suite.bddl_files[args.task]),
                               camera_heights=args.image_size, camera_widths=args.image_size)
    stock.env.ignore_done = True                     # robosuite's 1000-step horizon would raise
    rng = np.random.default_rng(0)
    modes = {"decisions": Timer(), "every_step": Timer(), "stock": Timer()}
    proofs = {name: RenderProof() for name in modes}
    try:
        # the stock env's hard reset frees the GL context it was built with, and freeing an EGL context
        # breaks the other contexts of the process (robosuite 1.4): reset it before the adapter builds its
        # scene, and make its context current before each of its steps (robosuite only does so at creation)
        stock.reset()
        stock.set_init_state(env.suite.init_states(args.task)[0])
        env.reset(args.task, 0)
        stock_context = stock.env.sim._render_context_offscreen.gl_ctx

        def ours(render_all: bool) -> Callable[[], int]:
            proof = proofs["every_step" if render_all else "decisions"]

            def run() -> int:
                if env.elapsed + args.chunk_len > env.max_episode_steps:
                    env.reset(args.task, 0)
                result = env.step_chunk(chunk, render_all=render_all)
                for frame in (result.frames if render_all else [result.obs["images"]]):   # (V, C, h, w) each
                    proof.see(frame)
                return result.steps
            return run

        def stock_chunk() -> int:
            stock_context.make_current()
            for action in chunk:
                raw, _, _, _ = stock.step(np.array(action, np.float64))     # LIBERO's own actions, as the adapter's
                proofs["stock"].see(np.stack([raw["agentview_image"], raw["robot0_eye_in_hand_image"]]))
            return len(chunk)

        for _ in range(args.chunks):
            chunk = random_chunk(rng, args.chunk_len, env.spec)
            modes["decisions"].time(ours(False))
            modes["every_step"].time(ours(True))
            modes["stock"].time(stock_chunk)
    finally:
        stock.close()
        env.close()
    evidence = {name: proofs[name].check(name) for name in modes}   # raises when a mode did not render
    fast, fast_cpu = modes["decisions"].rate, modes["decisions"].cpu_rate
    label = f"LIBERO-10 task {args.task}, 2 cams {args.image_size}px, chunk {args.chunk_len}"
    rows.append((f"{label}: render at decisions", f"{fast:8.1f} steps/s", f"{fast / args.chunk_len:6.2f} decisions/s",
                 f"({fast_cpu:.1f} steps per CPU-s; {evidence['decisions']})"))
    for name, title in (("every_step", "render every step (render_all)"), ("stock", "stock LIBERO loop (OFT)")):
        rate, cpu_rate = modes[name].rate, modes[name].cpu_rate
        rows.append((f"{label}: {title}", f"{rate:8.1f} steps/s", f"{rate / args.chunk_len:6.2f} decisions/s",
                     f"x{fast / rate:.2f} (target >= 5); per CPU-s x{fast_cpu / cpu_rate:.2f}; {evidence[name]}"))


def bench_reset(args, rows: list) -> None:
    from embodirl.envs.libero.simulator import LiberoSimEnv, scene_seed

    cfg = env_config("libero_10", image_size=[args.image_size] * 2, task_ids=[args.task])
    env = LiberoSimEnv(cfg, seed=0)
    from libero.libero.envs import OffScreenRenderEnv

    stock = OffScreenRenderEnv(bddl_file_name=str(env.suite.bddl_files[args.task]),
                               camera_heights=args.image_size, camera_widths=args.image_size)
    init_states = env.suite.init_states(args.task)
    modes = {"hard": Timer(), "cheap": Timer()}
    try:
        env.reset(args.task, 0)                         # build outside the timing

        def hard(k: int) -> Callable[[], int]:
            def run() -> int:
                np.random.seed(scene_seed(args.task, k))
                stock.reset()                           # hard reset: new MjModel/MjData and renderer
                stock.set_init_state(init_states[k])
                for _ in range(env.num_settle_steps):
                    stock.step(SETTLE_ACTION)
                return 1
            return run

        def cheap(k: int) -> Callable[[], int]:
            return lambda: (env.reset(args.task, k), 1)[1]

        for k in range(args.resets):
            modes["hard"].time(hard(k))
            modes["cheap"].time(cheap(k))
    finally:
        stock.close()
        env.close()
    hard_s, cheap_s = modes["hard"].per_call, modes["cheap"].per_call
    rows.append((f"LIBERO-10 episode start: hard reset (OFT) + init state + {env.num_settle_steps} settle steps",
                 f"{hard_s:8.3f} s", "", ""))
    rows.append(("LIBERO-10 episode start: cheap reset (adapter)", f"{cheap_s:8.3f} s", "",
                 f"x{hard_s / cheap_s:.1f} faster"))


def bench_processes(args, rows: list) -> None:
    import psutil

    from embodirl.envs.registry import make_env

    cfg = env_config("libero_10", cameras=[], task_ids=[args.task], auto_reset=True)
    venvs = {n: make_env(cfg, num_envs=n, seed=0) for n in (1, 2)}
    rng = np.random.default_rng(0)
    modes = {n: Timer() for n in venvs}
    cpu = {n: 0.0 for n in venvs}            # CPU seconds the simulator processes got while timed
    try:
        for venv in venvs.values():
            venv.reset()
        spec = venvs[1].spec
        procs = {n: [psutil.Process(pid) for pid in venvs[n].pids] for n in venvs}

        def cpu_seconds(n: int) -> float:
            return sum(p.cpu_times().user + p.cpu_times().system for p in procs[n])

        def step(n: int) -> Callable[[], int]:
            def run() -> int:
                actions = np.stack([random_chunk(rng, args.chunk_len, spec)
                                    for _ in range(n)]).astype(np.float32)            # (n, H, A)
                before = cpu_seconds(n)
                _, _, _, _, info = venvs[n].step(actions)
                cpu[n] += cpu_seconds(n) - before
                return int(info["steps"].sum())
            return run

        for _ in range(args.chunks):
            for n in venvs:
                modes[n].time(step(n))
    finally:
        for venv in venvs.values():
            venv.close()
    one, two = modes[1].rate, modes[2].rate
    for n, rate in ((1, one), (2, two)):
        # the simulators' CPU per step, and how many cores' worth they got: on a shared machine the
        # wall-clock ratio is bounded by the CPU the simulators were given
        share = cpu[n] / modes[n].seconds
        rows.append((f"ProcessVectorEnv LIBERO-10, cameras off: {n} sub-process{'es' if n > 1 else ''} "
                     f"({1000 * cpu[n] / modes[n].steps:.1f} CPU-ms/step, {share:.2f} cores busy)",
                     f"{rate:8.1f} steps/s", "", f"x{two / one:.2f} (target >= 1.7)" if n == 2 else ""))


def bench_maniskill(args, rows: list) -> None:
    from embodirl.envs.registry import make_env

    venvs = {}
    for obs_mode, option in (("state", "maniskill_pickcube"), ("rgb", "maniskill_pickcube_rgb")):
        cfg = env_config(option, sim_backend="physx_cpu", auto_reset=True)
        venvs[obs_mode] = make_env(cfg, num_envs=1, seed=0)
    rng = np.random.default_rng(0)
    modes = {name: Timer() for name in venvs}
    try:
        for venv in venvs.values():
            venv.reset()

        def step(name: str) -> Callable[[], int]:
            spec = venvs[name].spec

            def run() -> int:
                actions = random_chunk(rng, args.chunk_len, spec)[None]
                _, _, _, _, info = venvs[name].step(actions.astype(np.float32))
                return int(info["steps"].sum())
            return run

        for _ in range(args.chunks):
            for name in venvs:
                modes[name].time(step(name))
    finally:
        for venv in venvs.values():
            venv.close()
    for name, timer in modes.items():
        rows.append((f"ManiSkill PickCube-v1 ({name}), 1 process, chunk {args.chunk_len}",
                     f"{timer.rate:8.1f} steps/s", "", ""))


def bench_assets(args, rows: list) -> None:
    """Original assets against ``--standins``, the modes alternating chunk by chunk (module docstring). libero 0.1.1
    reads its asset folder from a module variable when a scene is built, so the four simulators are built one after
    another, each right after its config points LIBERO at its folder; stepping a built scene reads no file."""
    from embodirl.envs.libero import paths as libero_paths
    from embodirl.envs.libero.simulator import LiberoSimEnv

    if not args.standins or not (Path(args.standins) / "scenes").is_dir():
        raise SystemExit(f"assets part: --standins must name a LIBERO asset folder, got {args.standins!r}")
    suite, _, task = args.assets_task.partition(":")
    task = int(task or 0)
    folders = {"original": str(libero_paths.installed_assets_dir()), "stand-ins": str(Path(args.standins).resolve())}
    envs, build_s = {}, {}
    try:
        for name, folder in folders.items():
            for cams in (True, False):
                cfg = env_config(suite, assets_path=folder, task_ids=[task], image_size=[args.image_size] * 2,
                                 cameras=["agentview", "wrist"] if cams else [])
                start = time.perf_counter()
                env = envs[(name, cams)] = LiberoSimEnv(cfg, seed=0)
                env.reset(task, 0)
                build_s[(name, cams)] = time.perf_counter() - start
        rng = np.random.default_rng(0)
        modes = {key: Timer() for key in envs}

        def chunk_of(key) -> Callable[[], int]:
            env = envs[key]

            def run() -> int:
                if env.elapsed + args.chunk_len > env.max_episode_steps:
                    env.reset(task, 0)
                return env.step_chunk(chunk).steps
            return run

        for _ in range(args.chunks):
            chunk = random_chunk(rng, args.chunk_len, envs[("original", True)].spec)
            for key in envs:
                modes[key].time(chunk_of(key))
    finally:
        for env in envs.values():
            env.close()
    label = f"{suite} task {task}"
    for cams, what in ((False, "physics only (cameras off)"), (True, f"2 cams {args.image_size}px at decisions")):
        original, standin = modes[("original", cams)], modes[("stand-ins", cams)]
        rows.append((f"{label}, original assets: {what}", f"{original.rate:8.1f} steps/s",
                     f"{original.cpu_rate:8.1f} /CPU-s", f"x{original.rate / standin.rate:.2f} of the stand-ins' "
                     f"(per CPU-s x{original.cpu_rate / standin.cpu_rate:.2f})"))
        rows.append((f"{label}, stand-in assets: {what}", f"{standin.rate:8.1f} steps/s",
                     f"{standin.cpu_rate:8.1f} /CPU-s", ""))
    built, built_standin = build_s[("original", True)], build_s[("stand-ins", True)]
    rows.append((f"{label}: scene build + first reset, original / stand-ins", f"{built:8.2f} s",
                 f"{built_standin:8.2f} s", f"x{built / built_standin:.2f}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(p for p in PARTS if p != "assets"),
                        help=f"comma-separated subset of {', '.join(PARTS)} (assets needs --standins)")
    parser.add_argument("--chunks", type=int, default=25, help="chunks per mode")
    parser.add_argument("--chunk-len", type=int, default=8)
    parser.add_argument("--resets", type=int, default=4, help="episode starts per mode (reset part)")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--task", type=int, default=0, help="LIBERO-10 task id")
    parser.add_argument("--standins", default=None, help="assets part: the asset folder to compare the originals with")
    parser.add_argument("--assets-task", default="libero_spatial:0", help="assets part: suite:task")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    runtime.configure()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{os.cpu_count()} CPUs, load average {load:.1f} at start", flush=True)
    rows: list[tuple[str, str, str, str]] = []
    for part in parts:
        start = time.perf_counter()
        globals()[f"bench_{part}"](args, rows)
        print(f"[{part} done in {time.perf_counter() - start:.0f} s]", flush=True)
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'measurement':<{width}}  {'rate':>16}  {'':>18}  ratio")
    for name, rate, extra, ratio in rows:
        print(f"{name:<{width}}  {rate:>16}  {extra:>18}  {ratio}")
    if hasattr(os, "getloadavg"):
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f} (other processes share these cores)")


if __name__ == "__main__":
    main()
