"""Process-level set-up for simulators, done once before any of them is imported.

* MuJoCo renders offscreen through EGL (``MUJOCO_GL=egl``) unless the user chose otherwise
  (``osmesa`` also works; it is slower).
* SAPIEN/ManiSkill needs a Vulkan device even for state observations. On machines without a GPU the
  set-up script unpacks Mesa 25's lavapipe (software Vulkan) into ``.deps/vulkan``; here we point the
  Vulkan loader at it (``VK_ICD_FILENAMES``) and load its newer ``libdrm`` by absolute path so that
  the driver's dependency resolves to it even though ``LD_LIBRARY_PATH`` is read only at process
  start (child processes inherit the exported variables and so get it at their start).
  A machine with an NVIDIA Vulkan driver keeps its own ICD: set ``EMBODIRL_VULKAN=system``.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

from embodirl.paths import deps_dir

log = logging.getLogger(__name__)
_DONE = False


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
        import torch  # noqa: PLC0415

        cuda = torch.cuda.is_available()
    if cuda:
        return None
    cores = os.cpu_count() or 1
    return 1 if cores <= 4 else min(8, cores // 2)


def set_torch_threads(setting) -> None:
    """Apply :func:`torch_threads` to this process."""
    import torch  # noqa: PLC0415

    n = torch_threads(setting)
    if n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)
        log.info("torch intra-op threads: %d", n)


def rng_state() -> dict:
    """This process's python, numpy and torch RNG states (CPU; CUDA when present)."""
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
