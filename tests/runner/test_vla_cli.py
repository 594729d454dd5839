"""``embodirl train`` / ``embodirl eval`` with the tiny OpenVLA-OFT on real LIBERO and ManiSkill through
the CLI (its own process and session): Ray env and inference workers with the shared-memory channel, GRPO updates,
weight sync, evaluation with video, training video, checkpoint, then evaluation of that checkpoint (ManiSkill's
through Ray again, LIBERO's on the in-process path).
Every run must leave no process of its session and no shared memory of its run behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import imageio.v3 as iio
import psutil
import pytest

from embodirl.channel import segments
from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

CLI_TIMEOUT_S = 900.0
CLEANUP_DEADLINE_S = 30.0
MAX_EPISODE_STEPS = 16          # two decisions of the 8-action chunk
# one evaluation simulator: it runs the evaluation's episodes in turn (LIBERO rebuilds its scene for the second
# task), the same episodes as two simulators would, with one simulator process fewer to start per run
SMALL = ["model=openvla_oft_tiny", "algorithm=grpo", "algorithm.group_size=2", "env.train.num_envs=2",
         "env.eval.num_envs=1", "env.train.use_fixed_reset_state_ids=true",
         f"env.train.max_episode_steps={MAX_EPISODE_STEPS}", f"env.eval.max_episode_steps={MAX_EPISODE_STEPS}",
         "env.train.image_size=[64,64]", "env.eval.image_size=[64,64]", "runner.progress_bar=false",
         "runner.logger.tensorboard=false", "runner.eval_num_videos=1"]
TRAIN = ["runner.max_steps=2", "runner.save_interval=2", "runner.val_check_interval=2",
         "runner.train_video_interval=2"]
TIME_KEYS = ("time/collect", "time/env", "time/inference", "time/channel_wait", "time/update", "time/publish_weights",
             "time/step")


def _session_members(sid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            pass
    return members


def cli(args: list[str], cwd, run_id: str, *, interrupt_when=None) -> str:
    """Run the CLI in its own session; returns its output. Fails if it exits non-zero or leaves a
    process of its session (Ray, workers, simulators) or a shared-memory entry of its run behind.
    ``interrupt_when``: a condition polled while the CLI runs; once true the CLI gets Ctrl-C (SIGINT)
    and only the clean-up is checked."""
    env = {**os.environ, segments.RUN_ENV: run_id}
    env.pop("RAY_ADDRESS", None)
    # a shell without job control starts background commands with SIGINT ignored, and that is inherited
    # (e.g. `bash .ci/run &`): the CLI gets the default disposition, as a terminal's Ctrl-C finds it
    proc = cli_runs.start(args, cwd, env=env, new_session=True, default_sigint=True)
    leftovers: list[psutil.Process] = []
    try:
        if interrupt_when is not None:
            deadline = time.monotonic() + CLI_TIMEOUT_S
            while not interrupt_when() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            output, _ = proc.communicate()
        deadline = time.monotonic() + CLEANUP_DEADLINE_S
        while (leftovers := _session_members(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for member in leftovers:           # this test started them: do not leave them to others
            member.kill()
        segments_left = segments.listing(segments.run_prefix(run_id))
        segments.sweep(segments.run_prefix(run_id))
    assert proc.returncode == 0 or interrupt_when is not None, output[-4000:]
    assert not leftovers, f"processes left running: {[(p.pid, p.name()) for p in leftovers]}"
    assert segments_left == [], segments_left
    return output


def check_video(path) -> None:
    frames = iio.imread(path)
    assert frames.ndim == 4 and frames.shape[0] >= 2 and frames.shape[-1] == 3, frames.shape


def check_eval(folder, *, n_episodes: int, n_tasks: int) -> dict:
    info = json.loads((folder / "eval_info.json").read_text())
    assert info["overall"]["n_episodes"] == n_episodes and len(info["per_episode"]) == n_episodes
    assert len(info["per_task"]) == n_tasks and sum(t["n_episodes"] for t in info["per_task"]) == n_episodes
    assert 0.0 <= info["overall"]["success_rate"] <= 1.0
    assert all(0 < e["length"] <= MAX_EPISODE_STEPS for e in info["per_episode"])
    videos = info["overall"]["video_paths"]
    assert len(videos) == 1 and info["per_episode"][0]["video_path"] == videos[0]
    check_video(folder / videos[0])
    assert (folder / "eval_success.png").is_file()
    return info


def train_and_eval(tmp_path, name: str, options: list[str], *, n_episodes: int, n_tasks: int,
                   eval_options: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """``eval_options``: overrides of the evaluation-only run alone (after ``options``)."""
    run = os.urandom(3).hex()
    output = cli(["train", *SMALL, *options, *TRAIN, f"runner.experiment_name={name}"], tmp_path, f"t{run}")
    assert "1 of 1 env workers stream observations through shared memory" in output
    out = tmp_path / "outputs" / name
    assert (out / "config.yaml").is_file()
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if "train/success_rate" in r]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert all(record[key] >= 0.0 for key in TIME_KEYS), record
        assert record["time/step"] >= record["time/collect"] + record["time/update"]
    # step 2 acted with the weights the sync after update 1 published
    assert [r["actor/version"] for r in train] == [1.0, 2.0]
    assert [r["rollout/weight_version"] for r in train] == [0.0, 1.0]
    assert [r["step"] for r in records if "eval/success_rate" in r] == [2]
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file()
    during = check_eval(out / "eval" / "step_2", n_episodes=n_episodes, n_tasks=n_tasks)
    train_videos = sorted((out / "videos" / "train" / "step_2").glob("*_env0_*_ep0_*.mp4"))
    assert len(train_videos) == 1
    check_video(train_videos[0])
    # evaluation only, of that checkpoint
    cli(["eval", *SMALL, *options, *eval_options, f"runner.resume_dir={out}", f"runner.experiment_name={name}_eval"],
        tmp_path, f"e{run}")
    after = check_eval(tmp_path / "outputs" / f"{name}_eval", n_episodes=n_episodes, n_tasks=n_tasks)
    return during, after


@pytest.mark.slow
def test_libero_grpo_with_tiny_openvla_through_ray_then_eval(tmp_path):
    # the actor as two gloo FSDP2 ranks (Ray actors). The checkpoint of that Ray run is then evaluated on the
    # in-process path (the driver's policy, the LIBERO simulator in a sub-process): no second Ray instance and no
    # Ray workers to start; the ManiSkill test below evaluates its checkpoint through Ray, so both paths are covered
    train_and_eval(tmp_path, "libero", ["env=libero_10", "env.train.task_ids=[0]", "env.eval.task_ids=[0,1]",
                                        "runner.eval_episodes_per_task=1", "actor.cpu_world_size=2"],
                   n_episodes=2, n_tasks=2, eval_options=("cluster.use_ray=false", "actor.cpu_world_size=1"))
    records = [r for r in read_metrics(tmp_path / "outputs" / "libero" / "metrics.jsonl") if "train/return" in r]
    assert [r["actor/world_size"] for r in records] == [2.0, 2.0]


@pytest.mark.slow
def test_maniskill_rgb_grpo_with_tiny_openvla_through_ray_then_eval(tmp_path):
    during, after = train_and_eval(tmp_path, "maniskill", ["env=maniskill_pickcube_rgb",
                                                           "runner.eval_episodes_per_task=2"], n_episodes=2, n_tasks=1)
    # greedy evaluation of the checkpoint replays the evaluation at its step: same weights in the inference
    # workers, same episodes (dense rewards, so any difference in actions shows in the returns)
    assert [e["return"] for e in after["per_episode"]] == [e["return"] for e in during["per_episode"]]


# --- the two paths on the toy task (seconds) ----------------------------------------------------------------
TOY = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.num_envs=4",
       "env.eval.num_envs=4", "runner.progress_bar=false", "runner.logger.tensorboard=false",
       "runner.val_check_interval=0", "runner.save_interval=2"]


def test_use_ray_choice_and_its_checks(compose_cfg):
    from embodirl.config import validate
    from embodirl.errors import ConfigError
    from embodirl.placement import use_ray

    assert not use_ray(compose_cfg())                                     # the default job stays in process
    assert use_ray(compose_cfg("model=openvla_oft_tiny"))
    assert use_ray(compose_cfg("model=pi0_tiny"))                         # VLA families are registered with ray
    assert use_ray(compose_cfg("env_workers.num_workers=2", "env.train.num_envs=8"))
    assert use_ray(compose_cfg("cluster.use_ray=true"))
    assert not use_ray(compose_cfg("model=openvla_oft_tiny", "cluster.use_ray=false"))
    with pytest.raises(ConfigError, match=r"^cluster.use_ray: 'sometimes' is not one of auto, true, false$"):
        validate(compose_cfg("cluster.use_ray=sometimes"), check_envs=False)
    with pytest.raises(ConfigError, match=r"^cluster.use_ray: false runs .* env_workers.num_workers = 2 needs Ray"):
        validate(compose_cfg("cluster.use_ray=false", "env_workers.num_workers=2"), check_envs=False)


def test_default_path_stays_in_process_and_writes_training_videos(tmp_path):
    output = cli(["train", *TOY, "runner.max_steps=2", "runner.train_video_interval=2", "runner.experiment_name=toy"],
                 tmp_path, f"i{os.urandom(3).hex()}")
    assert "Ray" not in output and "rollout transport" not in output
    out = tmp_path / "outputs" / "toy"
    assert not (out / "videos" / "train" / "step_1").exists()
    videos = sorted((out / "videos" / "train" / "step_2").glob("*.mp4"))
    assert [v.name.split("_task")[0] for v in videos] == ["toy_reach_env0"]
    check_video(videos[0])
    records = read_metrics(out / "metrics.jsonl")
    assert all(key in records[0] for key in TIME_KEYS)
    assert [r["rollout/weight_version"] for r in records] == [0.0, 1.0]


def test_ray_path_resumes_with_the_learners_weights(tmp_path):
    # an uninterrupted 3-step run (checkpoints at steps 2 and 3); then the same run as if it had been killed after
    # its step-2 checkpoint: the same command continues from step_2 and must repeat step 3 exactly
    common = [*TOY, "cluster.use_ray=true", "runner.max_steps=3"]
    run = os.urandom(3).hex()
    output = cli(["train", *common, "runner.experiment_name=toy_ray_straight"], tmp_path, f"a{run}")
    assert "1 of 1 env workers stream observations through shared memory" in output
    straight_dir, resumed_dir = tmp_path / "outputs" / "toy_ray_straight", tmp_path / "outputs" / "toy_ray"
    shutil.copytree(straight_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step_3")
    output = cli(["train", *common, "runner.experiment_name=toy_ray"], tmp_path, f"b{run}")
    assert "resumed from" in output
    records = read_metrics(resumed_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]                   # the killed run's step 3 is dropped
    # the resumed run's inference workers start from the checkpoint's weights at its version
    assert [r["actor/version"] for r in records] == [1.0, 2.0, 3.0]
    assert [r["rollout/weight_version"] for r in records] == [0.0, 1.0, 2.0]
    assert all(key in r for r in records for key in TIME_KEYS)
    # the inference worker's sampler continues from the checkpoint: step 3 equals the uninterrupted run's
    assert (resumed_dir / "checkpoints" / "step_2" / "runner" / "worker_rng.json").exists()
    assert (resumed_dir / "checkpoints" / "step_3" / "COMPLETE").is_file()     # written by the resumed run
    straight = read_metrics(straight_dir / "metrics.jsonl")
    for key in ("train/return", "train/success_rate", "actor/pg_loss", "critic/value_loss", "actor/approx_kl"):
        assert [r.get(key) for r in straight] == [r.get(key) for r in records], key


def test_ctrl_c_during_a_ray_run_leaves_nothing_behind(tmp_path):
    metrics = tmp_path / "outputs" / "toy_int" / "metrics.jsonl"
    output = cli(["train", *TOY, "cluster.use_ray=true", "runner.max_steps=100000", "runner.experiment_name=toy_int"],
                 tmp_path, f"c{os.urandom(3).hex()}",
                 interrupt_when=lambda: metrics.is_file() and metrics.stat().st_size > 0)
    assert "embodirl: interrupted" in output        # it was training (not finished, not failed) when interrupted
