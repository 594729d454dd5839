"""Process-level set-up for simulators, done once before any of them is imported.

* MuJoCo renders offscreen through EGL (``MUJOCO_GL=egl``) unless the user chose otherwise
  (``osmesa`` also works; it is slower).
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
from pathlib import Path

from embodirl.paths import deps_dir

log = logging.getLogger(__name__)
_DONE = False
#: when the ``embodirl`` command's process started (epoch seconds; set by the command-line entry point),
#: the zero of the minutes a run prints; None when the library is used from another program
command_started: float | None = None


def local_vulkan_dir() -> Path | None:
    path = deps_dir() / "vulkan"
    return path if (path / "icd.json").is_file() else None


def configure() -> None:
    """Idempotent; call before importing mujoco/robosuite/sapien."""
    global _DONE
    if _DONE:
        return
    _DONE = True
    os.environ.setdefault("MUJOCO_GL", "egl")
    if os.environ["MUJOCO_GL"] in ("egl", "osmesa"):
        os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
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
