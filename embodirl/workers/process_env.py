"""What a worker process needs from its driver's environment, and what it tells about itself.

Ray starts worker processes from the raylet, so environment variables the driver sets after
``ray.init`` (the shared-memory run id, LIBERO's asset path, renderers) do not reach them.
The driver captures them with :func:`forwarded` and every worker adopts them with :func:`adopt` first
thing in its constructor, then calls :func:`embodirl.runtime.configure` before any simulator import.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from embodirl.channel import segments

# exact names, and prefixes of names, worth carrying to worker processes
_FORWARD_NAMES = ("MUJOCO_GL", "PYOPENGL_PLATFORM", "VK_ICD_FILENAMES", "LD_LIBRARY_PATH", "TOKENIZERS_PARALLELISM",
                  "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "OMP_NUM_THREADS")
_FORWARD_PREFIXES = ("EMBODIRL_",)


def forwarded() -> dict[str, str]:
    """The driver's variables to hand to workers (includes the shared-memory run id)."""
    segments.run_id()   # make sure the run has an id before it is captured
    return {k: v for k, v in os.environ.items() if k in _FORWARD_NAMES or k.startswith(_FORWARD_PREFIXES)}


def adopt(variables: Mapping[str, str] | None) -> None:
    """Set the driver's variables in this worker process, then configure the simulator runtime."""
    for key, value in (variables or {}).items():
        if key == segments.RUN_ENV or key not in os.environ:
            os.environ[key] = value
    from embodirl import runtime

    runtime.configure()


def describe() -> dict:
    """pid, host, (under Ray) node id and (with CUDA) the current GPU's uuid of this process."""
    info = {"pid": os.getpid(), "host": socket.gethostname(), "node_id": None, "gpu_uuid": None}
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        info["gpu_uuid"] = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    ray = sys.modules.get("ray")      # a Ray worker has imported it; the in-process path need not (~1 s of CPU)
    try:
        if ray is not None and ray.is_initialized():
            info["node_id"] = ray.get_runtime_context().get_node_id()
    except Exception:
        pass
    return info
