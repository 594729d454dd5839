"""Checkpoints: atomic under SIGKILL, the policy layout (peft adapter + safetensors) loadable on its own,
the actor restored from it, and how ``runner.resume_dir`` / ``runner.resume_mode`` pick a checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from embodirl import checkpoint_layout as layout
from embodirl.envs.base import EnvSpec
from embodirl.errors import ConfigError
from embodirl.models.registry import make_policy
from embodirl.runner import checkpoint as ckpt
from embodirl.runner.checkpoint import load_actor_state, load_policy_weights
from embodirl.runner.loop import Runner
from embodirl.workers.actor_group import ActorGroup
from tests import cli_runs

SPEC = EnvSpec(action_dim=7, max_episode_steps=64, task_descriptions=["pick up the bowl", "open the drawer"],
               camera_names=["agentview", "wrist"], image_size=(56, 56), state_dim=8, name="libero_like")


def _write(name, text="x"):
    def write(folder):
        (folder / f"{name}.txt").write_text(text)
    return write


# --- atomicity ------------------------------------------------------------------------------------------
def test_sigkill_mid_save_leaves_no_complete_looking_folder_and_loses_nothing(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, {"a": _write("a", "first")})
    script = textwrap.dedent(f"""
        import sys, time
        from embodirl.runner import checkpoint as ckpt
        from embodirl import checkpoint_layout as layout

        def hang(folder):
            (folder / "half.bin").write_bytes(b"0" * 1024)
            print("writing", flush=True)
            time.sleep(600)

        ckpt.save_checkpoint({str(tmp_path)!r}, 2, {{"a": lambda f: (f / "a.txt").write_text("second"), "b": hang}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    root = ckpt.checkpoint_root(tmp_path)
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".tmp_step_2_")]
    assert leftovers and not (root / "step_2").exists()           # the half-written save stayed aside
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest.name == "step_1" and (latest / "a" / "a.txt").read_text() == "first"
    with pytest.raises(ConfigError, match="runner.resume_dir"):
        ckpt.resume_source(str(root / leftovers[0]), "auto", tmp_path)
    # the next save clears the dead process's temporary folder and completes
    ckpt.save_checkpoint(tmp_path, 2, {"a": _write("a", "second")})
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]


def test_failing_writer_cleans_up_and_resaving_a_step_replaces_it(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, {"a": _write("a", "old")})

    def crash(folder):
        (folder / "partial").write_text("?")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, 2, {"a": _write("a"), "b": crash})
    root = ckpt.checkpoint_root(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]
    ckpt.save_checkpoint(tmp_path, 1, {"a": _write("a", "new")})
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]
    assert (root / "step_1" / "a" / "a.txt").read_text() == "new"
    assert json.loads((root / "step_1" / layout.COMPLETE).read_text()) == {"step": 1, "parts": ["a"],
                                                                           "files": {"a/a.txt": 3}}   # with sizes


# --- the policy layout -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def oft_cfg(tmp_path_factory):
    from embodirl.config import compose

    out = tmp_path_factory.mktemp("oft_run")
    return compose(["model=openvla_oft_tiny", "algorithm=ppo", "actor.global_batch_size=2",
                    "actor.micro_batch_size=2", f"runner.output_dir={out}"])


def oft_actors(cfg, seed):
    """One in-process actor rank (what the runner checkpoints) with a policy of its own random init."""
    torch.manual_seed(seed)
    return ActorGroup.local(cfg, SPEC, policy=make_policy(cfg.model, SPEC))


def take_optimizer_steps(actor, steps=2):
    """Real AdamW steps on every trainable tensor (moments and the schedule move), without a batch."""
    for _ in range(steps):
        loss = sum((p.float() - 0.1).square().sum() for _, p in actor._trainable)
        loss.backward()
        actor.optimizer.step()
        actor.scheduler.step()
        actor.optimizer.zero_grad(set_to_none=True)
    actor.version, actor.optimizer_steps = 3, steps


def test_lora_checkpoint_is_a_peft_adapter_and_restores_the_actor(oft_cfg, tmp_path):
    import peft

    from embodirl.models.openvla_oft.lora import peft_parameter_names
    from embodirl.models.openvla_oft.modeling import build_model
    from embodirl.models.openvla_oft.resolve import build_config

    trained_actors = oft_actors(oft_cfg, seed=0)
    trained = trained_actors.workers[0].actor
    take_optimizer_steps(trained)
    path = Runner(oft_cfg)._save(3, trained_actors, np.random.default_rng(0))
    folder = path / layout.POLICY
    assert {"adapter_config.json", "adapter_model.safetensors", "trainable.safetensors"} <= {
        p.name for p in folder.iterdir()}
    adapter_cfg = json.loads((folder / "adapter_config.json").read_text())
    assert adapter_cfg["peft_type"] == "LORA" and adapter_cfg["r"] == 8 and adapter_cfg["lora_alpha"] == 16
    live = trained.policy.trainable_state_dict()
    adapter_names = peft_parameter_names(trained.policy)
    # outside the adapter: exactly the value head, by parameter name
    assert set(load_file(str(folder / "trainable.safetensors"))) == set(live) - adapter_names
    assert all("value_head" in n for n in set(live) - adapter_names)

    # peft alone reads the adapter onto a freshly built network (other random init)
    torch.manual_seed(5)
    core = build_model(build_config(OmegaConf.to_container(oft_cfg.model, resolve=True), SPEC), "cpu")
    loaded = peft.PeftModel.from_pretrained(core, str(folder), is_trainable=True)
    from_peft = dict(loaded.named_parameters())
    assert {n for n in adapter_names} == {f"vla.{n}" for n in peft_parameter_names(loaded)}
    for name in adapter_names:
        assert torch.equal(from_peft[name[len("vla."):]], live[name]), name

    # evaluation needs nothing but policy/: a copy of that part alone loads
    alone = tmp_path / "alone"
    shutil.copytree(folder, alone / layout.POLICY)
    torch.manual_seed(2)
    policy = make_policy(oft_cfg.model, SPEC)
    load_policy_weights(policy, alone, oft_cfg)
    assert_same(policy.trainable_state_dict(), live)

    # a resumed actor: weights, optimizer moments, schedule, counters
    fresh_actors = oft_actors(oft_cfg, seed=1)
    fresh = fresh_actors.workers[0].actor
    first = min(adapter_names)
    assert not torch.equal(fresh.policy.trainable_state_dict()[first], live[first])
    load_actor_state(fresh_actors, path, oft_cfg)
    assert_same(fresh.policy.trainable_state_dict(), live)
    a, b = trained.state_dict(), fresh.state_dict()
    assert (a["version"], a["optimizer_steps"], a["scheduler"]) == (b["version"], b["optimizer_steps"], b["scheduler"])
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for key, moments in a["optimizer"]["state"].items():
        assert_same(moments, b["optimizer"]["state"][key])


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(b[key])), key


def test_state_policy_checkpoint_is_safetensors_and_a_mismatch_is_one_sentence(tmp_path, compose_cfg):
    cfg = compose_cfg("env=toy_reach", "env.train.state_obs=true", f"runner.output_dir={tmp_path}")
    spec = EnvSpec(action_dim=7, max_episode_steps=24, task_descriptions=["reach"], camera_names=[],
                   image_size=(64, 64), state_dim=4, name="toy_reach")
    torch.manual_seed(0)
    actors = ActorGroup.local(cfg, spec, policy=make_policy(cfg.model, spec))
    actor = actors.workers[0].actor
    take_optimizer_steps(actor, steps=1)
    path = Runner(cfg)._save(1, actors, np.random.default_rng(0))
    assert sorted(p.name for p in (path / layout.POLICY).iterdir()) == ["trainable.safetensors"]
    assert_same(load_file(str(path / layout.POLICY / "trainable.safetensors")), actor.policy.trainable_state_dict())
    torch.manual_seed(1)
    other = make_policy(cfg.model, spec)
    load_policy_weights(other, path, cfg)
    assert_same(other.trainable_state_dict(), actor.policy.trainable_state_dict())
    # a checkpoint of another model: one sentence naming the file and the key whose value differs from the run's
    wider_cfg = OmegaConf.merge(cfg, {"model": {"hidden_sizes": [32, 32]}})
    wider = make_policy(wider_cfg.model, spec)
    with pytest.raises(ConfigError) as err:
        load_policy_weights(wider, path, wider_cfg)
    message = str(err.value)
    assert message.startswith("runner.resume_dir: ") and "trainable.safetensors" in message
    assert f"written with model.hidden_sizes={list(cfg.model.hidden_sizes)} (this run: [32, 32]);" in message, message
    assert "\n" not in message


# --- choosing the checkpoint to resume from ---------------------------------------------------------------
def make_run(out, steps=(2, 4)):
    for step in steps:
        ckpt.save_checkpoint(out, step, {"a": _write("a", str(step))})


def test_resume_dir_step_folder_run_folder_disable_and_auto(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    make_run(run)
    root = ckpt.checkpoint_root(run)
    (root / "step_6").mkdir()                                    # renamed by hand, no marker: not complete
    assert ckpt.resume_source(None, "auto", run) == root / "step_4"
    assert ckpt.resume_source("auto", "auto", run) == root / "step_4"
    assert ckpt.resume_source(None, "auto", other) is None       # a fresh run
    assert ckpt.resume_source(str(root / "step_2"), "auto", other) == root / "step_2"
    assert ckpt.resume_source(str(run), "auto", other) == root / "step_4"
    assert ckpt.resume_source(str(root), "auto", other) == root / "step_4"
    assert ckpt.resume_source("disable", "auto", run) is None
    assert ckpt.resume_source(str(run), "disable", run) is None


@pytest.mark.parametrize("where", ["missing", "empty", "partial_step", "model_checkpoint"])
def test_resume_dir_without_a_complete_checkpoint_is_one_sentence(tmp_path, where):
    make_run(tmp_path / "run")
    path = {"missing": tmp_path / "nope", "empty": tmp_path / "empty",
            "partial_step": ckpt.checkpoint_root(tmp_path / "run") / "step_6",
            "model_checkpoint": tmp_path / "oft"}[where]
    if where in ("empty", "partial_step", "model_checkpoint"):
        path.mkdir()
    if where == "model_checkpoint":
        (path / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as err:
        ckpt.resume_source(str(path), "auto", tmp_path / "out")
    message = str(err.value)
    assert message.startswith(f"runner.resume_dir: '{path}'") and "\n" not in message
    hint = {"missing": "resume_dir=disable", "empty": "resume_dir=disable",
            "partial_step": "use " + str(ckpt.checkpoint_root(tmp_path / "run") / "step_4"),
            "model_checkpoint": f"model.path={path}"}[where]
    assert hint in message


def test_bad_resume_dir_stops_the_cli_before_anything_is_written(tmp_path):
    out = tmp_path / "outputs" / "t"
    make_run(out)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "config.yaml").write_text("runner: {}\n")
    before = {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None) for p in out.rglob("*")}
    (tmp_path / "empty").mkdir()
    proc = cli_runs.run(["train", "env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true",
                         "runner.experiment_name=t", f"runner.resume_dir={tmp_path / 'empty'}"], tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith(f"embodirl: runner.resume_dir: '{tmp_path / 'empty'}' holds no complete")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None) for p in out.rglob("*")} == before
