"""``embodirl doctor`` through the real command: every check passes on this machine for the default job and for
LIBERO with the tiny VLA, and each check fails in turn (missing or incomplete assets, a checkpoint whose head
RL cannot train, no Vulkan device, too little memory, packages off the lock) with its one-line fix. ``train``
runs the fast checks before any worker starts: one sentence, exit status 2, nothing written."""

from __future__ import annotations

import os

import pytest

from embodirl.tools import doctor
from tests import cli_runs
from tests.models.test_openvla_checkpoint import direct_model, oft_action_head_file, write_public_checkpoint

TINY_LIBERO = ["env=libero_10", "model=openvla_oft_tiny"]
#: a full fine-tune of the 7B model: its optimizer state alone is ~120 GiB, more than any one device holds
TOO_BIG = ["env=libero_10", "model=openvla_oft", "actor.fsdp.full_finetune=true", "model.lora.enabled=false"]


def run(args, cwd, env=None):
    return cli_runs.run(args, cwd, env={**os.environ, **(env or {})}, timeout=300)


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    """{check: (status, found)} from the table, and each failure's fix under ``<check>.fix``."""
    out, last = {}, None
    for line in stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[1] in ("PASS", "FAIL", "WARN"):
            last = parts[0]
            out[last] = (parts[1], parts[2] if len(parts) > 2 else "")
        elif line.strip().startswith("fix: ") and last is not None:
            out[f"{last}.fix"] = ("", line.strip()[len("fix: "):])
    return out


def failing(stdout: str) -> list[str]:
    return [name for name, (status, _) in rows(stdout).items() if status == "FAIL"]


@pytest.mark.parametrize("overrides, expected", [
    ([], {"config", "render/vulkan", "assets/train", "dependencies", "checkpoint", "memory", "video", "ray"}),
    (TINY_LIBERO, {"config", "render/mujoco", "assets/train", "dependencies", "checkpoint", "memory", "video", "ray"}),
])
def test_every_check_passes_on_this_machine(overrides, expected, tmp_path):
    proc = run(["doctor", *overrides], tmp_path)
    table = rows(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert expected <= set(table) and not failing(proc.stdout), proc.stdout
    if "render/vulkan" in expected and os.environ.get("EMBODIRL_VULKAN", "local") != "system":
        assert "BRDF table 128" in table["render/vulkan"][1], proc.stdout     # lavapipe with brdf_lut.so
    if "render/mujoco" in expected and not doctor.machine_gpus() and "MUJOCO_GL" not in os.environ:
        assert table["render/mujoco"][1].startswith("LIBERO renders with OSMesa (MUJOCO_GL=osmesa; software: no GPU "
                                                    "visible to this process)"), proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_missing_and_incomplete_libero_assets(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run(["doctor", *TINY_LIBERO], tmp_path, env={"EMBODIRL_LIBERO_ASSETS": str(empty)})
    table = rows(proc.stdout)
    assert proc.returncode == 1 and failing(proc.stdout) == ["assets/train"], proc.stdout
    assert "scenes" in table["assets/train"][1] and "EMBODIRL_LIBERO_ASSETS" in table["assets/train.fix"][1]
    partial = tmp_path / "partial"
    (partial / "scenes").mkdir(parents=True)
    proc = run(["doctor", *TINY_LIBERO], tmp_path, env={"EMBODIRL_LIBERO_ASSETS": str(partial)})
    table = rows(proc.stdout)
    assert proc.returncode == 1 and failing(proc.stdout) == ["assets/train"], proc.stdout
    assert "lacks articulated_objects" in table["assets/train"][1]


def test_checkpoint_with_an_l1_head_is_not_rl_ready(tmp_path):
    model = direct_model(seed=3)
    path = write_public_checkpoint(tmp_path / "l1", model)
    oft_action_head_file(path, model.cfg.llm_dim, 7)
    proc = run(["doctor", *TINY_LIBERO, f"model.path={path}"], tmp_path)
    table = rows(proc.stdout)
    assert proc.returncode == 1 and failing(proc.stdout) == ["checkpoint"], proc.stdout
    assert "L1 regression head" in table["checkpoint"][1]
    assert "fine-tuned with action tokens" in table["checkpoint.fix"][1]
    # the same checkpoint is fine for evaluation, and doctor says what it holds
    proc = run(["doctor", *TINY_LIBERO, f"model.path={path}", "runner.only_eval=true"], tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert "L1 regression head" in rows(proc.stdout)["checkpoint"][1]


def test_no_vulkan_device_in_doctor_and_before_train_starts(tmp_path):
    no_device = {"VK_ICD_FILENAMES": str(tmp_path / "no_icd.json")}
    proc = run(["doctor"], tmp_path, env=no_device)
    table = rows(proc.stdout)
    assert proc.returncode == 1 and failing(proc.stdout) == ["render/vulkan"], proc.stdout
    assert "no Vulkan device" in table["render/vulkan"][1] and "scripts/setup.sh" in table["render/vulkan.fix"][1]
    work = tmp_path / "work"
    work.mkdir()
    proc = run(["train"], work, env=no_device)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("embodirl: render/vulkan:") and "fix: run scripts/setup.sh" in lines[0]
    assert list(work.iterdir()) == []


def test_a_missing_video_writer_is_one_sentence_before_anything_starts(tmp_path):
    """A machine without imageio-ffmpeg (the GPU machine at d1d7c5b) crashed at its first evaluation with
    "TiffWriter.write() got an unexpected keyword argument 'fps'". Here the package is hidden behind a module that
    fails to import, as an absent one does: doctor names the key that asks for videos, train stops before any
    worker starts and writes nothing, and the same run without videos is not refused."""
    shadow = tmp_path / "shadow" / "imageio_ffmpeg"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'imageio_ffmpeg'\")\n")
    hidden = {"PYTHONPATH": os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])}
    proc = run(["doctor"], tmp_path, env=hidden)
    table = rows(proc.stdout)
    assert "video" in failing(proc.stdout), proc.stdout
    assert "runner.eval_num_videos asks for videos" in table["video"][1]
    assert "runner.eval_num_videos=0" in table["video.fix"][1]
    work = tmp_path / "work"
    work.mkdir()
    proc = run(["train"], work, env=hidden)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("embodirl: video: runner.eval_num_videos asks for videos"), lines
    assert list(work.iterdir()) == []
    proc = run(["doctor", "runner.eval_num_videos=0"], tmp_path, env=hidden)
    assert rows(proc.stdout)["video"][0] == "PASS", proc.stdout


def test_too_little_memory_names_the_component(tmp_path):
    proc = run(["doctor", *TOO_BIG], tmp_path)
    table = rows(proc.stdout)
    assert proc.returncode == 1 and "memory" in failing(proc.stdout), proc.stdout
    assert "actor" in table["memory"][1].split(":")[0] and "will not fit" in table["memory"][1]
    assert "actor.enable_offload" in table["memory.fix"][1]
    proc = run(["train", *TOO_BIG], tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "memory: actor" in lines[0], proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_packages_off_the_lock(tmp_path):
    lock = tmp_path / "constraints.txt"
    lock.write_text("numpy==0.0.1\nnot-a-real-package-embodirl==1.0\n# comment\n")
    check = doctor.check_dependencies(lock)
    assert not check.ok and "2 of 2 packages" in check.detail and "numpy" in check.detail
    assert "scripts/setup.sh" in check.fix
    assert doctor.check_dependencies().ok


def test_software_rendering_beside_gpus_is_a_warning(monkeypatch):
    """On a machine with GPUs, a simulator that would render in software passes with a warning and its fix (this
    machine has none: the GPU count is handed in, the renderers are this machine's real ones)."""
    for var in ("MUJOCO_GL", "EMBODIRL_MUJOCO_GL_CHOSEN"):
        monkeypatch.delenv(var, raising=False)
    row = doctor.check_mujoco(gpus_on_machine=8)
    assert row.ok and row.warn and "OSMesa" in row.detail and "8 GPU(s) but LIBERO would render in software" in row.detail
    assert "NVIDIA's EGL library" in row.fix
    assert not doctor.check_mujoco(gpus_on_machine=0).warn
    if os.environ.get("EMBODIRL_VULKAN", "local") != "system":
        row = doctor.check_vulkan(gpus_on_machine=8)
        assert row.ok and row.warn and "(software)" in row.detail and "EMBODIRL_VULKAN=system" in row.fix
        assert "WARN" in doctor.format_table([row]) and "fix: set EMBODIRL_VULKAN=system" in doctor.format_table([row])
