"""Process-level settings: torch's intra-op threads in the driver, the renderer MuJoCo (LIBERO) uses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from embodirl import runtime


def test_auto_threads_follow_the_machine():
    cores = os.cpu_count() or 1
    expected = 1 if cores <= 4 else min(8, cores // 2)
    assert runtime.torch_threads("auto", cuda=False) == expected
    assert runtime.torch_threads(None, cuda=False) == expected
    assert runtime.torch_threads("auto", cuda=True) is None       # GPU machines keep torch's default
    assert runtime.torch_threads(3, cuda=False) == 3


def test_set_torch_threads_applies_the_setting():
    before = torch.get_num_threads()
    try:
        runtime.set_torch_threads(1)
        assert torch.get_num_threads() == 1
        runtime.set_torch_threads(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_mujoco_renderer_follows_the_gpus_a_process_may_use(tmp_path):
    """EGL on the first GPU this process may use (Ray narrows CUDA_VISIBLE_DEVICES to a worker's GPU), OSMesa without
    one or without NVIDIA's EGL library; a MUJOCO_GL the user set is kept, one embodirl chose is chosen again."""
    gpus_dir = tmp_path / "gpus"
    gpus_dir.mkdir()
    assert runtime.nvidia_gpus({}, gpus_dir) == []
    for bus in ("0000:01:00.0", "0000:41:00.0", "0000:81:00.0", "0000:c1:00.0"):
        (gpus_dir / bus).mkdir()
    assert runtime.nvidia_gpus({}, gpus_dir) == [0, 1, 2, 3]
    assert runtime.nvidia_gpus({"CUDA_VISIBLE_DEVICES": "2"}, gpus_dir) == [2]
    assert runtime.nvidia_gpus({"CUDA_VISIBLE_DEVICES": ""}, gpus_dir) == []        # a Ray worker without a GPU
    assert runtime.nvidia_gpus({}, tmp_path / "no_driver") == []

    assert runtime.choose_mujoco_gl({}, gpus=[2], nvidia_egl=True) == ("egl", 2, "GPU 2")
    assert runtime.choose_mujoco_gl({}, gpus=[], nvidia_egl=True)[:2] == ("osmesa", None)
    gl, _, why = runtime.choose_mujoco_gl({}, gpus=[0], nvidia_egl=False)
    assert gl == "osmesa" and "NVIDIA's EGL library is not installed" in why
    assert runtime.choose_mujoco_gl({"MUJOCO_GL": "egl"}, gpus=[], nvidia_egl=False)[0] == "egl"       # the user's
    chosen = {"MUJOCO_GL": "egl", runtime.GL_CHOSEN_VAR: "egl"}                                         # a parent's
    assert runtime.choose_mujoco_gl(chosen, gpus=[], nvidia_egl=True)[0] == "osmesa"


def test_libero_renders_with_the_chosen_backend_in_its_simulator_process(tmp_path):
    """A simulator process started with a parent's choice marked as embodirl's chooses again (here: no GPU, OSMesa)
    and robosuite builds its context with that backend."""
    code = ("import os; from embodirl import runtime; runtime.configure(); "
            "from robosuite.utils import binding_utils as b; "
            "print(os.environ['MUJOCO_GL'], os.environ.get('MUJOCO_EGL_DEVICE_ID'), b.GLContext.__name__)")
    env = {**os.environ, "MUJOCO_GL": "egl", runtime.GL_CHOSEN_VAR: "egl", "MUJOCO_EGL_DEVICE_ID": "0",
           runtime.EGL_DEVICE_CHOSEN_VAR: "0", "PYOPENGL_PLATFORM": "egl"}
    if runtime.nvidia_gpus():
        pytest.skip("this machine has an NVIDIA GPU: the choice is EGL")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["osmesa", "None", "OSMesaGLContext"]
