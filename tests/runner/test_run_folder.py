"""A run owns its folder, through the real CLI on the toy task with the state policy: the lock and its holder, a hand
sweep that changes only a hyper-parameter (one command after the other, and two at once), a folder already at
``runner.max_steps``, a fresh start into a run's folder, ``runner.keep_last``, a torn ``metrics.jsonl`` line, a full
disk, and an evaluation that scores exactly the weights it names and says which."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import time

from embodirl.runner import checkpoint as ckpt
from embodirl.runner.metrics_logger import read_metrics
from embodirl.runner.weights import weights_digest
from tests import cli_runs

BASE = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.num_envs=4",
        "env.eval.num_envs=4", "runner.progress_bar=false", "runner.logger.tensorboard=false",
        "runner.val_check_interval=0"]
#: dense rewards: an episode's return traces its whole trajectory, so other weights give other returns
EVAL = ["env.eval.reward_mode=dense", "env.eval.step_size=0.3", "runner.eval_episodes_per_task=2",
        "runner.eval_num_videos=0"]
RUN = ("outputs", "toy_reach_state_mlp")          # the default folder of `embodirl train` with BASE
EXIT_ALREADY_TRAINED = 3


def files(folder) -> dict[str, bytes]:
    """Every file of a folder and its bytes (the lock file aside: a refused run may take and drop the lock)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def sentence(proc) -> str:
    """The refusal: the last line on standard error, the only one starting with 'embodirl:'."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("embodirl:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def steps(folder) -> list[int]:
    return [r["step"] for r in read_metrics(folder / "metrics.jsonl") if "train/return" in r]


def test_a_hand_sweep_one_command_after_the_other_never_trains_nothing(tmp_path):
    """`embodirl train lr=1e-4`, then `lr=3e-4` into the same (default) folder: the second used to resume the first's
    last checkpoint at max_steps, train nothing and exit 0, its config.yaml beside the first run's metrics."""
    run = tmp_path.joinpath(*RUN)
    cli_runs.run(["train", *BASE, "actor.optim.lr=1e-4", "runner.max_steps=3", "runner.save_interval=3"], tmp_path,
                 expect=0)
    written = files(run)
    other = cli_runs.run(["train", *BASE, "actor.optim.lr=3e-4", "runner.max_steps=3", "runner.save_interval=3"],
                         tmp_path, expect=2)
    refusal = sentence(other)
    assert refusal.startswith(f"embodirl: runner.output_dir: outputs/{RUN[1]} holds a run (checkpoints up to step_3")
    assert "trained with actor.optim.lr=0.0001 (this run: 0.0003)" in refusal
    assert "runner.experiment_name=<name>" in refusal
    # the same settings again: nothing to train, said so, status 3
    again = cli_runs.run(["train", *BASE, "actor.optim.lr=1e-4", "runner.max_steps=3", "runner.save_interval=3"],
                         tmp_path, expect=EXIT_ALREADY_TRAINED)
    assert f"outputs/{RUN[1]} is already trained to step 3 (runner.max_steps=3)" in sentence(again)
    # a fresh start over it is refused too
    fresh = cli_runs.run(["train", *BASE, "actor.optim.lr=1e-4", "runner.max_steps=3", "runner.resume_mode=disable"],
                         tmp_path, expect=2)
    assert sentence(fresh).startswith("embodirl: runner.resume_mode: is disable, a fresh start, but")
    assert files(run) == written                  # nothing of the first run was touched
    # the same hyper-parameters with more steps (and another save interval): the run goes on
    more = cli_runs.run(["train", *BASE, "actor.optim.lr=1e-4", "runner.max_steps=4", "runner.save_interval=2"],
                        tmp_path, expect=0)
    assert f"resumed from outputs/{RUN[1]}/checkpoints/step_3 (step 3)" in more.stdout + more.stderr
    assert steps(run) == [1, 2, 3, 4]


def test_a_hand_sweep_two_commands_at_once_trains_one_run(tmp_path):
    """Two terminals, `lr=1e-4` and `lr=3e-4`, into one folder at once: they used to write one folder together. Now
    one trains, the other is refused (the folder is held, or holds the other's run), whichever starts first."""
    run = tmp_path.joinpath(*RUN)
    procs = {lr: cli_runs.start(["train", *BASE, f"actor.optim.lr={lr}", "runner.max_steps=3",
                                 "runner.save_interval=3"], tmp_path) for lr in ("0.0001", "0.0003")}
    outputs = {lr: proc.communicate(timeout=300)[0] for lr, proc in procs.items()}
    codes = {lr: proc.returncode for lr, proc in procs.items()}
    assert sorted(codes.values()) == [0, 2], outputs
    winner = next(lr for lr, code in codes.items() if code == 0)
    loser = next(lr for lr, code in codes.items() if code == 2)
    refusal = [line for line in outputs[loser].splitlines() if line.startswith("embodirl:")]
    assert len(refusal) == 1 and ("is in use by another run (pid" in refusal[0]
                                  or f"trained with actor.optim.lr={winner}" in refusal[0]), outputs[loser]
    assert steps(run) == [1, 2, 3]
    assert f"lr: {winner}" in (run / "config.yaml").read_text()


def test_a_run_holds_its_folder_until_it_ends(tmp_path):
    """A second run into a folder a running run holds is refused, naming the holder; once the holder is killed
    (SIGKILL: no clean-up of its own) the folder is free."""
    run = tmp_path.joinpath(*RUN)
    holder = cli_runs.start(["train", *BASE, "runner.max_steps=100000", "runner.save_interval=0"], tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not read_metrics_lines(run):
            assert holder.poll() is None, holder.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the first run never logged a step"
            time.sleep(0.05)
        train = cli_runs.run(["train", *BASE, "runner.max_steps=2"], tmp_path, expect=2)
        assert sentence(train).startswith(f"embodirl: runner.output_dir: outputs/{RUN[1]} is in use by another run "
                                          f"(pid {holder.pid} on {socket.gethostname()} since ")
        evaluation = cli_runs.run(["eval", *BASE, *EVAL, f"runner.output_dir={run}"], tmp_path, expect=2)
        assert f"{run} is in use by another run (pid {holder.pid} on" in sentence(evaluation)
        assert holder.poll() is None                      # the holder goes on
    finally:
        holder.kill()
        holder.communicate(timeout=60)
    after = cli_runs.run(["train", *BASE, "runner.max_steps=2"], tmp_path, expect=0)
    assert "in use" not in after.stderr and steps(run) == [1, 2]


def read_metrics_lines(run) -> list[str]:
    path = run / "metrics.jsonl"
    return [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def test_keep_last_keeps_the_newest_the_latest_and_the_guards_best(tmp_path):
    cli_runs.run(["train", *BASE, "runner.max_steps=8", "runner.save_interval=2", "runner.experiment_name=default"],
                 tmp_path, expect=0)
    kept = [p.name for p in ckpt.list_checkpoints(tmp_path / "outputs" / "default")]
    assert kept == ["step_4", "step_6", "step_8"]                   # runner.keep_last: 3 by default
    # the collapse guard's best (here its checkpoint at the start, before any evaluation) is never removed
    cli_runs.run(["train", *BASE, "runner.max_steps=8", "runner.save_interval=2", "runner.keep_last=1",
                  "runner.guard.enabled=true", "runner.guard.success_drop=null", "runner.experiment_name=guarded"],
                 tmp_path, expect=0)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "outputs" / "guarded")] == ["step_0", "step_8"]
    everything = cli_runs.run(["train", *BASE, "runner.max_steps=4", "runner.save_interval=1", "runner.keep_last=null",
                               "runner.experiment_name=all"], tmp_path, expect=0)
    assert len(ckpt.list_checkpoints(tmp_path / "outputs" / "all")) == 4, everything.stdout[-2000:]


def test_a_torn_last_metrics_line_is_skipped_on_resume(tmp_path):
    """A power loss or a full disk mid-line used to stop every later resume with a JSONDecodeError."""
    out = tmp_path / "outputs" / "torn"
    cli_runs.run(["train", *BASE, "runner.max_steps=2", "runner.save_interval=2", "runner.experiment_name=torn"],
                 tmp_path, expect=0)
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])    # cut mid-record
    again = cli_runs.run(["train", *BASE, "runner.max_steps=3", "runner.save_interval=2", "runner.experiment_name=torn"],
                         tmp_path, expect=0)
    assert f"{metrics.relative_to(tmp_path)}: line 2 is not a JSON record (a write cut short); skipped" in \
        again.stdout + again.stderr
    assert steps(out) == [1, 3]                       # step 2's record was the torn line; step 3 follows on its line


def test_a_full_disk_is_one_sentence_and_keeps_the_last_checkpoint(tmp_path):
    """The checkpoint of step 4 cannot be written (a file-size limit on the process: the write fails with EFBIG, as
    it fails with ENOSPC on a full disk): one sentence naming the kept checkpoint, no temporary folder left, and the
    same command resumes from it once there is room. It used to end in torch's traceback."""
    out = tmp_path / "outputs" / "full"
    args = ["train", *BASE, "runner.save_interval=2", "runner.experiment_name=full"]
    cli_runs.run([*args, "runner.max_steps=2"], tmp_path, expect=0)
    step_2 = ckpt.latest_checkpoint(out)
    largest = max(p.stat().st_size for p in step_2.rglob("*") if p.is_file())   # the actor's tensors

    def limit_file_size():     # in the child: every file this process writes stays below the checkpoint's largest
        resource.setrlimit(resource.RLIMIT_FSIZE, (largest - 1, largest - 1))

    full = subprocess.run([*cli_runs.EXE, *args, "runner.max_steps=4"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, preexec_fn=limit_file_size)
    assert full.returncode == 1, full.stderr[-3000:]
    refusal = sentence(full)
    assert refusal.startswith("embodirl: no room left to write in outputs/full (File too large")
    assert "the last complete checkpoint, outputs/full/checkpoints/step_2, is kept" in refusal
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_2"]         # no temporary folder
    assert ckpt.latest_checkpoint(out) == step_2
    again = cli_runs.run([*args, "runner.max_steps=4"], tmp_path, expect=0)
    assert "resumed from outputs/full/checkpoints/step_2 (step 2)" in again.stdout + again.stderr
    assert steps(out) == [1, 2, 3, 4]


def returns(folder) -> list[float]:
    return [e["return"] for e in json.loads((folder / "eval_info.json").read_text())["per_episode"]]


def test_eval_scores_exactly_the_weights_it_names_in_a_folder_of_its_own(tmp_path):
    """`embodirl eval model.path=<weights>` after a training run with the same env and model used to evaluate in the
    run's folder, put the run's latest checkpoint on top of model.path and rewrite the run's config.yaml."""
    run = tmp_path.joinpath(*RUN)
    cli_runs.run(["train", *BASE, "actor.optim.lr=3e-3", "runner.max_steps=4", "runner.save_interval=2"], tmp_path,
                 expect=0)
    written = files(run)
    weights = run / "checkpoints" / "step_2" / "policy" / "trainable.safetensors"    # a state policy's weights file
    named = cli_runs.run(["eval", *BASE, *EVAL, f"model.path={weights}"], tmp_path, expect=0)
    own = tmp_path / "outputs" / "eval" / RUN[1]                    # the evaluation's own default folder
    record = json.loads((own / "eval_info.json").read_text())["weights"]
    assert record == {"kind": "model_path", "path": str(weights), "step": None, "sha256": weights_digest(weights)}
    assert f"weights: {weights}, sha256 {record['sha256']}" in named.stdout
    # a run checkpoint only when runner.resume_dir names it; a run folder names its latest
    cli_runs.run(["eval", *BASE, *EVAL, f"runner.resume_dir={run / 'checkpoints' / 'step_2'}",
                  "runner.experiment_name=step_2"], tmp_path, expect=0)
    latest = cli_runs.run(["eval", *BASE, *EVAL, f"runner.resume_dir={run}", "runner.experiment_name=latest"],
                          tmp_path, expect=0)
    record = json.loads((tmp_path / "outputs" / "latest" / "eval_info.json").read_text())["weights"]
    step_4 = (run / "checkpoints" / "step_4").absolute()
    assert (record["kind"], record["path"], record["step"]) == ("run_checkpoint", str(step_4), 4)
    assert record["sha256"] == weights_digest(step_4 / "policy")
    assert f"weights: {step_4} (step 4), sha256 {record['sha256']}" in latest.stdout
    assert returns(own) == returns(tmp_path / "outputs" / "step_2") != returns(tmp_path / "outputs" / "latest")
    # never into a training run's folder, nor over the evaluation of other weights
    into_run = cli_runs.run(["eval", *BASE, *EVAL, f"runner.resume_dir={run}", f"runner.experiment_name={RUN[1]}"],
                            tmp_path, expect=2)
    assert f"outputs/{RUN[1]} is a training run's folder" in sentence(into_run)
    over = cli_runs.run(["eval", *BASE, *EVAL, f"runner.resume_dir={run}"], tmp_path, expect=2)
    assert f"holds the evaluation of {weights}, not of these weights" in sentence(over)
    assert files(run) == written
