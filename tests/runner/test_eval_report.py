"""Evaluation reports: Wilson intervals against published values, and a real evaluation through the CLI
writing them with LeRobot's keys, per-episode task / init state / seed, videos in ``eval/step_<n>/videos/``
(not doubled), error bars in the PNG, and ``runner.eval_episodes`` re-running chosen episodes with video."""

from __future__ import annotations

import json

import pytest
from scipy.stats import binomtest

from embodirl.runner.eval_report import success_figure, wilson_interval
from embodirl.runner.metrics_logger import read_metrics
from tests import cli_runs

TOY = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.num_envs=4",
       "env.eval.num_envs=4", "runner.progress_bar=false", "runner.logger.tensorboard=false"]
LEROBOT_OVERALL = ("pc_success", "avg_sum_reward", "avg_max_reward", "n_episodes", "eval_s", "eval_ep_s", "video_paths")

# Newcombe (1998), "Two-sided confidence intervals for the single proportion", Stat. Med. 17:857, Table II,
# method 3 (Wilson score interval without continuity correction)
NEWCOMBE = [((81, 263), (0.2553, 0.3662)), ((15, 148), (0.0624, 0.1605)), ((0, 20), (0.0, 0.1611)),
            ((1, 29), (0.0061, 0.1718))]


@pytest.mark.parametrize("counts, expected", NEWCOMBE)
def test_wilson_interval_matches_published_values(counts, expected):
    low, high = wilson_interval(*counts)
    assert (round(low, 4), round(high, 4)) == expected


@pytest.mark.parametrize("k, n", [(0, 1), (1, 1), (5, 10), (45, 50), (250, 500), (499, 500)])
def test_wilson_interval_matches_scipy(k, n):
    reference = binomtest(k, n).proportion_ci(0.95, method="wilson")
    assert wilson_interval(k, n) == pytest.approx((reference.low, reference.high), abs=1e-12)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def cli(args, cwd):
    return cli_runs.run(args, cwd, expect=0)


def test_eval_info_intervals_lerobot_keys_and_rerun_of_chosen_episodes(tmp_path):
    proc = cli(["eval", *TOY, "runner.eval_episodes_per_task=2", "runner.eval_num_videos=2",
                "runner.experiment_name=full"], tmp_path)
    out = tmp_path / "outputs" / "full"
    info = json.loads((out / "eval_info.json").read_text())
    o = info["overall"]
    n, k = o["n_episodes"], o["n_successes"]
    assert n == len(info["per_episode"]) and o["success_rate"] == k / n
    assert o["success_rate_ci95"] == pytest.approx(wilson_interval(k, n), abs=1e-6)
    assert set(LEROBOT_OVERALL) <= set(o) and o["pc_success"] == pytest.approx(100 * k / n)
    assert o["eval_ep_s"] == pytest.approx(o["eval_s"] / n, rel=1e-2)
    for task in info["per_task"]:
        assert task["success_rate_ci95"] == pytest.approx(wilson_interval(task["n_successes"], task["n_episodes"]),
                                                          abs=1e-6)
        assert task["task_group"] == task["suite"] and len(task["metrics"]["successes"]) == task["n_episodes"]
    assert info["per_group"] == info["per_suite"] and all("pc_success" in g for g in info["per_group"].values())
    seeds = [ep["seed"] for ep in info["per_episode"]]
    assert len(set(seeds)) == n and all(ep["max_reward"] is not None for ep in info["per_episode"])
    for ep in info["per_episode"]:
        assert {"task_id", "task", "init_state_id", "seed", "sum_reward", "max_reward", "success"} <= set(ep)
    # videos straight in <out>/videos/ (evaluation-only runs: the run folder is the evaluation's folder)
    assert o["video_paths"] and all(p.startswith("videos/") and p.count("/") == 1 for p in o["video_paths"])
    assert "95 % interval" in proc.stdout or "interval" in proc.stdout
    # the PNG's bars carry their intervals as error bars
    fig = success_figure(info)
    assert any(type(c).__name__ == "BarContainer" for c in fig.axes[0].containers)
    assert any(type(c).__name__ == "ErrorbarContainer" for c in fig.axes[0].containers)
    assert (out / "eval_success.png").is_file()

    # re-run two chosen episodes: the same outcomes, each with its video
    chosen = [1, n - 1]
    cli(["eval", *TOY, "runner.eval_episodes_per_task=2", "runner.eval_num_videos=0", "runner.experiment_name=again",
         f"runner.eval_episodes=[{chosen[0]},{chosen[1]}]"], tmp_path)
    again = json.loads((tmp_path / "outputs" / "again" / "eval_info.json").read_text())
    assert [ep["episode_ix"] for ep in again["per_episode"]] == chosen
    for ep in again["per_episode"]:
        before = info["per_episode"][ep["episode_ix"]]
        for key in ("task_id", "init_state_id", "seed", "success", "return", "length"):
            assert ep[key] == before[key], key
        assert ep["video_path"] and (tmp_path / "outputs" / "again" / ep["video_path"]).is_file()


def test_eval_episodes_is_checked_before_anything_starts(tmp_path):
    proc = cli_runs.run(["eval", *TOY, "runner.eval_episodes=[-1]"], tmp_path, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "runner.eval_episodes" in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_training_dashboards_curve_png_and_tensorboard_media(tmp_path):
    """A real training run: learning_curve.png in the run folder after every evaluation, and TensorBoard's event
    files hold the evaluation video (an animated GIF), the curve image and the hyper-parameters."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli(["train", *[a for a in TOY if "tensorboard" not in a], "runner.max_steps=2", "runner.val_check_interval=1",
         "runner.save_interval=0", "runner.eval_episodes_per_task=1", "runner.eval_num_videos=1",
         "runner.experiment_name=dash"], tmp_path)
    out = tmp_path / "outputs" / "dash"
    assert (out / "learning_curve.png").is_file()
    # one step-folder format: eval/step_<n>/ with the videos straight in videos/
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["step_1", "step_2"]
    assert list((out / "eval" / "step_2" / "videos").glob("*.mp4"))
    assert not list((out / "eval" / "step_2" / "videos").glob("step_*"))
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    images = events.Tags()["images"]
    assert "eval/learning_curve" in images and "eval/video_0" in images
    assert [e.step for e in events.Images("eval/learning_curve")] == [1, 2]
    video = events.Images("eval/video_0")[-1]
    assert video.encoded_image_string[:4] == b"GIF8"
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")
    metrics = [r for r in read_metrics(out / "metrics.jsonl") if "eval/success_rate" in r]
    assert all(r["eval/success_rate_ci95_low"] <= r["eval/success_rate"] <= r["eval/success_rate_ci95_high"]
               for r in metrics)


def test_identical_per_episode_outcomes_at_one_and_several_simulator_processes(tmp_path):
    """The in-process evaluation path at 1 and at 4 simulator processes (runner.eval_num_envs): the same episodes,
    the same outcomes."""
    from embodirl.config import compose, validate
    from embodirl.errors import ConfigError

    runs = {}
    for n in (1, 4):
        # dense rewards: each episode's return traces its whole trajectory, so equal returns mean equal episodes
        cli(["eval", *TOY, "env.eval.processes=true", "env.eval.reward_mode=dense", "env.eval.step_size=0.3",
             "runner.eval_episodes_per_task=3", "runner.eval_num_videos=0",
             f"runner.eval_num_envs={n}", f"runner.experiment_name=p{n}"], tmp_path)
        runs[n] = json.loads((tmp_path / "outputs" / f"p{n}" / "eval_info.json").read_text())["per_episode"]
    assert len(runs[1]) == len(runs[4]) == 12
    assert len({round(ep["return"], 6) for ep in runs[1]}) > 6          # episodes that differ from each other
    for one, four in zip(runs[1], runs[4], strict=True):
        for key in ("episode_ix", "task_id", "init_state_id", "seed", "success", "length"):
            assert one[key] == four[key], key
        # a batch of 1 and a batch of 4 may sum in another order (BLAS kernels differ per CPU): float rounding only
        assert one["return"] == pytest.approx(four["return"], rel=1e-5, abs=1e-6)
    with pytest.raises(ConfigError, match="runner.eval_num_envs"):
        validate(compose([*TOY, "runner.eval_num_envs=0"]))
