"""``embodirl demos`` -> ``embodirl sft`` -> ``embodirl eval|train model.path=<sft checkpoint>`` through the CLI on
real ManiSkill PushCube (rgb): the SFT writes the dataset's statistics, TensorBoard, metrics and checkpoints whose
``model/`` folder eval and train load with no other flag; a resumed SFT run equals a straight one; bad input is one
sentence and exit status 2. The statistics are those of the demos' actions in the policy's own convention (ManiSkill's
gripper +1 open becomes OFT's 1 and π0's -1: embodirl/envs/conventions.py), the convention its rollouts convert from."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from safetensors.torch import load_file

from embodirl.demos.lerobot.reader import LeRobotDataset
from embodirl.models.openvla_oft.hf_checkpoint import MARKER, TOKENS_TRAINED
from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

TIMEOUT_S = 600
ENV = ["env=maniskill_pushcube_rgb", "env.train.image_size=[64,64]"]
SMALL = [*ENV, "model=openvla_oft_tiny", "env.eval.image_size=[64,64]", "runner.progress_bar=false",
         "cluster.use_ray=false"]
SFT = ["sft.batch_size=4", "runner.logger.tensorboard=true", "runner.save_interval=2"]
EVAL = ["env.eval.num_envs=2", "env.eval.num_trials_per_task=2", "env.eval.max_episode_steps=16",
        "runner.eval_num_videos=0"]


def cli(args, cwd, *, expect=0) -> subprocess.CompletedProcess:
    return cli_runs.run(args, cwd, timeout=TIMEOUT_S, expect=expect)


def one_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("args, fragment", [
    ([], "data.path: is not set"),
    (["data.path=/nonexistent/ds"], "data.path: dataset folder /nonexistent/ds does not exist"),
    (["data.path=x", "sft.batchsize=2"], "sft.batchsize: is not one of the sft keys"),
    (["data.path=x", "model=state_mlp"], "model.name: is state_mlp"),
    (["data.path=x", "sft.token_loss=false"], "sft.token_loss: is false and sft.l1_head is false"),
    (["data.path=x", "model=pi0_tiny", "sft.l1_head=true"],
     "sft.l1_head: is OpenVLA-OFT's; pi0 trains its flow-matching loss only"),
    (["data.path=x", "model=pi0_tiny", "sft.stop_token=true"], "sft.stop_token: is OpenVLA-OFT's"),
])
def test_bad_input_is_one_sentence_with_exit_2(tmp_path, args, fragment):
    proc = cli(["sft", *ENV, "model=openvla_oft_tiny", *args], tmp_path, expect=2)
    assert fragment in one_line(proc)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    """Two expert episodes recorded by ``embodirl demos`` (both chains below train on them)."""
    root = tmp_path_factory.mktemp("demos")
    cli(["demos", *ENV, "num_episodes=2", "progress_bar=false", f"output_dir={root / 'ds'}"], root)
    return root / "ds"


def in_policy_convention(dataset: LeRobotDataset, model: str) -> LeRobotDataset:
    """``dataset``'s actions as ``embodirl sft`` trains ``model`` on them (the run's conversion from the env's)."""
    from embodirl.config import compose, validate
    from embodirl.schema.envs import action_conversion

    run = validate(compose([*ENV, f"model={model}"]), check_envs=False, num_devices=2, accelerator="cpu")
    native = dataset.all_actions().copy()
    dataset.convert_actions(action_conversion(run, "env.train").from_env)
    assert np.array_equal(dataset.all_actions()[:, :-1], native[:, :-1])               # the arm as recorded
    return dataset


@pytest.mark.slow
def test_demos_sft_eval_train_and_resume(tmp_path, demos):
    ds = demos
    dataset = in_policy_convention(LeRobotDataset(ds, action_chunk=8), "openvla_oft_tiny")
    assert set(np.unique(dataset.all_actions()[:, -1])) <= {0.0, 1.0}                  # OFT's gripper: 1 open

    # dataset against env / model: one sentence before the run starts
    bad = cli(["sft", *SMALL, f"data.path={ds}", "env.train.control_mode=pd_ee_delta_pose",
               "env.eval.control_mode=pd_ee_delta_pose"], tmp_path, expect=2)
    assert "data.path: " in one_line(bad) and "4-D actions" in one_line(bad)
    bad = cli(["sft", *SMALL, f"data.path={ds}", "model.action_chunk=32"], tmp_path, expect=2)
    assert "model.action_chunk: is 32 but the shortest episode" in one_line(bad)

    # straight run: 4 steps, checkpoints at 2 and 4, an evaluation in the simulator at step 4
    a = tmp_path / "a"
    straight_run = ["sft", *SMALL, *SFT, *EVAL, f"data.path={ds}", "runner.max_steps=4", "runner.val_check_interval=4"]
    out = cli([*straight_run, f"runner.output_dir={a}"], tmp_path)
    model = a / "checkpoints" / "step_4" / "model"
    assert f"model.path={model}" in out.stdout
    stats = json.loads((model / "dataset_statistics.json").read_text())
    assert list(stats) == ["PushCube-v1"]
    entry = stats["PushCube-v1"]
    np.testing.assert_allclose(entry["action"]["q01"], dataset.stats["action"].q01, rtol=1e-6)
    np.testing.assert_allclose(entry["action"]["q99"], dataset.stats["action"].q99, rtol=1e-6)
    assert len(entry["action"]["mask"]) == 4 and len(entry["proprio"]["q99"]) == dataset.state_dim
    assert entry["num_trajectories"] == 2 and entry["num_transitions"] == len(dataset)
    config = json.loads((model / "config.json").read_text())
    assert config[MARKER][TOKENS_TRAINED] is True and config["num_images_in_input"] == 1
    records = [r for r in read_metrics(a / "metrics.jsonl") if "sft/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(0.0 <= r["sft/token_accuracy"] <= 1.0 and r["sft/action_l1"] >= 0 for r in records)
    assert any(r.get("eval/episodes") == 2 for r in read_metrics(a / "metrics.jsonl"))
    # the step-4 evaluation is `embodirl eval model.path=<model>`'s run of the exported folder (embodirl/sft/loop.py)
    assert json.loads((a / "eval" / "step_4" / "eval_info.json").read_text())["overall"]["n_episodes"] == 2
    assert list(a.glob("**/events.out.tfevents.*")), "no TensorBoard events"

    # resumed run: the straight run as if it had been killed after its step-2 checkpoint; the same command
    # continues from step_2 (its metrics after step 2 dropped) and ends where the straight run did
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step_4")
    cli([*straight_run, f"runner.output_dir={b}"], tmp_path)
    resumed_records = [r for r in read_metrics(b / "metrics.jsonl") if "sft/loss" in r]
    assert [r["step"] for r in resumed_records] == [1, 2, 3, 4]          # the killed run's steps 3-4 are dropped
    resumed = {r["step"]: r["sft/loss"] for r in resumed_records}
    for r in records:
        assert resumed[r["step"]] == pytest.approx(r["sft/loss"], rel=1e-5), (r["step"], resumed, records)
    adapter = "lora_adapter/adapter_model.safetensors"
    straight, again = load_file(str(model / adapter)), load_file(str(b / "checkpoints/step_4/model" / adapter))
    assert straight.keys() == again.keys()
    for name in straight:
        np.testing.assert_allclose(straight[name].numpy(), again[name].numpy(), rtol=1e-5, atol=1e-7)

    # the same folder with another adapter layout (full fine-tuning instead of LoRA): one sentence naming the
    # checkpoint, exit 2, and the earlier run's config and statistics are not overwritten (they were, before)
    written = {name: (b / name).read_bytes() for name in ("config.yaml", "dataset_statistics.json")}
    other = cli([*straight_run, "actor.fsdp.full_finetune=true", f"runner.output_dir={b}"], tmp_path, expect=2)
    last = [line for line in other.stderr.splitlines() if line.strip()][-1]
    assert f"runner.resume_dir: cannot resume from {b / 'checkpoints' / 'step_4'}" in last, other.stderr[-2000:]
    assert "written with actor.fsdp.full_finetune=false (this run: true);" in last and "Traceback" not in other.stderr
    assert {name: (b / name).read_bytes() for name in written} == written

    # the checkpoint loads with no other flag: one GRPO step of token RL from it
    train = cli(["train", *SMALL, f"model.path={model}", "algorithm=grpo", "algorithm.group_size=2",
                 "env.train.use_fixed_reset_state_ids=true", "env.train.num_envs=2", "env.train.max_episode_steps=16",
                 "runner.max_steps=1", "runner.val_check_interval=0", "runner.save_interval=0",
                 "runner.logger.tensorboard=false", f"runner.output_dir={tmp_path / 'rl'}"], tmp_path)
    assert "action tokens, proprio token, 1 image(s)" in train.stdout + train.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "rl" / "metrics.jsonl") if "actor/pg_loss" in r] == [1]


@pytest.mark.slow
def test_pi0_demos_sft_eval_and_train(tmp_path, demos):
    """π0 through the same chain: the SFT trains the flow-matching loss on the dataset's chunks of model.chunk_size,
    standardised with its mean and std, and exports transformers' layout with those statistics, which evaluation and
    train load with no other flag."""
    from transformers import PI0ForConditionalGeneration

    ds = demos
    dataset = in_policy_convention(LeRobotDataset(ds, action_chunk=8), "pi0_tiny")     # LIBERO's sign: +1 close
    pi0 = [*ENV, "model=pi0_tiny", "env.eval.image_size=[64,64]", "runner.progress_bar=false", "cluster.use_ray=false"]
    bad = cli(["sft", *pi0, f"data.path={ds}", "model.chunk_size=32"], tmp_path, expect=2)
    assert "model.chunk_size: is 32 but the shortest episode" in one_line(bad)
    a = tmp_path / "a"
    cli(["sft", *pi0, *SFT, *EVAL, f"data.path={ds}", "runner.max_steps=4", "runner.val_check_interval=4",
         f"runner.output_dir={a}"], tmp_path)
    model = a / "checkpoints" / "step_4" / "model"
    records = [r for r in read_metrics(a / "metrics.jsonl") if "sft/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["sft/loss"] > 0 and "sft/token_accuracy" not in r for r in records)
    processor = json.loads((model / "processor_config.json").read_text())
    np.testing.assert_allclose(processor["actions_mean"], dataset.stats["action"].mean, rtol=1e-6)
    np.testing.assert_allclose(processor["state_std"], dataset.stats[dataset.state_key].std, rtol=1e-6)
    assert PI0ForConditionalGeneration.from_pretrained(str(model)).config.chunk_size == 8
    # the step-4 evaluation is `embodirl eval model.path=<model>`'s run (embodirl/sft/loop.py)
    assert json.loads((a / "eval" / "step_4" / "eval_info.json").read_text())["overall"]["n_episodes"] == 2
    cli(["train", *pi0, f"model.path={model}", "algorithm=grpo", "algorithm.group_size=2",
         "env.train.use_fixed_reset_state_ids=true", "env.train.num_envs=2", "env.train.max_episode_steps=16",
         "runner.max_steps=1", "runner.val_check_interval=0", "runner.save_interval=0",
         "runner.logger.tensorboard=false", f"runner.output_dir={tmp_path / 'rl'}"], tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path / "rl" / "metrics.jsonl") if "actor/pg_loss" in r] == [1]
