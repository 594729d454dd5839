"""SAPIEN's BRDF table on lavapipe (``embodirl/envs/maniskill/brdf_lut.c``, loaded by ``runtime.configure``):
the set-up script built it, the simulator processes a run starts load it, SAPIEN's renderer builds its table
through it at 128 texels a side, and the frames a run sees (camera observations of an rgb task, the video
camera of a state task) are bit-identical to those with SAPIEN's own 512-texel table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from embodirl.runtime import BRDF_LUT_LIBRARY, local_vulkan_dir

pytestmark = pytest.mark.skipif(os.environ.get("EMBODIRL_VULKAN", "local") == "system",
                                reason="the machine's own Vulkan driver: SAPIEN's table is built by the GPU")

# One process per setting, as a run has: ManiSkill simulators in processes of ProcessVectorEnv (started by the
# forkserver whose preload configures the runtime), stepped with the same actions; the script prints the
# digests of every frame, which sub-processes mapped the library, and the in-process table's size.
SCRIPT = r"""
import hashlib, json, os, sys
import numpy as np
from embodirl import runtime
runtime.configure()
from embodirl.config import compose
from embodirl.envs.registry import make_env

def maps_library(pid):
    with open(f"/proc/{pid}/maps") as f:
        return runtime.BRDF_LUT_LIBRARY in f.read()

out = {"digests": {}, "mapped": []}
for name in ("maniskill_pushcube_rgb", "maniskill_pushcube"):
    cfg = compose([f"env={name}", "env.train.image_size=[64,64]", "env.train.video.enabled=true",
                   "env.train.video.env_ids=[0]"]).env.train
    env = make_env(cfg, num_envs=1, seed=0)
    try:
        digest = hashlib.sha256()
        obs, _ = env.reset()
        digest.update(np.ascontiguousarray(obs["images"] if "images" in obs else obs["state"]).tobytes())
        rng = np.random.default_rng(0)
        for _ in range(3):
            actions = rng.uniform(-1, 1, size=(1, 4, env.spec.action_dim)).astype(np.float32)
            obs, _, _, _, info = env.step(actions)
            digest.update(np.stack(info["frames"][0]).tobytes())
            if "images" in obs:
                digest.update(np.ascontiguousarray(obs["images"]).tobytes())
        out["digests"][name] = digest.hexdigest()
        out["mapped"] += [maps_library(pid) for pid in env.pids]
    finally:
        env.close()
if os.environ.get("EMBODIRL_BRDF_LUT") != "full":     # the renderer in this process: the table's size
    import ctypes
    from embodirl.envs.maniskill.simulator import make_sim_env, settings_of
    sim = make_sim_env(settings_of(cfg), 0)
    sim.render_frame()
    lut = ctypes.CDLL(str(runtime.local_vulkan_dir() / runtime.BRDF_LUT_LIBRARY))
    out["calls"], out["size"] = lut.embodirl_brdf_lut_calls(), lut.embodirl_brdf_lut_size()
    sim.close()
print("RESULT " + json.dumps(out))
"""


def _run(**env) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_the_small_table_is_built_by_the_simulators_and_changes_no_frame():
    vk = local_vulkan_dir()
    assert vk is not None and (vk / BRDF_LUT_LIBRARY).is_file(), (
        "scripts/setup.sh did not build .deps/vulkan/brdf_lut.so (is a C compiler installed?)")
    small, full = _run(), _run(EMBODIRL_BRDF_LUT="full")
    assert small["mapped"] == [True, True], small          # every simulator process loaded the library
    assert full["mapped"] == [False, False], full          # EMBODIRL_BRDF_LUT=full: SAPIEN's own table
    assert (small["calls"], small["size"]) == (1, 128), small
    assert small["digests"] == full["digests"]
