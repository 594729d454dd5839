"""``embodirl doctor --bench``: the table through the real command (every part of the step, exit 0), a training run
that writes its prediction and its measured phase times into ``prediction.json``, and the prediction's arithmetic
against the recipe (rollouts, pipeline stages, simulators beyond the cores, devices) on hand-made calibrations."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from embodirl.calibration.measure import Calibration
from embodirl.calibration.predict import Recipe, predict
from embodirl.calibration.report import measured_times, record_measured
from tests import cli_runs

TOY = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.num_envs=4",
       "runner.progress_bar=false", "runner.logger.tensorboard=false"]
ROWS = ("env physics", "render (per camera)", "env (chunks + resets)", "inference (act)", "collect (overlapped)",
        "update", "sync weights", "step", "bottleneck:", "device-hours")


def test_doctor_bench_prints_every_part(tmp_path):
    proc = cli_runs.run(["doctor", "--bench", *TOY, "--gpus", "2"], tmp_path, env=dict(os.environ), timeout=300,
                        expect=0)
    for row in ROWS:
        assert row in proc.stdout, proc.stdout
    assert "on 2 device(s)" in proc.stdout
    assert not (tmp_path / "outputs").exists()          # a bench writes nothing


def test_bad_gpus_is_one_sentence(tmp_path):
    proc = cli_runs.run(["doctor", "--bench", "--gpus", "zero"], tmp_path, timeout=120, expect=2)
    assert "--gpus takes a number" in proc.stderr


def test_run_writes_prediction_and_measured_times(tmp_path):
    cli_runs.run(["train", *TOY, "runner.max_steps=2", "runner.val_check_interval=0", "runner.save_interval=0",
                  "runner.predict_step_time=true", "runner.experiment_name=bench"], tmp_path, timeout=300, expect=0)
    record = json.loads((tmp_path / "outputs" / "bench" / "prediction.json").read_text())
    assert record["predicted"]["step_s"] > 0 and record["calibration"]["act_per_s"] > 0
    assert record["measured"]["steps"] == 2 and record["measured"]["first_step_excluded"]
    assert record["ratio"]["step_s"] == pytest.approx(record["predicted"]["step_s"] / record["measured"]["step_s"])


CAL = Calibration(cores=2, load=0.0, device="cpu", envs=4, chunk_len=4, cameras=1, physics_ms=1.0, decision_ms=2.0,
                  render_ms=2.0, reset_ms=10.0, overhead_ms=0.0, act_batch=4, act_per_s=100.0, update_per_s=1000.0,
                  valid_fraction=1.0, sync_s=0.5, trainable_mb=1.0, seconds=1.0)
RECIPE = Recipe(num_envs=2, env_workers=1, stages=1, envs_per_stage=2, inference_workers=1, decisions=10, chunk=4,
                rollout_epoch=1, update_epochs=2, recompute_logprob=False, group_size=1, global_batch_size=2,
                micro_batch_size=2, max_steps=100, actor_ranks=1, acting_copy=False)


def test_collect_follows_the_recipe():
    base = predict(CAL, RECIPE)
    # one stage, two simulators on two cores: a chunk (4 x 1 ms + 2 ms) then act (2 decisions at 100/s), 10 times,
    # plus one reset (10 ms)
    assert base.collect_s == pytest.approx(10 * (0.006 + 0.02) + 0.010)
    twice = predict(CAL, dataclasses.replace(RECIPE, rollout_epoch=2))
    assert twice.collect_s == pytest.approx(2 * base.collect_s)
    assert twice.update_s == pytest.approx(2 * base.update_s)         # twice the decisions to train on
    assert base.update_s == pytest.approx(2 * 10 * 2 / 1000.0)      # N x T x update_epochs / rate
    assert base.sync_s == 0.0                                        # in process: the actor's module acts
    assert predict(CAL, dataclasses.replace(RECIPE, acting_copy=True)).sync_s == 0.5
    assert base.step_s == pytest.approx(base.collect_s + base.update_s + base.sync_s)


def test_more_simulators_than_cores_share_them():
    two = predict(CAL, RECIPE)                                      # 2 simulators, 2 cores
    eight = predict(CAL, dataclasses.replace(RECIPE, num_envs=8, envs_per_stage=8))
    # 8 simulators on 2 cores: each chunk takes 4x as long, and nothing overlaps with the policy on those cores
    assert eight.env_s == pytest.approx(4 * two.env_s)
    four_workers = predict(CAL, dataclasses.replace(RECIPE, num_envs=8, env_workers=4, inference_workers=4))
    assert four_workers.env_s == pytest.approx(4 * two.env_s)       # 4 workers x 2 simulators on 2 cores: the same
    on_gpu = predict(CAL, dataclasses.replace(RECIPE, num_envs=8, envs_per_stage=4, stages=2), accelerator=True)
    on_cpu = predict(CAL, dataclasses.replace(RECIPE, num_envs=8, envs_per_stage=4, stages=2))
    assert on_gpu.collect_s < on_cpu.collect_s                      # stages overlap only when the policy has its own device
    assert on_cpu.collect_s == pytest.approx(on_cpu.env_s + on_cpu.inference_s)


def test_devices_and_bound():
    one, eight = predict(CAL, RECIPE), predict(CAL, RECIPE, gpus=8)
    assert eight.update_s == pytest.approx(one.update_s / 8)
    assert eight.device_hours == pytest.approx(eight.wall_h * 8)
    assert one.wall_h == pytest.approx(one.step_s * 100 / 3600)
    assert one.bottleneck == "inference" and one.bound_s == one.inference_s and one.step_over_bound >= 1.0


def test_measured_medians_skip_the_first_step(tmp_path):
    rows = [{"step": i, "time/collect": c, "time/update": 1.0, "time/publish_weights": 0.0, "time/step": c + 1.0}
            for i, c in enumerate([9.0, 2.0, 3.0, 4.0], start=1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = measured_times(tmp_path / "metrics.jsonl")
    assert m["collect_s"] == 3.0 and m["step_s"] == 4.0 and m["first_step_s"] == 10.0 and m["steps"] == 4
    (tmp_path / "prediction.json").write_text(json.dumps({"predicted": {"collect_s": 3.0, "update_s": 2.0,
                                                                        "sync_s": 0.0, "step_s": 5.0}}))
    record = record_measured(tmp_path)
    assert record["ratio"] == {"collect_s": 1.0, "update_s": 2.0, "step_s": 1.25}
