"""LeRobot v2.1 datasets: what the writer writes the reader reads back exactly; bad files are one sentence naming them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embodirl.demos.lerobot.layout import DATA_PATH, EPISODES_PATH, INFO_PATH, STATS_PATH, VIDEO_PATH, DatasetError
from embodirl.demos.lerobot.reader import LeRobotDataset
from embodirl.demos.lerobot.writer import LeRobotWriter
from embodirl.errors import ConfigError

H, W, A, S = 24, 32, 4, 5
CAMS = {"base_camera": (H, W), "hand_camera": (H, W)}


def _episodes(rng, lengths=(7, 3, 12)):
    eps = []
    for i, t in enumerate(lengths):
        eps.append(dict(images={c: rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8) for c, (h, w) in CAMS.items()},
                        actions=rng.normal(size=(t, A)).astype(np.float32),
                        states=rng.normal(size=(t, S)).astype(np.float32),
                        task="push the cube" if i != 1 else "pick the cube"))
    return eps


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds") / "demo"
    eps = _episodes(np.random.default_rng(0))
    with LeRobotWriter(root, fps=20, cameras=CAMS, action_dim=A, state_dim=S, robot_type="panda") as w:
        for ep in eps:
            w.add_episode(**ep)
    return root, eps


def test_layout_is_lerobot_v21(written):
    root, eps = written
    info = json.loads((root / INFO_PATH).read_text())
    assert info["codebase_version"] == "v2.1" and info["fps"] == 20 and info["robot_type"] == "panda"
    assert info["total_episodes"] == 3 and info["total_frames"] == 22 and info["total_tasks"] == 2
    assert info["total_videos"] == 6 and info["splits"] == {"train": "0:3"}
    assert info["features"]["observation.images.base_camera"]["dtype"] == "video"
    assert info["features"]["observation.images.base_camera"]["shape"] == [H, W, 3]
    assert info["features"]["action"]["shape"] == [A] and info["features"]["observation.state"]["shape"] == [S]
    for e in range(3):
        assert (root / DATA_PATH.format(episode_chunk=0, episode_index=e)).is_file()
        for c in CAMS:
            assert (root / VIDEO_PATH.format(episode_chunk=0, video_key=f"observation.images.{c}", episode_index=e)).is_file()
    lines = [json.loads(x) for x in (root / EPISODES_PATH).read_text().splitlines()]
    assert [(r["episode_index"], r["length"], r["tasks"]) for r in lines] == \
        [(0, 7, ["push the cube"]), (1, 3, ["pick the cube"]), (2, 12, ["push the cube"])]
    assert len((root / "meta/episodes_stats.jsonl").read_text().splitlines()) == 3


def test_round_trip_is_exact(written):
    root, eps = written
    ds = LeRobotDataset(root, action_chunk=5)
    assert len(ds) == 22 and ds.num_episodes == 3 and ds.fps == 20
    assert ds.camera_keys == ["observation.images.base_camera", "observation.images.hand_camera"]
    assert ds.action_dim == A and ds.state_dim == S
    assert ds.episode_lengths.tolist() == [7, 3, 12] and ds.episode_starts.tolist() == [0, 7, 10]
    for e, ep in enumerate(eps):
        got = ds.episode(e)
        assert got.task == ep["task"]
        np.testing.assert_array_equal(got.actions, ep["actions"])
        np.testing.assert_array_equal(got.states, ep["states"])
        for c in CAMS:   # lossless video: the very pixels
            np.testing.assert_array_equal(got.images[f"observation.images.{c}"], ep["images"][c])
    # every sample: observation at t, chunk actions[t:t+5] padded with the last action past the end
    index = 0
    for e, ep in enumerate(eps):
        t_len = len(ep["actions"])
        for t in range(t_len):
            s = ds[index]
            assert (s.episode_index, s.frame_index, s.index) == (e, t, index)
            assert s.instruction == ep["task"]
            for c in CAMS:
                np.testing.assert_array_equal(s.images[f"observation.images.{c}"], ep["images"][c][t])
            np.testing.assert_array_equal(s.proprio, ep["states"][t])
            rows = np.minimum(np.arange(t, t + 5), t_len - 1)
            np.testing.assert_array_equal(s.actions, ep["actions"][rows])
            assert s.actions.dtype == np.float32 and s.actions.shape == (5, A)
            assert s.action_mask.tolist() == [t + k < t_len for k in range(5)]
            assert s.images["observation.images.base_camera"].dtype == np.uint8
            index += 1
    assert ds[-1].index == 21


def test_all_actions_and_proprio_are_the_frames_read_only(written):
    root, eps = written
    ds = LeRobotDataset(root, action_chunk=3)
    actions, proprio = ds.all_actions(), ds.all_proprio()
    np.testing.assert_array_equal(actions, np.concatenate([e["actions"] for e in eps]))
    np.testing.assert_array_equal(proprio, np.concatenate([e["states"] for e in eps]))
    assert actions.dtype == proprio.dtype == np.float32 and actions.shape == (22, A) and proprio.shape == (22, S)
    for i in (0, 9, 21):                                  # row i is sample i
        np.testing.assert_array_equal(actions[i], ds[i].actions[0])
        np.testing.assert_array_equal(proprio[i], ds[i].proprio)
    with pytest.raises(ValueError):
        actions[0, 0] = 1.0
    with pytest.raises(ValueError):
        proprio[0, 0] = 1.0
    np.testing.assert_array_equal(ds.all_actions()[0], eps[0]["actions"][0])
    assert LeRobotDataset(root, state_key=None).all_proprio() is None


def test_stats_match_the_frames(written):
    root, eps = written
    ds = LeRobotDataset(root)
    acts = np.concatenate([e["actions"] for e in eps]).astype(np.float64)
    states = np.concatenate([e["states"] for e in eps]).astype(np.float64)
    stored = ds.stored_stats()
    for key, v in (("action", acts), ("observation.state", states)):
        st = ds.stats[key]
        np.testing.assert_allclose(st.mean, v.mean(0), rtol=1e-6)
        np.testing.assert_allclose(st.std, v.std(0), rtol=1e-6)
        np.testing.assert_array_equal(st.min, v.min(0).astype(np.float32))
        np.testing.assert_array_equal(st.max, v.max(0).astype(np.float32))
        np.testing.assert_allclose(st.q01, np.quantile(v, 0.01, axis=0), rtol=1e-6)
        np.testing.assert_allclose(st.q99, np.quantile(v, 0.99, axis=0), rtol=1e-6)
        assert st.count == 22
        np.testing.assert_allclose(stored[key]["q99"], st.q99, rtol=1e-6)   # meta/stats.json says the same


def test_subset_of_cameras_and_no_proprio(written):
    root, eps = written
    ds = LeRobotDataset(root, cameras=["hand_camera"], state_key=None, action_chunk=1)
    s = ds[8]
    assert list(s.images) == ["observation.images.hand_camera"] and s.proprio is None
    np.testing.assert_array_equal(s.images["observation.images.hand_camera"], eps[1]["images"]["hand_camera"][1])
    with pytest.raises(DatasetError, match="no image feature observation.images.wrist"):
        LeRobotDataset(root, cameras=["wrist"])


def test_decoded_videos_stay_within_their_byte_budget(written):
    """Decoded episodes are kept by bytes: a small dataset stays whole (a frame read twice is the same decoded
    array, not a second decode), a budget evicts the least recently used episodes, and the newest always stays."""
    root, eps = written
    frame_bytes = sum(h * w * 3 for h, w in CAMS.values())
    sizes = [len(ep["actions"]) * frame_bytes for ep in eps]              # 32256, 13824, 55296
    whole = LeRobotDataset(root)
    first = [whole[i].images["observation.images.base_camera"] for i in range(len(whole))]
    assert whole.video_cache_nbytes == sum(sizes)
    assert all(np.shares_memory(a, whole[i].images["observation.images.base_camera"]) for i, a in enumerate(first))
    tight = LeRobotDataset(root, video_cache_bytes=sizes[2] + sizes[1] - 1)
    for i in range(len(tight)):
        tight[i]
    assert tight.video_cache_nbytes == sizes[2]                           # episodes 0 and 1 went, oldest first
    tiny = LeRobotDataset(root, video_cache_bytes=1)
    np.testing.assert_array_equal(tiny[len(tiny) - 1].images["observation.images.hand_camera"],
                                  eps[2]["images"]["hand_camera"][-1])
    assert tiny.video_cache_nbytes == sizes[2]


def test_lossy_codec_is_close(tmp_path):
    rng = np.random.default_rng(1)
    yy, xx = np.mgrid[0:H, 0:W]
    frames = np.stack([np.stack([(xx * 8 + k) % 256, (yy * 10) % 256, np.full_like(xx, 128)], -1) for k in range(6)])
    frames = frames.astype(np.uint8)
    with LeRobotWriter(tmp_path / "d", fps=10, cameras={"cam": (H, W)}, action_dim=2, video_codec="h264") as w:
        w.add_episode(images={"cam": frames}, actions=rng.normal(size=(6, 2)), task="t")
    got = LeRobotDataset(tmp_path / "d").episode(0).images["observation.images.cam"]
    assert got.shape == frames.shape and np.abs(got.astype(int) - frames).mean() < 6


def _copy(written, tmp_path):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(written[0], root)
    return root


@pytest.mark.parametrize("damage, name", [
    (lambda r: (r / INFO_PATH).unlink(), INFO_PATH),
    (lambda r: (r / INFO_PATH).write_text("{not json"), INFO_PATH),
    (lambda r: (r / EPISODES_PATH).unlink(), EPISODES_PATH),
    (lambda r: (r / "meta/tasks.jsonl").write_text('{"task_index": 0, "task": "x"}\n{oops\n'), "meta/tasks.jsonl"),
    (lambda r: (r / DATA_PATH.format(episode_chunk=0, episode_index=1)).unlink(),
     DATA_PATH.format(episode_chunk=0, episode_index=1)),
    (lambda r: (r / DATA_PATH.format(episode_chunk=0, episode_index=2)).write_bytes(b"PAR1garbage"),
     DATA_PATH.format(episode_chunk=0, episode_index=2)),
])
def test_bad_metadata_or_frames_name_the_file(written, tmp_path, damage, name):
    root = _copy(written, tmp_path)
    damage(root)
    with pytest.raises(DatasetError) as err:
        LeRobotDataset(root)
    msg = str(err.value)
    assert str(root / name) in msg and "\n" not in msg
    assert isinstance(err.value, ConfigError)     # the CLI prints it in one line, exit 2


@pytest.mark.parametrize("damage", ["missing", "corrupt", "short"])
def test_bad_video_names_the_file(written, tmp_path, damage):
    root = _copy(written, tmp_path)
    video = root / VIDEO_PATH.format(episode_chunk=0, video_key="observation.images.hand_camera", episode_index=2)
    if damage == "missing":
        video.unlink()
    elif damage == "corrupt":
        video.write_bytes(b"\x00" * 100)
    else:   # another episode's (shorter) video in its place
        video.write_bytes(video.with_name("episode_000001.mp4").read_bytes())
    if damage != "short":      # a missing or unreadable video: when the dataset is opened, before any training
        with pytest.raises(DatasetError) as err:
            LeRobotDataset(root)
        assert str(video) in str(err.value) and "\n" not in str(err.value)
        return
    ds = LeRobotDataset(root)  # a readable video of the wrong length: when its episode is first used
    ds[0]                                          # episode 0 is intact
    with pytest.raises(DatasetError) as err:
        ds[12]
    assert str(video) in str(err.value) and "\n" not in str(err.value)


def test_missing_folder_and_unknown_version(tmp_path, written):
    with pytest.raises(DatasetError, match=f"dataset folder {tmp_path / 'nope'} does not exist"):
        LeRobotDataset(tmp_path / "nope")
    root = _copy(written, tmp_path)
    info = json.loads((root / INFO_PATH).read_text())
    info["codebase_version"] = "v3.0"
    (root / INFO_PATH).write_text(json.dumps(info))
    with pytest.raises(DatasetError, match="codebase_version 'v3.0'"):
        LeRobotDataset(root)


def test_writer_refuses_a_non_empty_folder_and_bad_shapes(tmp_path, written):
    with pytest.raises(DatasetError, match="already exists"):
        LeRobotWriter(written[0], fps=20, cameras=CAMS, action_dim=A)
    w = LeRobotWriter(tmp_path / "w", fps=20, cameras={"c": (4, 4)}, action_dim=2)
    with pytest.raises(ValueError, match="must be uint8"):
        w.add_episode(images={"c": np.zeros((3, 4, 5, 3), np.uint8)}, actions=np.zeros((3, 2)), task="t")
    assert not (tmp_path / "w" / STATS_PATH).exists()
