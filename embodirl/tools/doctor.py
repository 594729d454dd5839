"""``embodirl doctor [overrides]``: the set-up checks for one composed config, each with its fix.

Every check returns a :class:`Check` row (name, pass/fail, what was found, the one-line fix). The rows:

==================  ============================================================================  ======
check               what it looks at                                                              fast
==================  ============================================================================  ======
config              the cross-field rules of :func:`embodirl.config.validate`                     -
render/mujoco       LIBERO's renderer (EGL on a GPU, or OSMesa in software) and an offscreen context   yes
render/vulkan       the Vulkan device SAPIEN renders with (name, software or GPU), ManiSkill envs  yes
assets/<env>        LIBERO's asset folder complete for the suite's tasks and its config file        -
                    written (no prompt); ManiSkill's task data (the download command)
heldout             training's init states apart from the evaluation's (LIBERO's official ones,      -
                    ManiSkill's seeds from 0), or the same on purpose (:mod:`embodirl.runner.heldout`)
dependencies        installed versions against the lock ``constraints.txt``                        -
checkpoint          ``model.path``: files, heads and image count vs the model config, RL-ready     -
                    (the policy family's ``describe_checkpoint``, e.g. OpenVLA-OFT's autoconfig)
memory              parameters, gradients, optimizer state, activations and rollout copies per     yes
                    device against the memory found (an estimate: :mod:`embodirl.tools.memory_plan`)
video               the ffmpeg writer (imageio-ffmpeg) when the run writes videos                  yes
ray                 the cluster's nodes and devices against ``cluster.component_placement``        -
==================  ============================================================================  ======

``embodirl train`` / ``eval`` run the fast ones (:func:`preflight`) after the config checks and before any
worker starts: a machine that cannot render or hold the model stops at once with one sentence. A row can also pass
with a warning (``WARN``): a machine with GPUs whose simulators would render in software.
Rendering is probed in a child process, so a driver that crashes or hangs cannot take the caller with it.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from embodirl.errors import AssetsMissing, ConfigError
from embodirl.schema import run_config
from embodirl.tools.memory_plan import GIB, available_memory, memory_plan, model_size

PROBE_TIMEOUT_S = 120
#: Vulkan device names of CPU (software) renderers
SOFTWARE_VULKAN = ("llvmpipe", "lavapipe", "swiftshader")
#: LIBERO fixtures that are part of every arena, not files in the asset folder
LIBERO_ARENA_FIXTURES = {"floor", "kitchen_table", "study_table", "table", "main_table", "coffee_table",
                         "living_room_table"}
LIBERO_ASSET_ENTRIES = ("articulated_objects", "scenes", "stable_hope_objects", "stable_scanned_objects",
                        "textures", "turbosquid_objects", "serving_region.xml", "wall.xml", "wall_frames.stl")
#: the fraction of a device's free memory an estimate may take (allocator fragmentation, CUDA context)
USABLE_FRACTION = 0.9
LOCK = "constraints.txt"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warn: bool = False        # passes, but the fix is worth making (e.g. software rendering beside GPUs)


# --------------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------------
def _adapters(cfg) -> set[str]:
    return {str(cfg.env.train.adapter), str(cfg.env.eval.adapter)}


def _probe(code: str) -> tuple[bool, str]:
    """Run ``code`` in a child Python (after :func:`embodirl.runtime.configure`); (ok, last output line)."""
    script = "import embodirl.runtime as r; r.configure()\n" + code
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return False, f"no answer within {PROBE_TIMEOUT_S} s"
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return proc.returncode == 0, (lines[-1] if lines else f"exit status {proc.returncode}")


def machine_gpus() -> int:
    """NVIDIA GPUs on this machine, whatever this process may use."""
    from embodirl.runtime import nvidia_gpus

    return len(nvidia_gpus({}))


def check_mujoco(gpus_on_machine: int | None = None) -> Check:
    """The renderer LIBERO's simulators use (:func:`embodirl.runtime.choose_mujoco_gl`; under Ray each env worker chooses
    for the GPU it is placed on) and an offscreen context made with it in a child process. Software rendering on a
    machine with GPUs passes with a warning."""
    from embodirl.runtime import choose_mujoco_gl

    gl, device, why = choose_mujoco_gl()
    name = {"egl": f"EGL on GPU {device}" if device is not None else "EGL", "osmesa": "OSMesa"}.get(gl, gl)
    ok, out = _probe("import mujoco; c = mujoco.GLContext(64, 64); c.make_current(); c.free(); print('ok')")
    if not ok:
        other = "osmesa" if gl == "egl" else "egl"
        return Check("render/mujoco", False, f"MUJOCO_GL={gl} ({name}; {why}): {out}",
                     f"run scripts/setup.sh (installs EGL and OSMesa), or set MUJOCO_GL={other}")
    gpus = machine_gpus() if gpus_on_machine is None else gpus_on_machine
    detail = f"LIBERO renders with {name} (MUJOCO_GL={gl}; {why}); offscreen context made"
    if gl != "egl" and gpus:
        return Check("render/mujoco", True, f"{detail}; this machine has {gpus} GPU(s) but LIBERO would render in "
                                            "software", "install NVIDIA's EGL library (libegl-nvidia0) and leave "
                                            "MUJOCO_GL unset: each env worker then renders on its GPU", warn=True)
    return Check("render/mujoco", True, detail)


def check_vulkan(gpus_on_machine: int | None = None) -> Check:
    ok, out = _probe("import sapien; s = sapien.render.get_device_summary(); "
                     "print(next(l for l in s.splitlines() if l.startswith('GPU:'))[4:].strip())")
    if not ok:
        return Check("render/vulkan", False, f"SAPIEN found no Vulkan device ({out})",
                     "run scripts/setup.sh (bundles lavapipe in .deps/vulkan), or install your GPU's Vulkan driver "
                     "and set EMBODIRL_VULKAN=system")
    kind = "software" if any(s in out.lower() for s in SOFTWARE_VULKAN) else "GPU"
    if kind == "GPU":
        return Check("render/vulkan", True, f"ManiSkill renders with {out} ({kind})")
    detail = f"ManiSkill renders with {out} ({kind}); {brdf_table()}"
    gpus = machine_gpus() if gpus_on_machine is None else gpus_on_machine
    if gpus:
        return Check("render/vulkan", True, f"{detail}; this machine has {gpus} GPU(s) but ManiSkill would render "
                                            "in software", "set EMBODIRL_VULKAN=system to render with the GPU's Vulkan "
                                            "driver (NVIDIA's ICD installed)", warn=True)
    return Check("render/vulkan", True, detail)


def brdf_table() -> str:
    """Which BRDF table SAPIEN builds on a software device (embodirl/envs/maniskill/brdf_lut.c)."""
    from embodirl.runtime import brdf_lut_library, local_vulkan_dir

    lib = brdf_lut_library(local_vulkan_dir())
    if lib is not None:
        return f"BRDF table 128 ({lib})"
    if os.environ.get("EMBODIRL_BRDF_LUT", "small") == "full":
        return "BRDF table 512 (EMBODIRL_BRDF_LUT=full)"
    return ("BRDF table 512: ~13 CPU-s more per ManiSkill simulator process "
            "(scripts/setup.sh builds .deps/vulkan/brdf_lut.so where a C compiler is installed)")


# --------------------------------------------------------------------------------------------------
# assets
# --------------------------------------------------------------------------------------------------
def libero_assets_problem(env) -> str | None:
    """None when the asset folder holds what the env split's tasks place, else what is missing (``env``: the typed
    LIBERO env split)."""
    from embodirl.envs.libero import paths as libero_paths
    from embodirl.envs.libero import suite as libero_suite

    assets = libero_paths.resolve_assets_dir(env.assets_path)
    missing = [e for e in LIBERO_ASSET_ENTRIES if not (assets / e).exists()]
    if missing:
        return f"{assets} lacks {', '.join(missing)}"
    names = {p.stem for p in assets.rglob("*")}
    info = libero_suite.suite_info(env)
    absent: set[str] = set()
    for task in libero_suite.task_pool(env):
        absent |= libero_suite.placed_types(info.bddl_files[task]) - names - LIBERO_ARENA_FIXTURES
    if absent:
        return f"{assets} has no asset for {', '.join(sorted(absent))} (placed by {env.suite}'s tasks)"
    if not (libero_paths.config_path() / "config.yaml").is_file():
        return f"LIBERO's config file {libero_paths.config_path() / 'config.yaml'} is missing (LIBERO would prompt)"
    return None


def check_assets(cfg, env_key: str) -> Check:
    """``env_key``'s simulator data (``cfg``: the typed config, or a composed one: its env split is converted)."""
    from embodirl.envs.registry import check_env_config, env_config

    name = f"assets/{env_key.split('.')[-1]}"
    try:
        env = env_config(cfg.env.train if env_key == "env.train" else cfg.env.eval, env_key)
        adapter = env.adapter
        check_env_config(env, env_key)
        if adapter == "libero":
            problem = libero_assets_problem(env)
            if problem is not None:
                return Check(name, False, problem, "run scripts/setup.sh (it installs LIBERO's original assets), or "
                                                   "point EMBODIRL_LIBERO_ASSETS (or env.assets_path) at a complete "
                                                   "LIBERO asset folder")
            return Check(name, True, f"LIBERO {env.suite}: asset folder complete, config file written")
    except AssetsMissing as exc:
        found, _, fix = str(exc).partition("; ")        # AssetsMissing: what is missing; the command or setting
        return Check(name, False, found, fix.rstrip(".") or "see the message")
    except ConfigError as exc:
        return Check(name, False, str(exc), "change the key named in the message")
    return Check(name, True, f"ManiSkill {env.task}: task data present" if adapter == "maniskill"
                 else f"{adapter}: none needed")


def check_heldout(cfg) -> Check:
    """Whether training starts from states the evaluation runs (``cfg``: typed or composed)."""
    from embodirl.runner.evaluation import eval_env_cfg
    from embodirl.runner.heldout import check_states

    result = check_states(cfg, eval_env_cfg(cfg))
    detail = result.detail if result.ok else f"{result.key}: {result.detail}"
    return Check("heldout", result.ok, detail, result.fix)


# --------------------------------------------------------------------------------------------------
# dependencies
# --------------------------------------------------------------------------------------------------
def lock_path() -> Path:
    from embodirl.paths import source_root

    root = source_root() or Path.cwd()
    return root / LOCK


def read_lock(path: Path) -> dict[str, str]:
    """``constraints.txt`` as {canonical name: pinned version} (``name==version`` lines, ``#`` comments)."""
    from packaging.utils import canonicalize_name

    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        name, _, pinned = line.partition("==")
        if pinned:
            pins[canonicalize_name(name)] = pinned.strip()
    return pins


def check_dependencies(path: Path | None = None) -> Check:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    path = path or lock_path()
    if not path.is_file():
        return Check("dependencies", False, f"no lock at {path}", "run doctor from a checkout with constraints.txt")
    pins, off = read_lock(path), []
    for name, pinned in sorted(pins.items()):
        try:
            installed = version(name)
        except PackageNotFoundError:
            off.append(f"{name} missing (locked {pinned})")
            continue
        if Version(Version(installed).public) != Version(Version(pinned).public):
            off.append(f"{name} {installed} (locked {pinned})")
    if off:
        shown = "; ".join(off[:4]) + (f"; and {len(off) - 4} more" if len(off) > 4 else "")
        return Check("dependencies", False, f"{len(off)} of {len(pins)} packages leave {path.name}: {shown}",
                     "run scripts/setup.sh (installs through constraints.txt)")
    return Check("dependencies", True, f"{len(pins)} packages at the versions of {path.name}")


# --------------------------------------------------------------------------------------------------
# checkpoint
# --------------------------------------------------------------------------------------------------
def check_checkpoint(cfg) -> Check:
    from embodirl.models.registry import get_policy_builder
    from embodirl.runner.checkpoint import eval_model_path

    cfg = run_config(cfg)
    path = eval_model_path(cfg.runner) or cfg.model.path
    if not path:
        return Check("checkpoint", True, "none: the model starts from a random init")
    builder = get_policy_builder(cfg.model.name)
    describe = getattr(builder, "describe_checkpoint", None)      # a family that reads its own layout
    try:
        if getattr(builder, "check_config", None) is not None:
            builder.check_config(cfg.model)
        if getattr(builder, "check_run", None) is not None:
            builder.check_run(cfg, str(path))
        detail = describe(str(path)) if describe is not None else f"{path}"
    except (ConfigError, AssetsMissing) as exc:
        return Check("checkpoint", False, str(exc).split("; ")[0], _fix_of(str(exc)))
    return Check("checkpoint", True, detail)


def _fix_of(message: str) -> str:
    """The fix part of a one-sentence error (after its last ``; ``), else the sentence."""
    return message.rsplit("; ", 1)[-1] if "; " in message else message


# --------------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------------
def check_memory(cfg, *, available: list[int] | None = None, accelerator: str | None = None) -> Check:
    """The estimate against each device's whole memory (what is free now is reported beside it: other
    programs' passing use should not make a set-up check fail)."""
    from embodirl.placement import detect_devices

    cfg = run_config(cfg)
    if accelerator is None:
        _, accelerator = detect_devices(1, cfg.cluster.num_gpus_per_node)
    size = model_size(cfg)
    plan = memory_plan(cfg, size, accelerator)
    free = available if available is not None else available_memory(accelerator, total=True)
    free_now = available_memory(accelerator) if available is None else free
    from embodirl.placement import data_parallel_size

    counts = {"actor": data_parallel_size(cfg) if accelerator == "cpu" else 1,
              "rollout": cfg.rollout.num_workers, "env": cfg.env_workers.num_workers}
    offload = cfg.actor.enable_offload
    if accelerator == "cpu":      # one host memory for every component (this node)
        needs = {c: plan[c] * counts[c] for c in plan}
        device, budget = "host memory", free[0]
    else:                         # the busiest GPU: one actor rank and the rollout copies placed beside it
        needs = {"actor": plan["actor"], "rollout": plan["rollout"] * max(1, counts["rollout"] // max(1, len(free))),
                 "env": 0}
        device, budget = "GPU", min(free) if free else 0
    need = max(needs["actor"], needs["rollout"] + needs["env"]) if offload else sum(needs.values())
    parts = ", ".join(f"{c} {needs[c] / GIB:.1f} GiB" for c in ("actor", "rollout", "env") if needs[c])
    detail = (f"{cfg.model.name} ({size.params / 1e6:.2f} M parameters, {size.trainable / 1e6:.2f} M trainable): "
              f"{parts}; {need / GIB:.1f} of {budget / GIB:.1f} GiB {device} ({min(free_now) / GIB:.1f} GiB free now)")
    if need <= USABLE_FRACTION * budget:
        return Check("memory", True, detail)
    alone = [c for c in needs if needs[c] > USABLE_FRACTION * budget]
    what = (f"{' and '.join(alone)} alone will not fit" if alone else
            f"{', '.join(c for c in needs if needs[c])} together will not fit")
    return Check("memory", False, f"{what}: {detail}",
                 "use a machine with more memory or GPUs, fewer simulators (env.train.num_envs), a smaller model "
                 "(model=openvla_oft_tiny), LoRA instead of "
                 "actor.fsdp.full_finetune, actor.enable_offload=true, or a smaller actor.micro_batch_size")


# --------------------------------------------------------------------------------------------------
# video
# --------------------------------------------------------------------------------------------------
def video_key(cfg) -> tuple[str, str] | None:
    """The key that makes this run write videos and the value that turns it off, or None."""
    cfg = run_config(cfg)
    r = cfg.runner
    evaluates = bool(r.only_eval or r.val_check_interval or r.val_before_train)
    if evaluates and r.eval_num_videos > 0:
        return "runner.eval_num_videos", "0"
    if not r.only_eval and r.train_video_interval > 0:
        return "runner.train_video_interval", "0"
    for k, env in (("train", cfg.env.train), ("eval", cfg.env.eval)):
        if env.video.enabled and (k == "eval" or not r.only_eval):
            return f"env.{k}.video.enabled", "false"
    return None


def check_video(cfg) -> Check:
    """Videos are written through imageio's ffmpeg plugin; without the ``imageio-ffmpeg`` package imageio picks
    another writer that fails on the first frame, at the first evaluation."""
    wanted = video_key(cfg)
    if wanted is None:
        return Check("video", True, "this run writes no video")
    key, off = wanted
    try:
        import imageio_ffmpeg

        exe = imageio_ffmpeg.get_ffmpeg_exe()
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return Check("video", False, f"{key} asks for videos but imageio's ffmpeg writer is missing ({reason})",
                     f"install imageio-ffmpeg (it is in constraints.txt), or set {key}={off}")
    return Check("video", True, f"ffmpeg writer: {exe}")


# --------------------------------------------------------------------------------------------------
# Ray
# --------------------------------------------------------------------------------------------------
def check_ray(cfg) -> Check:
    from embodirl.placement import parse_placement, use_ray

    cfg = run_config(cfg)
    if not use_ray(cfg):
        return Check("ray", True, "not used: this config runs in one process (simulators in sub-processes)")
    address = cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS")
    spec = cfg.cluster.component_placement
    if not address:
        from embodirl.placement import detect_devices

        n, acc = detect_devices(cfg.cluster.num_nodes, cfg.cluster.num_gpus_per_node)
        try:
            parse_placement(spec, n, acc)
        except ConfigError as exc:
            return Check("ray", False, str(exc), _fix_of(str(exc)))
        return Check("ray", True, f"a local Ray over this machine's {n} {acc.upper()} slot(s) holds the placement")
    import ray

    try:
        ray.init(address=address, ignore_reinit_error=True, logging_level=logging.ERROR, log_to_driver=False)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        resources = ray.cluster_resources()
    except Exception as exc:            # the run's own sentence: Ray's root reason (a refused token, no head) + the fix
        from embodirl.workers.ray_cluster import join_refused

        refused = str(join_refused(address, exc, configured=bool(cfg.cluster.ray_address)))
        return Check("ray", False, refused.rsplit("; ", 1)[0], _fix_of(refused))
    gpus = int(resources.get("GPU", 0))
    per_node = gpus // max(1, len(nodes)) if gpus else int(resources.get("CPU", 0)) // max(1, len(nodes))
    wanted = cfg.cluster.num_nodes
    if len(nodes) < wanted:
        return Check("ray", False, f"{len(nodes)} alive node(s) at {address}, cluster.num_nodes={wanted}",
                     f"start {wanted - len(nodes)} more node(s) with ray start --address, or lower cluster.num_nodes")
    try:
        parse_placement(spec, per_node * wanted, "gpu" if gpus else "cpu")
    except ConfigError as exc:
        return Check("ray", False, str(exc), _fix_of(str(exc)))
    return Check("ray", True, f"{len(nodes)} node(s), {gpus} GPU(s), {int(resources.get('CPU', 0))} CPU(s) at {address}")


# --------------------------------------------------------------------------------------------------
# the table and the entry points
# --------------------------------------------------------------------------------------------------
def _guarded(name: str, check: Callable[[], Check]) -> Check:
    """A check that raised is a failed row naming the error, not a traceback."""
    try:
        return check()
    except (ConfigError, AssetsMissing) as exc:
        return Check(name, False, str(exc), _fix_of(str(exc)))
    except Exception as exc:
        return Check(name, False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                     "see the message")


def fast_checks(cfg) -> list[Check]:
    """The checks ``embodirl train``/``eval`` run before workers start (``cfg``: the typed config, or a composed one)."""
    adapters = _adapters(cfg)
    rows = []
    if "libero" in adapters:
        rows.append(_guarded("render/mujoco", check_mujoco))
    if "maniskill" in adapters:
        rows.append(_guarded("render/vulkan", check_vulkan))
    rows.append(_guarded("memory", lambda: check_memory(cfg)))
    rows.append(_guarded("video", lambda: check_video(cfg)))
    return rows


def all_checks(cfg: DictConfig) -> list[Check]:
    from embodirl.config import validate

    def config() -> Check:
        validate(cfg, check_envs=False)
        return Check("config", True, "every cross-field rule holds")

    rows = [_guarded("config", config)]
    rows += fast_checks(cfg)
    env_keys = ["env.train"] if cfg.env.train == cfg.env.eval else ["env.train", "env.eval"]
    rows += [_guarded(f"assets/{k.split('.')[-1]}", functools.partial(check_assets, cfg, k)) for k in env_keys]
    rows.append(_guarded("heldout", lambda: check_heldout(cfg)))
    rows.append(_guarded("dependencies", check_dependencies))
    rows.append(_guarded("checkpoint", lambda: check_checkpoint(cfg)))
    rows.append(_guarded("ray", lambda: check_ray(cfg)))
    order = ["config", "render/mujoco", "render/vulkan", "assets/train", "assets/eval", "heldout", "dependencies",
             "checkpoint", "memory", "video", "ray"]
    return sorted(rows, key=lambda r: order.index(r.name) if r.name in order else len(order))


def format_table(rows: list[Check]) -> str:
    """One line per check (``check  PASS|FAIL  what was found``), each failure followed by its ``fix:`` line."""
    width = max(len(r.name) for r in rows)
    lines = [f"{'check':<{width}}  status  found", f"{'-' * width}  ------  {'-' * 40}"]
    for r in rows:
        status = "FAIL" if not r.ok else "WARN" if r.warn else "PASS"
        lines.append(f"{r.name:<{width}}  {status:<6}  {r.detail}")
        if not r.ok or r.warn:
            lines.append(f"{'':<{width}}  {'':<6}  fix: {r.fix}")
    return "\n".join(lines)


class PreflightFailed(RuntimeError):
    """A fast check failed before workers start; the message is one sentence with the fix."""


def preflight(cfg) -> None:
    """The fast checks for ``embodirl train``/``eval``: raise :class:`PreflightFailed` on the first failure."""
    for row in fast_checks(cfg):
        if not row.ok:
            raise PreflightFailed(f"{row.name}: {row.detail.rstrip('.')}; fix: {row.fix}")
        if row.warn:
            print(f"embodirl: warning: {row.name}: {row.detail}; fix: {row.fix}", file=sys.stderr)


def main(overrides: list[str]) -> int:
    """``embodirl doctor [overrides]``: print the table; 0 when every check passes, 1 otherwise."""
    from embodirl.config import compose

    cfg = compose(overrides)
    rows = all_checks(cfg)
    print(format_table(rows))
    try:                                   # the plan of a config that passes the config row
        from embodirl import schema
        from embodirl.tools.run_plan import plan_lines

        print("\n" + "\n".join(plan_lines(schema.check(cfg))))
    except ConfigError:
        pass
    failed = [r.name for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} checks pass" + (f"; failing: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
