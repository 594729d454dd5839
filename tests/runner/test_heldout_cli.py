"""Training states held out from evaluation through the ``embodirl`` command: a configuration whose training starts
from evaluation states is refused in one sentence before anything starts; ``official`` trains on them on purpose and
says so; evaluation reports success on training states apart (``runner.eval_train_states_per_task``); ``embodirl
doctor`` shows the relation in its ``heldout`` row."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from embodirl.envs.base import TRAIN_INIT_STATE_BASE
from tests import cli_runs
from tests.test_doctor import failing, rows

SMALL_MANISKILL = ["env=maniskill_pushcube", "env.train.num_envs=2", "actor.global_batch_size=2", "env.eval.num_envs=2",
                   "env.train.max_episode_steps=8", "env.eval.max_episode_steps=8", "runner.eval_episodes_per_task=2",
                   "runner.eval_num_videos=0", "runner.save_interval=0", "runner.logger.tensorboard=false",
                   "runner.progress_bar=false"]


def run(args, cwd, timeout=300):
    return cli_runs.run(args, cwd, env=dict(os.environ), timeout=timeout)


def _official_copy(tmp_path) -> Path:
    """A libero_10 training-state file for task 0 whose one state is official state 5."""
    from embodirl.config import compose
    from embodirl.envs.libero import states
    from embodirl.envs.libero.suite import suite_info
    from embodirl.envs.registry import env_config

    info = suite_info(env_config(compose(["env=libero_10"]).env.train, "env.train"))
    sampler = states.Sampler(info.bddl_files[0])
    positions = sampler.positions
    sampler.close()
    return states.save_state_file(tmp_path / "copied.npz", "libero_10",
                                  {0: states.StateSet(info.init_states(0)[5:6], positions)})


@pytest.mark.parametrize("overrides, key", [
    (["env=libero_10", "model=openvla_oft_tiny", "env.train.init_state_ids=[0,1]"], "env.train.init_state_ids"),
    (["env.train.init_state_ids=[3,1073741830]"], "env.train.init_state_ids"),                      # ManiSkill
    (["env=libero_10", "model=openvla_oft_tiny", "env.train.task_ids=[0]", "FILE"], "env.train.train_init_states"),
    (["env=libero_10", "model=openvla_oft_tiny", "env.eval.init_state_ids=[1073741825]"], "env.eval.init_state_ids"),
])
def test_training_from_evaluation_states_is_refused_in_one_sentence(overrides, key, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    if "FILE" in overrides:
        overrides = [o for o in overrides if o != "FILE"] + [f"env.train.train_init_states={_official_copy(tmp_path)}"]
    proc = run(["train", *overrides], work)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = lines[0]
    assert line.startswith(f"embodirl: {key}: training would start from ") and "that evaluation runs too" in line
    assert line.count(". ") == 0 and line.count("; ") == 1, line                           # one sentence, one fix
    fix = "runner.eval_train_states_per_task" if key.startswith("env.eval") else "env.train.train_init_states=official"
    assert fix in line, line
    assert list(work.iterdir()) == [], "a refused config must not create anything on disk"


def test_official_training_states_run_on_purpose_and_the_report_says_so(tmp_path):
    proc = run(["train", *SMALL_MANISKILL, "env.train.train_init_states=official", "runner.max_steps=1",
                "runner.val_check_interval=1", "runner.experiment_name=official"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads((tmp_path / "outputs" / "official" / "eval" / "step_1" / "eval_info.json").read_text())
    assert info["init_states"]["disjoint"] is False and "on purpose" in info["init_states"]["detail"]
    assert "training and evaluation states meet" in proc.stdout + proc.stderr


def test_evaluation_reports_success_on_training_states_apart(tmp_path):
    proc = run(["eval", *SMALL_MANISKILL, "runner.eval_train_states_per_task=3", "runner.experiment_name=gap"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads((tmp_path / "outputs" / "gap" / "eval_info.json").read_text())
    assert info["init_states"]["disjoint"] is True
    assert [e["init_state_id"] for e in info["per_episode"]] == [0, 1]                     # the evaluation's seeds
    trained = info["training_states"]
    assert [e["init_state_id"] for e in trained["per_episode"]] == [TRAIN_INIT_STATE_BASE + j for j in range(3)]
    assert [e["episode_ix"] for e in trained["per_episode"]] == [2, 3, 4]
    overall = trained["overall"]
    assert overall["n_episodes"] == 3 and len(trained["per_task"]) == 1
    low, high = overall["success_rate_ci95"]
    assert 0.0 <= low <= overall["success_rate"] <= high <= 1.0 and high - low > 0.3         # Wilson, 3 episodes
    assert "on training states" in proc.stdout and "success on training states" in proc.stdout


@pytest.mark.parametrize("overrides, ok, fragment", [
    ([], True, "apart from the evaluation's (held out)"),
    (["env.train.train_init_states=official"], True, "on purpose"),
    (["env.train.init_state_ids=[3]"], False, "env.train.init_state_ids: training would start from 1 init state"),
])
def test_doctor_reports_whether_training_and_evaluation_states_meet(overrides, ok, fragment, tmp_path):
    proc = run(["doctor", *overrides], tmp_path)
    table = rows(proc.stdout)
    assert table["heldout"][0] == ("PASS" if ok else "FAIL"), proc.stdout
    assert fragment in table["heldout"][1], proc.stdout
    if not ok:
        assert "heldout" in failing(proc.stdout) and "env.train.train_init_states=official" in table["heldout.fix"][1]
