"""Extension points, used as docs/extending.md's "Adding a simulator", "Adding an advantage estimator" and "Adding a policy"
say and touching only the files they name: a simulator from outside the package is one module
(tests/extension/grid_sim.py: simulator, adapter and config class, registered under the module's dotted name) plus one
env YAML; an advantage estimator is one module (tests/extension/advantage.py, registered with what it needs); a policy
family is one package (tests/extension/linear_policy/, copied under another name into a temporary folder, registered
with what it can do) plus one model YAML. All run through the real CLI; their own keys are typed by their config
classes, and what they declare brings the rules (the estimator's groups, the family's missing value head and SFT)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from embodirl.paths import config_dir
from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

ROOT = Path(__file__).resolve().parents[2]
GRID_YAML = """# @package env.train
# the grid simulator of tests/extension/grid_sim.py: its adapter is the module's dotted name
adapter: tests.extension.grid_sim
num_envs: 4
max_episode_steps: 16
step_timeout_s: null
reward_coef: 1.0
use_rel_reward: false
reward_type: chunk_level
auto_reset: false
ignore_terminations: false
use_fixed_reset_state_ids: false
init_state_ids: null
num_trials_per_task: 4
video: {enabled: false, env_ids: [0], fps: 10, overlay: false}
step_size: 0.2
"""
QUICK = ["runner.max_steps=2", "runner.val_check_interval=2", "runner.save_interval=0", "runner.progress_bar=false",
         "runner.logger.tensorboard=false", "runner.eval_num_videos=0"]


LINEAR_YAML = """# config/model/linear.yaml: the linear Gaussian policy of the package my_lab.linear_policy (its dotted name)
name: my_lab.linear_policy
path: null
action_chunk: 2
value_type: null                 # the family has no value head
dtype: float32
device: null
action_convention: {arm: null, gripper: null}   # null = the family's: native
init_log_std: -0.5
"""
TOY_STATE = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.cameras=[]",
             "env.eval.cameras=[]", "env.train.num_envs=8", "env.train.use_fixed_reset_state_ids=true",
             "runner.eval_episodes_per_task=1"]


def cli(args, cwd, config=None, *, path=()):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *map(str, path), os.environ.get("PYTHONPATH", "")])}
    if config is not None:
        env["EMBODIRL_CONFIG_DIR"] = str(config)
    return cli_runs.run(args, cwd, env=env)


def test_a_simulator_added_with_one_module_and_one_yaml(tmp_path):
    tree = tmp_path / "config"
    shutil.copytree(config_dir(), tree)
    (tree / "env" / "grid.yaml").write_text(GRID_YAML)            # the one config file
    proc = cli(["train", "env=grid", *QUICK, f"runner.output_dir={tmp_path / 'run'}"], tmp_path, tree)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if "train/return" in r] == [1, 2]
    assert any("eval/success_rate" in r for r in records)
    # its own keys are typed by the config class it registered with: a misspelt or out-of-range one is one sentence
    for override, fragment in (("env.train.step_sise=0.3", "env.train.step_sise: unknown key"),
                               ("env.train.step_size=-1", "env.train.step_size: must be a positive number"),
                               ("env.train.step_size=fast", "env.train.step_size: must be a number")):
        proc = cli(["train", "env=grid", override], tmp_path, tree)
        assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr[-2000:]


def test_an_advantage_estimator_added_with_one_module(tmp_path):
    base = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.cameras=[]",
            "env.eval.cameras=[]", "env.train.num_envs=8", "algorithm=grpo", "env.train.use_fixed_reset_state_ids=true",
            "algorithm.adv_type=tests.extension.advantage", "runner.eval_episodes_per_task=1"]
    proc = cli(["train", *base, "algorithm.group_size=4", *QUICK, f"runner.output_dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/return" in r] == [1, 2]
    # it declared groups=True: the group rules apply to it as to grpo
    proc = cli(["train", *base, "algorithm.group_size=1"], tmp_path)
    assert proc.returncode == 2 and "adv_type=tests.extension.advantage compares trajectories within a group" \
        in proc.stderr, proc.stderr[-2000:]


def test_a_policy_family_added_with_one_package_and_one_yaml(tmp_path, monkeypatch):
    src = tmp_path / "src"
    # the one package, in a folder of its own (my_lab: a namespace package, no file of its own)
    shutil.copytree(ROOT / "tests" / "extension" / "linear_policy", src / "my_lab" / "linear_policy")
    tree = tmp_path / "config"
    shutil.copytree(config_dir(), tree)
    (tree / "model" / "linear.yaml").write_text(LINEAR_YAML)                                     # the one config file
    # nothing else names the family: the config tree is the installed one plus that file, embodirl's code never says it
    added = {p.relative_to(tree) for p in tree.rglob("*") if p.is_file()} - \
        {p.relative_to(config_dir()) for p in config_dir().rglob("*") if p.is_file()}
    assert added == {Path("model") / "linear.yaml"}
    assert not any("my_lab" in p.read_text() for p in (ROOT / "embodirl").rglob("*.py"))

    base = ["model=linear", *TOY_STATE, "algorithm=grpo", "algorithm.group_size=4"]
    proc = cli(["train", *base, *QUICK, f"runner.output_dir={tmp_path / 'run'}"], tmp_path, tree, path=[src])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if "train/return" in r] == [1, 2]
    assert any("eval/success_rate" in r for r in records)
    assert "rollout transport" not in proc.stdout + proc.stderr           # registered without ray: in process
    # its own key is typed by its config class; what it cannot do is one sentence before anything starts
    for args, fragment in (
            (["train", *base, "model.init_log_std=3"], "model.init_log_std: must be in [-5, 1], got 3"),
            (["train", *base, "model.value_type=chunk_level"],
             "model.value_type: is chunk_level, but my_lab.linear_policy is registered without a value head"),
            (["train", *base, "rollout.compile=true", "cluster.use_ray=true"],
             "rollout.compile: model my_lab.linear_policy is registered without compile"),
            (["sft", *base, "data.path=nowhere"],
             "model.name: is my_lab.linear_policy, a policy family embodirl sft cannot fine-tune (it is registered without "
             "sft); use one that it can: openvla_oft, pi0")):
        proc = cli(args, tmp_path, tree, path=[src])
        assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr[-2000:]
    # the dry run and doctor's memory estimate build it on the meta device like any family (here: in this process,
    # where the family registers for this test only: other tests list the registry's families)
    from embodirl.config import compose
    from embodirl.registry import POLICIES
    from embodirl.tools.dry_run import dry_run
    from embodirl.tools.memory_plan import UNSET_STATE_DIM, memory_plan, model_size

    monkeypatch.setattr(POLICIES, "_entries", dict(POLICIES._entries))
    monkeypatch.setattr(POLICIES, "_configs", dict(POLICIES._configs))
    monkeypatch.syspath_prepend(str(src))
    try:
        cfg = compose(base, config_path=tree)
        report, size = dry_run(cfg), model_size(cfg)
    finally:
        for module in ("my_lab.linear_policy", "my_lab"):
            sys.modules.pop(module, None)
    chunk = 2 * 7                                          # H x A, sized without a simulator (memory_plan.UNSET_*)
    assert report.params == size.params == size.trainable == UNSET_STATE_DIM * chunk + 2 * chunk   # weight, bias, log-std
    assert report.update_model_flops_per_decision > 0 and memory_plan(cfg, size, "cpu")["actor"] > 0
