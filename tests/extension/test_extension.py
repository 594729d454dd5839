"""Extension points, used as the README's "Adding a simulator" and "Adding an advantage estimator" say and touching
only the files they name: a simulator from outside the package is one module (tests/extension/grid_sim.py: simulator,
adapter and config class, registered under the module's dotted name) plus one env YAML; an advantage estimator is one
module (tests/extension/advantage.py, registered with what it needs). Both run through the real CLI; the simulator's
own keys are typed by its config class, and the estimator's declared needs bring the group rules."""

from __future__ import annotations

import os
import shutil
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


def cli(args, cwd, config=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
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
