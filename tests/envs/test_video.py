"""Videos: file names, mp4 round trips, captions and VideoRecorder driven by a real batch."""

from __future__ import annotations

import functools

import imageio.v2 as imageio
import numpy as np

from embodirl.envs.base import VideoConfig
from embodirl.envs.toy import ToySimEnv, oracle_actions
from embodirl.envs.vector.vector_env import ProcessVectorEnv
from embodirl.envs.video import (
    CAPTION_SUCCESS,
    VideoRecorder,
    caption,
    caption_size,
    episode_video_name,
    write_video,
)
from tests.env_options import env_option

STEP = 0.08


def read(path) -> list[np.ndarray]:
    with imageio.get_reader(path) as reader:
        return [frame for frame in reader]


def toy_venv(n, *, record, **kwargs) -> ProcessVectorEnv:
    cfg = env_option("toy_reach")
    cfg.update(state_obs=True, step_size=STEP, image_size=[48, 48])
    return ProcessVectorEnv([functools.partial(ToySimEnv, cfg, seed=i) for i in range(n)], processes=False,
                            record_env_ids=record, **kwargs)


def recorder(tmp_path, venv, *, overlay: bool) -> VideoRecorder:
    return VideoRecorder(tmp_path, env_ids=venv.record_env_ids, env_name="toy_reach",
                         task_descriptions=venv.spec.task_descriptions, fps=10, overlay=overlay)


def test_episode_video_name():
    assert episode_video_name(120, "libero_10", 3, 2, True) == "step_120/libero_10_task3_ep2_success.mp4"
    assert episode_video_name(5, "toy_reach", 0, 0, False, env_id=7) == "step_5/toy_reach_env7_task0_ep0_fail.mp4"


def test_write_video_round_trip(tmp_path):
    frames = [np.full((48, 64, 3), 10 * k, np.uint8) for k in range(17)]
    path = write_video(tmp_path / "sub" / "clip.mp4", frames, fps=5)
    back = read(path)
    assert len(back) == 17 and back[0].shape == (48, 64, 3)
    np.testing.assert_allclose([f.mean() for f in back], [10 * k for k in range(17)], atol=3)
    assert [p.name for p in path.parent.iterdir()] == ["clip.mp4"]     # no temporary file left


def test_odd_sizes_are_padded_to_even(tmp_path):
    back = read(write_video(tmp_path / "odd.mp4", [np.zeros((33, 47, 3), np.uint8)] * 3))
    assert len(back) == 3 and back[0].shape == (34, 48, 3)


def test_caption_draws_text_under_an_enlarged_frame():
    frame = np.full((64, 64, 3), 128, np.uint8)
    out = caption(frame, ["move to the red square", "step 3  chunk reward 1.000", "success"], success=True)
    assert out.shape[:2] == caption_size((64, 64), 3) and out.shape[1] == 256
    np.testing.assert_array_equal(out[:256, :256], 128)                 # the picture, 4x nearest
    band = out[256:]
    assert (band > 0).any(), "no text drawn"
    assert np.all(band == CAPTION_SUCCESS, axis=-1).any(), "success line not green"
    assert caption(np.zeros((300, 400, 3), np.uint8), ["x"]).shape[1] == 400   # wide frames keep their size


def test_recorder_writes_one_file_per_episode(tmp_path):
    with toy_venv(3, record=[0, 2], auto_reset=True) as venv:
        rec = VideoRecorder.for_env(venv, tmp_path, VideoConfig(enabled=True, env_ids=[0, 2], fps=10, overlay=True), step=7)
        obs, info = venv.reset(seed=0, task_ids=[0, 1, 2], init_state_ids=[0, 1, 2])
        rec.on_reset(info)
        expected = {}        # file -> frames (reset frame + one per executed step)
        for t in range(4):
            actions = oracle_actions(obs, 4, 7, STEP) if t % 2 else np.zeros((3, 4, 7), np.float32)
            obs, reward, terminated, truncated, info = venv.step(actions)
            written = rec.on_step(reward, terminated, truncated, info)
            ended = [i for i in (0, 2) if terminated[i] or truncated[i]]
            assert len(written) == len(ended)
            for path, i in zip(written, ended):
                expected[path] = 1 + info["episode_length"][i]
        written_at_flush = rec.flush()
    assert len(expected) >= 2 and len(written_at_flush) == 2          # the new episodes were open
    size = caption_size((48, 48), 3)
    for path, count in expected.items():
        assert path.parent.name == "step_7" and path.name.endswith("_success.mp4")
        frames = read(path)
        assert len(frames) == count and frames[0].shape == (*size, 3)
    names = sorted(p.name for p in (tmp_path / "step_7").iterdir())
    assert not any(n.startswith(".partial") for n in names)
    assert "toy_reach_env0_task0_ep0_success.mp4" in names and "toy_reach_env2_task2_ep0_success.mp4" in names


def test_recorder_without_overlay_keeps_the_frames(tmp_path):
    with toy_venv(2, record=[1], reward_type="action_level") as venv:
        rec = recorder(tmp_path, venv, overlay=False)
        obs, info = venv.reset(seed=0)
        first = obs["images"][1, 0].transpose(1, 2, 0)
        rec.on_reset(info)
        done = np.zeros(2, bool)
        while not done[1]:
            obs, reward, terminated, truncated, info = venv.step(oracle_actions(obs, 3, 7, STEP))
            done |= terminated | truncated
            (path,) = rec.on_step(reward, terminated, truncated, info) or [None]
        frames = read(path)
        assert len(frames) == 1 + info["episode_length"][1] and frames[0].shape == (48, 48, 3)
        assert np.abs(frames[0].astype(int) - first).mean() < 4                 # lossy codec
        assert np.abs(frames[-1].astype(int) - obs["images"][1, 0].transpose(1, 2, 0)).mean() < 4
        assert rec.flush() == []


def test_restarted_episode_is_discarded(tmp_path):
    with toy_venv(2, record=[0, 1], auto_reset=True) as venv:
        rec = recorder(tmp_path, venv, overlay=False)
        obs, info = venv.reset(seed=0, init_state_ids=[1, 2])
        rec.on_reset(info)
        actions = np.zeros((2, 4, 7), np.float32)
        actions[0, 0, 0] = np.nan           # env 0's simulator blows up and is replaced
        obs, reward, terminated, truncated, info = venv.step(actions)
        assert info["restarted"][0]
        assert rec.on_step(reward, terminated, truncated, info) == []
        obs, reward, terminated, truncated, info = venv.step(oracle_actions(obs, 12, 7, STEP))
        paths = rec.on_step(reward, terminated, truncated, info)
        rec.close()          # drops the episodes the auto-reset just opened
    assert len(paths) == 2
    env0 = next(p for p in paths if "_env0_" in p.name)
    # env 0's video is the new episode only: reset frame + the steps of the last chunk
    assert len(read(env0)) == 1 + info["steps"][0]
    assert not [p for p in tmp_path.rglob(".partial*")]


def test_flush_names_unfinished_episodes_by_success_so_far(tmp_path):
    with toy_venv(1, record=[0]) as venv:
        rec = recorder(tmp_path, venv, overlay=True)
        obs, info = venv.reset(seed=0)
        rec.on_reset(info)
        obs, reward, terminated, truncated, info = venv.step(np.zeros((1, 4, 7), np.float32))
        rec.on_step(reward, terminated, truncated, info)
        (path,) = rec.flush()
    assert path.name == f"toy_reach_env0_task{info['task_id'][0]}_ep0_fail.mp4"
    assert len(read(path)) == 5
