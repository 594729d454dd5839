"""The collapse guard (runner.guard) through the CLI, on runs made to collapse on purpose: the state policy on the
toy task with a learning rate that warms up to 0.03 (100x the default) first learns, then falls apart (here: 0.62 at
step 20, then 0.25 / 0.38 / 0.06 / 0.12 / 0.19). The guard rolls it back to its best evaluation with a tenth of the
learning rate and the run finishes; ``action: stop`` ends it with one sentence naming the best checkpoint; a
non-finite update (a learning rate of 1e30) trips it too, instead of stopping the run."""

from __future__ import annotations

from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

TOY = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.cameras=[]",
       "env.eval.cameras=[]", "env.train.num_envs=8", "env.eval.num_envs=8", "env.train.reward_mode=dense",
       "env.eval.reward_mode=dense", "runner.eval_episodes_per_task=4", "runner.eval_num_videos=0",
       "runner.progress_bar=false", "runner.logger.tensorboard=false", "runner.save_interval=0"]
COLLAPSE = ["runner.max_steps=40", "runner.val_check_interval=4", "actor.optim.lr=0.03", "actor.optim.value_lr=3e-4",
            "actor.optim.warmup_steps=160"]
GUARD = ["runner.guard.enabled=true", "runner.guard.success_drop=0.2", "runner.guard.lr_factor=0.1"]


def cli(args, cwd):
    return cli_runs.run(["train", *TOY, *args], cwd, timeout=900)


def evals_and_events(out):
    records = read_metrics(out / "metrics.jsonl")
    evals = [(r["step"], r["eval/success_rate"]) for r in records if "eval/success_rate" in r]
    return evals, [r for r in records if r.get("event") == "guard"]


def test_the_guard_rolls_a_collapsing_run_back_and_it_finishes(tmp_path):
    proc = cli([*COLLAPSE, *GUARD, f"runner.output_dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals, events = evals_and_events(tmp_path / "run")
    assert [s for s, _ in evals] == list(range(4, 41, 4))           # the run went on to its last step
    assert events, f"the guard never tripped: {evals}"
    first = events[0]
    before = [(s, v) for s, v in evals if s <= first["step"]]
    best_step, best = max(reversed(before), key=lambda e: e[1])      # the first evaluation at the best success
    assert first["guard/rolled_back_to"] == best_step and first["guard/lr_scale"] == 0.1
    assert "rolling back to step" in first["message"] and f"[guard] {first['message']}" in proc.stdout
    # the two evaluations that tripped it were more than 0.2 below the best
    assert all(v < best - 0.2 for _, v in before[-2:])
    assert (tmp_path / "run" / "checkpoints" / f"step_{best_step}").is_dir()    # the rollback target was kept


def test_action_stop_ends_the_run_with_one_sentence(tmp_path):
    proc = cli([*COLLAPSE, *GUARD, "runner.guard.action=stop", f"runner.output_dir={tmp_path / 'run'}"], tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("embodirl: the collapse guard stopped the run at step") and "best checkpoint is" in lines[0]
    evals, events = evals_and_events(tmp_path / "run")
    assert len(events) == 1 and evals[-1][0] == events[0]["step"] < 40


def test_a_non_finite_update_trips_the_guard_instead_of_stopping(tmp_path):
    huge = ["runner.max_steps=6", "runner.val_check_interval=3", "actor.optim.lr=1e30", "actor.optim.value_lr=1e30"]
    proc = cli([*huge, f"runner.output_dir={tmp_path / 'stop'}"], tmp_path)
    assert proc.returncode == 1 and "is inf" in proc.stderr and "training step 1" in proc.stderr, proc.stderr[-2000:]
    # with the guard: rolled back to the start (no evaluation yet) with the learning rate x1e-32, and on to the end
    proc = cli([*huge, "runner.guard.enabled=true", "runner.guard.lr_factor=1e-32", f"runner.output_dir={tmp_path / 'go'}"],
               tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals, events = evals_and_events(tmp_path / "go")
    assert events[0]["step"] == 1 and events[0]["guard/rolled_back_to"] == 0 and "is inf" in events[0]["message"]
    assert [s for s, _ in evals] == [3, 6]
