"""The ``embodirl`` command in a process of its own (tests/cli_runs.py), from an empty working directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from embodirl.paths import config_dir
from tests import cli_runs


def run_cli(args, cwd, env=None, timeout=180):
    return cli_runs.run(args, cwd, env={**os.environ, **(env or {})}, timeout=timeout)


def _assert_rejected(proc, cwd, fragment):
    assert proc.returncode == 2, proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert fragment in lines[0], lines[0]
    assert list(Path(cwd).iterdir()) == [], "a rejected config must not create anything on disk"


def test_cfg_job_prints_libero_10(tmp_path):
    proc = run_cli(["train", "--cfg", "job", "env=libero_10", "model=openvla_oft"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    import yaml

    cfg = yaml.safe_load(proc.stdout)
    for split, steps in (("train", 512), ("eval", 520)):   # the RL recipe's episodes; OFT's evaluation protocol
        assert cfg["env"][split]["suite"] == "libero_10"
        assert cfg["env"][split]["max_episode_steps"] == steps
    assert cfg["model"]["name"] == "openvla_oft"


def test_cfg_job_composes_the_pi0_libero_recipe(tmp_path):
    """`env=libero_10 model=pi0` is RLinf's LIBERO-10 π0 recipe (config/model/pi0.yaml names its files and commits;
    tests/models/test_pi0_recipe.py holds the whole table): PPO with GAE on a detached value head over the expert's
    output, Huber critic loss, Flow-SDE at noise level 0.5 over 4 denoising steps, chunks of 10 of the 50 actions, the
    expert trained in full with PaliGemma frozen, 64 environments of 480 steps, 8 rollout epochs, learning rate 5e-6."""
    proc = run_cli(["train", "--cfg", "job", "env=libero_10", "model=pi0"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    import yaml

    cfg = yaml.safe_load(proc.stdout)
    model, alg = cfg["model"], cfg["algorithm"]
    assert model["name"] == "pi0" and model["value_type"] == "chunk_level" and model["action_chunk"] == 10
    assert model["chunk_size"] == 50 and model["flow"] == {**model["flow"], "method": "flow_sde", "num_steps": 4,
                                                           "noise_level": 0.5}
    assert model["value_head"] == {**model["value_head"], "features": "expert", "detach": True}
    assert model["train_expert"] is True and model["lora"]["enabled"] is False
    assert alg["adv_type"] == "gae" and alg["logprob_type"] == "chunk" and alg["update_epochs"] == 4
    assert alg["huber_delta"] == 10.0 and alg["value_coef"] == 1.0
    assert cfg["env"]["train"]["num_envs"] == 64 and cfg["env"]["train"]["max_episode_steps"] == 480
    assert cfg["rollout"]["rollout_epoch"] == 8 and cfg["actor"]["optim"]["lr"] == 5.0e-6
    assert cfg["actor"]["fsdp"]["gradient_checkpointing"] is False


def test_unknown_env_lists_options_and_exits_2(tmp_path):
    proc = run_cli(["train", "env=nope"], tmp_path)
    _assert_rejected(proc, tmp_path, "unknown env 'nope'; available: ")
    assert "libero_10" in proc.stderr and "maniskill_pickcube" in proc.stderr


def test_cross_field_violation_exits_2_before_anything(tmp_path):
    proc = run_cli(["train", "env=toy_reach", "algorithm=grpo"], tmp_path)
    _assert_rejected(proc, tmp_path, "env.train.use_fixed_reset_state_ids")


def test_unknown_key_and_command(tmp_path):
    _assert_rejected(run_cli(["train", "actor.optim.lrr=1"], tmp_path), tmp_path, "actor.optim.lrr")
    _assert_rejected(run_cli(["fit"], tmp_path), tmp_path, "unknown command 'fit'")


def test_new_env_yaml_is_usable_without_code_change(tmp_path):
    tree = tmp_path / "config"
    shutil.copytree(config_dir(), tree)
    (tree / "env" / "my_reach.yaml").write_text(
        "# @package env.train\n"
        "defaults:\n  - toy_reach@_here_\n  - _self_\n"
        "num_envs: 4\nmax_episode_steps: 16\nnum_tasks: 2\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    proc = run_cli(["train", "--cfg", "job", "env=my_reach"], work, env={"EMBODIRL_CONFIG_DIR": str(tree)})
    assert proc.returncode == 0, proc.stderr
    import yaml

    cfg = yaml.safe_load(proc.stdout)
    assert cfg["env"]["train"]["adapter"] == "toy" and cfg["env"]["eval"]["num_envs"] == 4
    assert cfg["env"]["train"]["max_episode_steps"] == 16


@pytest.mark.parametrize("command", ["train", "eval"])
def test_help_and_eval_sets_only_eval(tmp_path, command):
    proc = run_cli([command, "--cfg", "job", "env=toy_reach"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert ("only_eval: true" in proc.stdout) == (command == "eval")
    assert "usage: embodirl" in run_cli(["--help"], tmp_path).stdout


@pytest.mark.parametrize("override, key", [
    ("env.train.reward_coef=nan", "env.train.reward_coef"),      # accepted before: the default job trained on NaN
    ("actor.optim.lr=inf", "actor.optim.lr"),
    ("algorithm.entropy_bonus=-inf", "algorithm.entropy_bonus"),
    ("model.hidden_sizes=[256,nan]", "model.hidden_sizes[1]"),
])
def test_non_finite_numbers_are_refused(tmp_path, override, key):
    _assert_rejected(run_cli(["train", override], tmp_path), tmp_path, f"{key}: must be a finite number")


def _damaged_checkpoints(root):
    """A tiny public OpenVLA-OFT checkpoint (one image, no proprio: toy_reach's), and copies with garbage in a
    safetensors shard and in config.json."""
    from tests.models.test_openvla_checkpoint import direct_model, write_public_checkpoint

    good = write_public_checkpoint(root / "good", direct_model(seed=3))
    for head in good.glob("proprio_projector--*.pt"):
        head.unlink()
    garbage, broken = root / "garbage", root / "broken"
    shutil.copytree(good, garbage)
    shutil.copytree(good, broken)
    next(garbage.glob("*.safetensors")).write_bytes(os.urandom(100))   # SafetensorError: header too large
    (broken / "config.json").write_text("{not json")
    return garbage, broken


def test_damaged_checkpoint_files_are_one_sentence(tmp_path):
    """`embodirl eval model=openvla_oft_tiny env=toy_reach model.path=<dir>` with a garbage model.safetensors ended in
    SafetensorError's traceback inside the worker, and with a config.json that is not JSON in a CheckpointError
    traceback; both are now refused before anything starts, naming the file, and doctor names them too."""
    garbage, broken = _damaged_checkpoints(tmp_path / "ckpts")
    work = tmp_path / "work"
    work.mkdir()
    for path, fragment in ((garbage, "is not a safetensors file"), (broken, "config.json is not valid JSON")):
        proc = run_cli(["eval", "model=openvla_oft_tiny", "env=toy_reach", f"model.path={path}"], work)
        _assert_rejected(proc, work, fragment)
        assert "model.path: " in proc.stderr and "write or download it again" in proc.stderr
        proc = run_cli(["doctor", "model=openvla_oft_tiny", "env=toy_reach", f"model.path={path}"], work)
        assert proc.returncode == 1 and fragment in proc.stdout, proc.stdout


def test_a_damaged_state_policy_file_is_one_sentence(tmp_path):
    bad = tmp_path / "policy.safetensors"
    bad.write_bytes(os.urandom(64))
    work = tmp_path / "work"
    work.mkdir()
    _assert_rejected(run_cli(["eval", f"model.path={bad}"], work), work, "is not a safetensors file")
    _assert_rejected(run_cli(["eval", f"model.path={tmp_path / 'absent.safetensors'}"], work), work, "does not exist")


@pytest.mark.parametrize("command, extra", [
    ("train", []), ("eval", []), ("doctor", []), ("demos", ["env=maniskill_pushcube_rgb", "num_episodes=3"]),
    ("sft", ["env=maniskill_pushcube_rgb", "model=openvla_oft_tiny", "data.path=somewhere"]),
])
def test_cfg_job_prints_and_writes_nothing_for_every_command(tmp_path, command, extra):
    """`embodirl demos --cfg job env=maniskill_pushcube_rgb` generated and wrote 10 demonstrations; every subcommand
    now prints its composed, checked config for --cfg job, as train does, and writes nothing."""
    import yaml

    proc = run_cli([command, "--cfg", "job", *extra], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = yaml.safe_load(proc.stdout)
    assert isinstance(cfg, dict) and cfg
    if command == "demos":
        assert cfg["num_episodes"] == 3
    if command == "sft":
        assert cfg["data"]["path"] == "somewhere" and cfg["model"]["name"] == "openvla_oft"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, fragment", [
    (["demos", "-m", "num_episodes=1,2"], "-m is for train and eval"),
    (["sft", "--cfg", "hydra"], "--cfg takes one of job, all"),
])
def test_hydra_flags_the_own_commands_do_not_have_are_one_sentence(tmp_path, args, fragment):
    _assert_rejected(run_cli(args, tmp_path), tmp_path, fragment)
