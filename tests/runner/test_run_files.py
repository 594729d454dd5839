"""A run's checkpoint files that are not what the run wrote, through the CLI (the toy task, the state policy): a
checkpoint cut short by an interrupted copy is passed over for the previous complete one with a warning, or refused in
one sentence when named explicitly; a malformed ``runner/state.json`` or collapse-guard state is one sentence naming
the file, not a traceback; a non-finite update on the last step that the guard rolls back still makes the final
save."""

from __future__ import annotations

import json
import shutil

import pytest

from embodirl.checkpoint_layout import COMPLETE
from embodirl.runner import checkpoint as ckpt
from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

TOY = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.num_envs=4",
       "env.eval.num_envs=4", "runner.progress_bar=false", "runner.logger.tensorboard=false",
       "runner.val_check_interval=0", "runner.save_interval=2"]


def train(cwd, name: str, *args: str, expect: int | None = 0):
    return cli_runs.run(["train", *TOY, f"runner.experiment_name={name}", *args], cwd, expect=expect)


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """A run of 4 steps with checkpoints at steps 2 and 4."""
    cwd = tmp_path_factory.mktemp("files")
    train(cwd, "run", "runner.max_steps=4")
    return cwd


def copy_run(cwd, name: str):
    shutil.copytree(cwd / "outputs" / "run", cwd / "outputs" / name)
    return cwd / "outputs" / name


def one_sentence(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_a_checkpoint_cut_short_by_a_copy_is_passed_over_for_the_previous_one(run4):
    out = copy_run(run4, "copied")
    step4 = ckpt.checkpoint_root(out) / "step_4"
    listed = json.loads((step4 / COMPLETE).read_text())["files"]
    name = next(n for n in listed if n.startswith("actor/tensors/"))
    with open(step4 / name, "r+b") as f:           # as an interrupted cp leaves it: the marker in place, a file short
        f.truncate(listed[name] // 2)
    # named explicitly, it is refused in one sentence that names the one to use
    line = one_sentence(train(run4, "again", "runner.max_steps=5", f"runner.resume_dir={step4}", expect=None))
    assert line.startswith(f"embodirl: runner.resume_dir: '{step4}' is incomplete ({name} has") and "step_2" in line
    # the run folder: resumed from step 2 with a warning
    proc = train(run4, "copied", "runner.max_steps=5")
    output = proc.stdout + proc.stderr
    assert (f"checkpoint outputs/copied/checkpoints/step_4 is incomplete ({name} has {listed[name] // 2} bytes, not "
            f"the {listed[name]} its COMPLETE marker lists") in output, output[-3000:]
    assert "resumed from outputs/copied/checkpoints/step_2 (step 2)" in output
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("what, edit, reason", [
    ("state", lambda state: "{\"step\": 4, \"starts_rng\": ", "not JSON"),
    ("guard", lambda state: json.dumps({**json.loads(state), "guard": {"rollbacks": "two"}}),
     "its 'guard' entry is not the collapse guard's state: 'rollbacks' is 'two'"),
])
def test_malformed_runner_state_is_one_sentence_naming_the_file(run4, what, edit, reason):
    out = copy_run(run4, f"bad_{what}")
    state = ckpt.checkpoint_root(out) / "step_4" / "runner" / "state.json"
    state.write_text(edit(state.read_text()))
    listed = json.loads((state.parents[1] / COMPLETE).read_text())
    listed["files"]["runner/state.json"] = state.stat().st_size     # edited, not cut short: the sizes match
    (state.parents[1] / COMPLETE).write_text(json.dumps(listed))
    line = one_sentence(train(run4, f"bad_{what}", "runner.max_steps=5", expect=None))
    assert line.startswith(f"embodirl: runner.resume_dir: cannot resume from outputs/bad_{what}/checkpoints/step_4/"
                           f"runner/state.json: it is malformed ({reason}") and "runner.resume_dir=" in line, line


def test_a_rolled_back_last_step_still_makes_the_final_save(tmp_path):
    """A learning rate of 1e30 makes the only step's update non-finite; the guard rolls it back to the start."""
    proc = train(tmp_path, "last", "runner.max_steps=1", "runner.save_interval=5", "actor.optim.lr=1e30",
                 "actor.optim.value_lr=1e30", "runner.guard.enabled=true", "runner.guard.success_drop=null")
    records = read_metrics(tmp_path / "outputs" / "last" / "metrics.jsonl")
    assert [r["event"] for r in records if "event" in r] == ["guard"], proc.stdout[-3000:]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "outputs" / "last")] == ["step_0", "step_1"]
