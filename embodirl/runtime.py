"""Process-level set-up for simulators, done once before any of them is imported.

* MuJoCo (LIBERO) renders offscreen through EGL on the NVIDIA GPU this process may use (the first of
  ``CUDA_VISIBLE_DEVICES``, which Ray sets to the GPU an env worker is placed on; all GPUs without it), and through
  OSMesa where it sees none (:func:`choose_mujoco_gl`). On a machine without a GPU both are Mesa's llvmpipe: the
  same images bit for bit. A ``MUJOCO_GL`` the user set is kept; one embodirl chose is chosen again in each process
  (``EMBODIRL_MUJOCO_GL_CHOSEN`` marks it), since a worker's GPU is not its driver's.
* SAPIEN/ManiSkill needs a Vulkan device even for state observations. On machines without a GPU the
  set-up script unpacks Mesa 25's lavapipe (software Vulkan) into ``.deps/vulkan``; here we point the
  Vulkan loader at it (``VK_ICD_FILENAMES``) and load its newer ``libdrm`` by absolute path so that
  the driver's dependency resolves to it even though ``LD_LIBRARY_PATH`` is read only at process
  start (child processes inherit the exported variables and so get it at their start).
  A machine with an NVIDIA Vulkan driver keeps its own ICD: set ``EMBODIRL_VULKAN=system``.
* With that lavapipe, ``.deps/vulkan/brdf_lut.so`` (built by the set-up script from
  ``embodirl/envs/maniskill/brdf_lut.c``) is loaded into the global symbol scope before SAPIEN is, so that
  SAPIEN's renderer builds its BRDF table at 128 texels a side instead of 512: ~13 CPU-s less per simulator
  process, the same frames for the shipped tasks (the C file says why). ``EMBODIRL_BRDF_LUT=full`` keeps
  SAPIEN's own table.
"""

from __future__ import annotations

import base64
import ctypes
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from embodirl.paths import deps_dir

log = logging.getLogger(__name__)
_DONE = False
#: when the ``embodirl`` command's process started (epoch seconds; set by the command-line entry point),
#: the zero of the minutes a run prints; None when the library is used from another program
command_started: float | None = None


#: set beside ``MUJOCO_GL`` when :func:`configure` chose it (a child process then chooses again)
GL_CHOSEN_VAR = "EMBODIRL_MUJOCO_GL_CHOSEN"
EGL_DEVICE_CHOSEN_VAR = "EMBODIRL_MUJOCO_EGL_DEVICE_CHOSEN"
#: where the NVIDIA kernel driver lists its GPUs, and where NVIDIA's EGL library registers with libglvnd
NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")
NVIDIA_EGL_VENDOR = (Path("/usr/share/glvnd/egl_vendor.d/10_nvidia.json"), Path("/etc/glvnd/egl_vendor.d/10_nvidia.json"))


def nvidia_gpus(environ: Mapping[str, str] | None = None, gpus_dir: Path = NVIDIA_GPUS_DIR) -> list[int]:
    """Ids of the NVIDIA GPUs this process may use (without importing torch): the driver's GPUs, narrowed by
    ``CUDA_VISIBLE_DEVICES`` (Ray sets it to a worker's GPUs, and to nothing for a worker without one)."""
    environ = os.environ if environ is None else environ
    try:
        count = len(list(gpus_dir.iterdir()))
    except OSError:
        return []
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    ids = []
    for item in visible.split(","):
        item = item.strip()
        if item.isdigit() and int(item) < count:
            ids.append(int(item))
        elif item:                       # a UUID or MIG name: the device exists, its EGL index is unknown
            ids.append(len(ids))
    return ids


def choose_mujoco_gl(environ: Mapping[str, str] | None = None, gpus: list[int] | None = None,
                     nvidia_egl: bool | None = None) -> tuple[str, int | None, str]:
    """``(MUJOCO_GL, EGL device or None, why)`` for this process: the user's ``MUJOCO_GL``; else ``egl`` on the first
    NVIDIA GPU it may use when NVIDIA's EGL library is installed; else ``osmesa`` (software rendering)."""
    environ = os.environ if environ is None else environ
    chosen = environ.get("MUJOCO_GL")
    if chosen and environ.get(GL_CHOSEN_VAR) != chosen:
        return chosen, None, "MUJOCO_GL set by the user"
    gpus = nvidia_gpus(environ) if gpus is None else gpus
    if nvidia_egl is None:
        nvidia_egl = any(p.is_file() for p in NVIDIA_EGL_VENDOR)
    if gpus and nvidia_egl:
        return "egl", gpus[0], f"GPU {gpus[0]}"
    if gpus:
        return "osmesa", None, f"software: GPU {gpus[0]} is visible but NVIDIA's EGL library is not installed"
    return "osmesa", None, "software: no GPU visible to this process"


def local_vulkan_dir() -> Path | None:
    path = deps_dir() / "vulkan"
    return path if (path / "icd.json").is_file() else None


def configure() -> None:
    """Idempotent; call before importing mujoco/robosuite/sapien."""
    global _DONE
    if _DONE:
        return
    _DONE = True
    gl, device, _ = choose_mujoco_gl()
    if os.environ.get("MUJOCO_GL") != gl or os.environ.get(GL_CHOSEN_VAR) == gl:   # embodirl's choice, not the user's
        os.environ["MUJOCO_GL"] = os.environ[GL_CHOSEN_VAR] = gl
        # the EGL device: ours to set or clear unless the user set it (robosuite refuses one outside
        # CUDA_VISIBLE_DEVICES, so a device a parent process chose must not linger)
        ours = os.environ.get("MUJOCO_EGL_DEVICE_ID") in (None, os.environ.get(EGL_DEVICE_CHOSEN_VAR))
        if ours and device is not None:
            os.environ["MUJOCO_EGL_DEVICE_ID"] = os.environ[EGL_DEVICE_CHOSEN_VAR] = str(device)
        elif ours:
            os.environ.pop("MUJOCO_EGL_DEVICE_ID", None)
            os.environ.pop(EGL_DEVICE_CHOSEN_VAR, None)
        if gl in ("egl", "osmesa"):
            os.environ["PYOPENGL_PLATFORM"] = gl
    elif gl in ("egl", "osmesa"):
        os.environ.setdefault("PYOPENGL_PLATFORM", gl)
    if os.environ.get("EMBODIRL_VULKAN", "local") == "system":
        return
    vk = local_vulkan_dir()
    if vk is None:
        return
    os.environ.setdefault("VK_ICD_FILENAMES", str(vk / "icd.json"))
    libdir = vk / "root" / "usr" / "lib" / "x86_64-linux-gnu"
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if str(libdir) not in paths:
        os.environ["LD_LIBRARY_PATH"] = ":".join([str(libdir), *paths])
    for name in ("libdrm.so.2", "libdrm_amdgpu.so.1"):
        lib = libdir / name
        if lib.exists():
            try:
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:  # the system one may already be loaded; lavapipe then may fail
                log.warning("could not preload %s: %s", lib, exc)
    load_brdf_lut(vk)


#: the library the set-up script builds beside lavapipe (embodirl/envs/maniskill/brdf_lut.c)
BRDF_LUT_LIBRARY = "brdf_lut.so"


def brdf_lut_library(vk: Path | None) -> Path | None:
    """``vk/brdf_lut.so`` when it is built and ``EMBODIRL_BRDF_LUT`` is not ``full``, else None (SAPIEN then
    builds its own 512-texel table: the same frames, ~13 CPU-s more per process)."""
    if vk is None or os.environ.get("EMBODIRL_BRDF_LUT", "small") == "full":
        return None
    lib = vk / BRDF_LUT_LIBRARY
    return lib if lib.is_file() else None


def load_brdf_lut(vk: Path) -> ctypes.CDLL | None:
    """Load :func:`brdf_lut_library` globally (before SAPIEN); None when there is none to load."""
    lib = brdf_lut_library(vk)
    if lib is None:
        return None
    try:
        return ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        log.warning("could not load %s (SAPIEN builds its full BRDF table instead): %s", lib, exc)
        return None


def torch_threads(setting, *, cuda: bool | None = None) -> int | None:
    """The number of intra-op threads torch should use in the driver for ``runner.torch_threads``.

    ``auto``: on a machine without CUDA, 1 thread on up to 4 cores, else half the cores (at most 8);
    ``None`` with CUDA (torch's own default). The simulators run in their own processes on the same
    cores, and torch's thread pool spin-waits: on 2 cores with busy simulators, a batch-8 MLP
    decision took 50 ms with 2 threads and 0.14 ms with 1 (measured). An int is used as given.
    """
    if setting not in (None, "auto"):
        return int(setting)
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cuda:
        return None
    cores = os.cpu_count() or 1
    return 1 if cores <= 4 else min(8, cores // 2)


def set_torch_threads(setting) -> None:
    """Apply :func:`torch_threads` to this process."""
    import torch

    n = torch_threads(setting)
    if n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)
        log.info("torch intra-op threads: %d", n)


def rng_state() -> dict:
    """This process's python, numpy and torch RNG states (CPU; CUDA when present):
    ``{"python": random.getstate(), "numpy": np.random.get_state(), "torch": uint8 tensor,
    "cuda": [uint8 tensor per device]}``."""
    import random

    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state` (the CUDA part only where CUDA is available)."""
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_state_to_json(state: dict) -> dict:
    """:func:`rng_state` as plain JSON values, so that a checkpoint holds no pickle (issue 11: a shared
    checkpoint must not run code on the machine that resumes it). Exact: :func:`rng_state_from_json`
    gives back states that draw the same numbers. Layout::

        python  {"version": int, "internal": [625 ints], "gauss_next": float | None}
        numpy   {"bit_generator": "MT19937", "keys": [624 uint32], "pos": int, "has_gauss": int,
                 "cached_gaussian": float}
        torch   base64 of the CPU generator's uint8 state bytes
        cuda    [base64 per device] (only when the state has it)
    """
    import numpy as np

    version, internal, gauss_next = state["python"]
    bit_generator, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    out = {"python": {"version": int(version), "internal": [int(x) for x in internal], "gauss_next": gauss_next},
           "numpy": {"bit_generator": str(bit_generator), "keys": np.asarray(keys, np.uint32).tolist(),
                     "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
           "torch": _bytes_to_text(state["torch"])}
    if "cuda" in state:
        out["cuda"] = [_bytes_to_text(t) for t in state["cuda"]]
    return out


def rng_state_from_json(d: dict) -> dict:
    """Inverse of :func:`rng_state_to_json`: a state :func:`set_rng_state` takes."""
    import numpy as np

    python, numpy_state = d["python"], d["numpy"]
    gauss_next = python["gauss_next"]
    state = {"python": (int(python["version"]), tuple(int(x) for x in python["internal"]),
                        None if gauss_next is None else float(gauss_next)),
             "numpy": (str(numpy_state["bit_generator"]), np.asarray(numpy_state["keys"], np.uint32),
                       int(numpy_state["pos"]), int(numpy_state["has_gauss"]), float(numpy_state["cached_gaussian"])),
             "torch": _bytes_from_text(d["torch"])}
    if "cuda" in d:
        state["cuda"] = [_bytes_from_text(t) for t in d["cuda"]]
    return state


def _bytes_to_text(tensor) -> str:
    """A uint8 generator-state tensor as base64 text."""
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _bytes_from_text(text: str):
    import numpy as np
    import torch

    return torch.from_numpy(np.frombuffer(base64.b64decode(text), np.uint8).copy())   # (n,) uint8
