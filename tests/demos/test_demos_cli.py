"""``embodirl demos``: expert demonstrations on real ManiSkill tasks, through the CLI, into a dataset the reader
reads back; the recorded actions replay in the adapter from the recorded init states."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from embodirl.cli import main
from embodirl.config import compose
from embodirl.demos.experts import EXPERTS
from embodirl.demos.lerobot.reader import LeRobotDataset
from embodirl.envs.maniskill.simulator import ManiSkillSimEnv
from tests import cli_runs

EXE = [sys.executable, "-m", "embodirl.cli"]


def _cli_error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["demos", *args])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err, err
    return err


@pytest.mark.parametrize("args, fragment", [
    (["num_episodes=0"], "num_episodes: must be a positive integer, got 0"),
    (["num_episodes=1.5"], "num_episodes: must be an integer, got '1.5'"),
    (["seed=-1"], "seed: must be a non-negative integer or null, got -1"),
    (["overwrite=maybe"], "overwrite: must be true or false, got 'maybe'"),
    (["max_attempts=1", "num_episodes=3"], "max_attempts: must be null or an integer >= num_episodes (3)"),
    (["video_codec=vp9"], "video_codec: 'vp9' is not one of libx264rgb, h264, libsvtav1"),
    (["env=maniskill_peginsertion"], "env.task: no demonstration expert for PegInsertionSide-v1"),
    (["env.train.control_mode=pd_joint_pos"], "env.control_mode: the experts act in pd_ee_delta_pos"),
    (["env=libero_10"], "env: demos are generated for ManiSkill env options only"),
    (["env=nope"], "env: unknown env 'nope'"),
    (["+frobnicate=1"], "frobnicate: is not a demos key"),
    (["env.train.cameras=[nocam]"], "env.cameras: PushCube-v1 has no camera nocam"),
])
def test_bad_settings_are_one_sentence_before_any_simulator(capsys, tmp_path, args, fragment):
    err = _cli_error(capsys, f"output_dir={tmp_path / 'out'}", *args)
    assert fragment in err
    assert not (tmp_path / "out").exists()


def test_an_existing_dataset_is_not_overwritten_unless_asked(capsys, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    err = _cli_error(capsys, f"output_dir={tmp_path / 'out'}")
    assert "output_dir:" in err and "overwrite=true" in err
    assert (tmp_path / "out" / "keep").exists()


def test_overwrite_replaces_only_a_dataset(capsys, tmp_path):
    """`embodirl demos output_dir=outputs overwrite=true` used to delete every run in outputs/ before generating."""
    runs = tmp_path / "outputs"
    (runs / "push" / "checkpoints").mkdir(parents=True)
    (runs / "push" / "metrics.jsonl").write_text("{}\n")
    err = _cli_error(capsys, "env=maniskill_pushcube", "num_episodes=1", f"output_dir={runs}", "overwrite=true")
    assert f"output_dir: {runs} is not a LeRobot dataset (no meta/info.json), and overwrite=true replaces only a " \
           "dataset" in err
    assert (runs / "push" / "metrics.jsonl").read_text() == "{}\n" and (runs / "push" / "checkpoints").is_dir()


def test_overwrite_keeps_the_old_dataset_until_the_new_one_is_complete(capsys, tmp_path):
    """A `demos overwrite=true` killed while it generates leaves the old dataset whole (it used to delete it first),
    and the next one replaces it, with no temporary folder left beside it."""
    out = tmp_path / "d"
    assert _demos(capsys, f"output_dir={out}", "num_episodes=1") == 0
    old = LeRobotDataset(out).episodes_meta
    proc = cli_runs.start(["demos", "env=maniskill_pushcube", "progress_bar=false", f"output_dir={out}",
                           "num_episodes=500", "overwrite=true"], tmp_path)
    try:
        deadline = time.monotonic() + 300
        # the new dataset is being written beside the old one (or, before, the old one was already deleted)
        while not ([p for p in tmp_path.iterdir() if p.name.startswith(".d.")]
                   or not (out / "meta" / "info.json").is_file()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-2000:]
            time.sleep(0.01)
        time.sleep(1.0)                                         # a few episodes into the new dataset
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert LeRobotDataset(out).episodes_meta == old
    assert _demos(capsys, f"output_dir={out}", "num_episodes=2", "seed=3", "overwrite=true") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert [r["init_state_id"] for r in LeRobotDataset(out).episodes_meta] == [3, 4]


def _demos(capsys, *args) -> int:
    with pytest.raises(SystemExit) as exit_:
        main(["demos", "env=maniskill_pushcube", "progress_bar=false", *args])
    capsys.readouterr()
    return exit_.value.code


def test_seed_stop_at_success_overwrite_and_max_attempts(capsys, tmp_path):
    out = tmp_path / "d"
    assert _demos(capsys, f"output_dir={out}", "num_episodes=2", "seed=7") == 0
    ds = LeRobotDataset(out)
    assert [r["init_state_id"] for r in ds.episodes_meta] == [7, 8]          # seed: the first init state
    assert ds.camera_keys == [] and max(ds.episode_lengths) < 20            # state obs; ends at success
    assert _demos(capsys, f"output_dir={out}", "num_episodes=1", "stop_at_success=false", "overwrite=true",
                  "env.train.max_episode_steps=20") == 0
    ds = LeRobotDataset(out)                                                 # replaced, runs to the time limit
    assert ds.num_episodes == 1 and ds.episode_lengths.tolist() == [20]
    # no seed: the first held-out training state, none of the evaluation's; with official, the evaluation's first
    assert [r["init_state_id"] for r in ds.episodes_meta] == [2**30]
    assert _demos(capsys, f"output_dir={out}", "num_episodes=1", "overwrite=true",
                  "env.train.train_init_states=official") == 0
    assert [r["init_state_id"] for r in LeRobotDataset(out).episodes_meta] == [0]
    # an expert that cannot finish in 3 steps: max_attempts bounds the attempts, exit status 1
    with pytest.raises(SystemExit) as exit_:
        main(["demos", "env=maniskill_pushcube", f"output_dir={tmp_path / 'e'}", "num_episodes=1", "max_attempts=2",
              "env.train.max_episode_steps=3", "progress_bar=false"])
    assert exit_.value.code == 1
    assert "only 0 of 1 episodes succeeded within 2 attempts" in capsys.readouterr().out
    assert json.loads((tmp_path / "e" / "meta" / "generation.json").read_text())["attempts"] == 2


@pytest.mark.parametrize("option", ["maniskill_pickcube", "maniskill_stackcube"])
def test_experts_solve_their_tasks_in_the_adapter(option):
    cfg = compose([f"env={option}"]).env.train
    env = ManiSkillSimEnv(cfg, seed=0)
    try:
        wins = 0
        for init_state in range(3):
            env.reset(init_state_id=init_state)
            expert = EXPERTS[cfg.task](env.unwrapped)
            for _ in range(cfg.max_episode_steps):
                result = env.step_chunk(expert(env.unwrapped)[None])
                if result.success or result.truncated:
                    break
            wins += result.success
        assert wins == 3
    finally:
        env.close()


@pytest.mark.slow
def test_demos_through_the_cli_read_back_and_replay(tmp_path):
    out = tmp_path / "pushcube"
    size = 32
    proc = subprocess.run([*EXE, "demos", "env=maniskill_pushcube_rgb", "num_episodes=2", f"output_dir={out}",
                           f"env.train.image_size=[{size},{size}]", "seed=5", "progress_bar=false"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 demos of PushCube-v1" in proc.stdout
    summary = json.loads((out / "meta" / "generation.json").read_text())
    assert summary["episodes"] == 2 and summary["attempts"] >= 2 and summary["image_size"] == [size, size]
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["features"]["observation.images.base_camera"]["info"]["video.codec"] == "libx264rgb"

    ds = LeRobotDataset(out, action_chunk=8)
    assert ds.num_episodes == 2 and ds.camera_keys == ["observation.images.base_camera"] and ds.action_dim == 4
    sample = ds[0]
    assert sample.images["observation.images.base_camera"].shape == (size, size, 3)
    assert sample.instruction == "push the blue cube to the red and white target"
    assert sample.actions.shape == (8, 4) and sample.proprio is not None

    # the recorded actions, replayed in the adapter from the recorded init states, succeed and see the same frames
    cfg = dict(compose(["env=maniskill_pushcube_rgb", f"env.train.image_size=[{size},{size}]"]).env.train)
    env = ManiSkillSimEnv(cfg, seed=0)
    try:
        for row in ds.episodes_meta:
            ep = ds.episode(row["episode_index"])
            obs = env.reset(init_state_id=row["init_state_id"])
            frames, states, success = [], [], False
            for action in ep.actions:
                frames.append(obs["images"][0].transpose(1, 2, 0))
                states.append(obs["state"])
                result = env.step_chunk(action[None])
                obs, success = result.obs, success or result.success
            assert success, f"episode {row['episode_index']} (init state {row['init_state_id']}) did not succeed on replay"
            np.testing.assert_array_equal(np.stack(frames), ep.images["observation.images.base_camera"])
            np.testing.assert_allclose(np.stack(states), ep.states, atol=1e-6)
    finally:
        env.close()
