"""Writing a LeRobot v2.1 dataset: :class:`LeRobotWriter` (the format: :mod:`embodirl.demos.lerobot`)."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from embodirl import atomic_folder
from embodirl.demos.lerobot.layout import (
    ACTION_KEY,
    CHUNK_SIZE,
    CODEBASE_VERSION,
    DATA_PATH,
    EPISODES_PATH,
    EPISODES_STATS_PATH,
    INDEX_COLUMNS,
    INFO_PATH,
    STATE_KEY,
    STATS_PATH,
    TASKS_PATH,
    VIDEO_CODECS,
    VIDEO_PATH,
    DatasetError,
    FeatureStats,
    camera_key,
    encode_video,
)
from embodirl.errors import ConfigError


class LeRobotWriter:
    """Write episodes into a new LeRobot v2.1 dataset at ``root``.

    ``cameras``: camera name (or feature key) -> (h, w). ``state_dim``: None for no ``observation.state``.
    Episodes are written as they are added (parquet + one mp4 per camera); :meth:`close` (or leaving the
    ``with`` block without an exception) writes ``meta/`` - a folder without ``meta/info.json`` is not a
    dataset. ``overwrite``: replace an existing dataset at ``root`` (a folder with ``meta/info.json``; any other
    non-empty folder is an error, as is an existing dataset without ``overwrite``). The new dataset is then written
    beside it and takes its place in :meth:`close`, when it is complete (:mod:`embodirl.atomic_folder`); until then,
    and after :meth:`abort` or a kill, the old one is untouched.
    """

    def __init__(self, root: str | Path, *, fps: int, cameras: Mapping[str, Sequence[int]], action_dim: int,
                 state_dim: int | None = None, robot_type: str = "", video_codec: str = "libx264rgb",
                 action_names: Sequence[str] | None = None, state_names: Sequence[str] | None = None,
                 overwrite: bool = False):
        if video_codec not in VIDEO_CODECS:
            raise ConfigError("video_codec", f"'{video_codec}' is not supported; choose one of {', '.join(VIDEO_CODECS)}")
        self.final = self.root = Path(root)
        atomic_folder.remove_stale(self.final.parent)
        if self.final.exists() and any(self.final.iterdir()):
            if not overwrite:
                raise DatasetError(f"{self.final} already exists and is not empty; choose another folder or overwrite it")
            if not is_dataset(self.final):
                raise DatasetError(f"{self.final} is not a LeRobot dataset (no {INFO_PATH}), and overwrite replaces "
                                   "only a dataset; choose another folder")
            self.root = atomic_folder.temporary(self.final)   # the new dataset, swapped in by close()
        self.root.mkdir(parents=True, exist_ok=True)
        self.fps = int(fps)
        self.cameras = {camera_key(k): (int(v[0]), int(v[1])) for k, v in cameras.items()}
        self.action_dim, self.state_dim = int(action_dim), None if state_dim is None else int(state_dim)
        self.robot_type, self.video_codec = robot_type, video_codec
        self.action_names = list(action_names) if action_names is not None else None
        self.state_names = list(state_names) if state_names is not None else None
        self.tasks: dict[str, int] = {}
        self.episodes: list[dict] = []
        self.episode_stats: list[dict] = []
        self._actions: list[np.ndarray] = []
        self._states: list[np.ndarray] = []
        self._closed = False

    def __enter__(self) -> LeRobotWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    @property
    def num_frames(self) -> int:
        return sum(e["length"] for e in self.episodes)

    def add_episode(self, *, images: Mapping[str, np.ndarray], actions: np.ndarray, task: str,
                    states: np.ndarray | None = None, extra: Mapping | None = None) -> int:
        """Append one episode (``images``: camera -> uint8 [T, h, w, 3]; ``actions`` [T, A]; ``states`` [T, S];
        ``extra``: more JSON fields for its ``meta/episodes.jsonl`` row, e.g. the init state). Returns its index."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        actions = np.asarray(actions, np.float32)
        t = len(actions)
        if actions.shape != (t, self.action_dim) or t == 0:
            raise ValueError(f"actions must have shape [T>0, {self.action_dim}], got {list(actions.shape)}")
        images = {camera_key(k): np.asarray(v) for k, v in images.items()}
        if set(images) != set(self.cameras):
            raise ValueError(f"images must hold cameras {sorted(self.cameras)}, got {sorted(images)}")
        for key, frames in images.items():
            h, w = self.cameras[key]
            if frames.dtype != np.uint8 or frames.shape != (t, h, w, 3):
                raise ValueError(f"{key} must be uint8 [{t}, {h}, {w}, 3], got {frames.dtype} {list(frames.shape)}")
        if (states is None) != (self.state_dim is None):
            raise ValueError("states must be given exactly when the writer has a state_dim")
        if states is not None:
            states = np.asarray(states, np.float32)
            if states.shape != (t, self.state_dim):
                raise ValueError(f"states must have shape [{t}, {self.state_dim}], got {list(states.shape)}")
        ep = len(self.episodes)
        task_index = self.tasks.setdefault(task, len(self.tasks))
        start = self.num_frames
        columns = {ACTION_KEY: _fixed_list(actions)}
        if states is not None:
            columns[STATE_KEY] = _fixed_list(states)
        columns |= {"timestamp": pa.array(np.arange(t, dtype=np.float32) / self.fps),
                    "frame_index": pa.array(np.arange(t, dtype=np.int64)),
                    "episode_index": pa.array(np.full(t, ep, np.int64)),
                    "index": pa.array(np.arange(start, start + t, dtype=np.int64)),
                    "task_index": pa.array(np.full(t, task_index, np.int64))}
        path = self.root / DATA_PATH.format(episode_chunk=ep // CHUNK_SIZE, episode_index=ep)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(columns), path)
        for key, frames in images.items():
            encode_video(self.root / VIDEO_PATH.format(episode_chunk=ep // CHUNK_SIZE, video_key=key, episode_index=ep),
                         frames, self.fps, self.video_codec)
        self.episodes.append({"episode_index": ep, "tasks": [task], "length": t, **dict(extra or {})})
        stats = {ACTION_KEY: FeatureStats.of(actions).to_json()}
        if states is not None:
            stats[STATE_KEY] = FeatureStats.of(states).to_json()
        for key, frames in images.items():      # LeRobot's image stats: per channel, in [0, 1], shape [3, 1, 1]
            pix = frames.reshape(-1, 3).astype(np.float64) / 255.0
            stats[key] = {name: np.asarray(fn(pix, axis=0)).reshape(3, 1, 1).tolist()
                          for name, fn in (("mean", np.mean), ("std", np.std), ("min", np.min), ("max", np.max))}
            stats[key]["count"] = [t]
        self.episode_stats.append({"episode_index": ep, "stats": stats})
        self._actions.append(actions)
        if states is not None:
            self._states.append(states)
        return ep

    def close(self) -> None:
        """Write ``meta/`` (info, episodes, tasks, stats). Idempotent."""
        if self._closed:
            return
        meta = self.root / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        _write_jsonl(self.root / EPISODES_PATH, self.episodes)
        _write_jsonl(self.root / TASKS_PATH, [{"task_index": i, "task": t} for t, i in self.tasks.items()])
        _write_jsonl(self.root / EPISODES_STATS_PATH, self.episode_stats)
        stats = {}
        if self._actions:
            stats[ACTION_KEY] = FeatureStats.of(np.concatenate(self._actions)).to_json()
        if self._states:
            stats[STATE_KEY] = FeatureStats.of(np.concatenate(self._states)).to_json()
        (self.root / STATS_PATH).write_text(json.dumps(stats, indent=2))
        (self.root / INFO_PATH).write_text(json.dumps(self.info(), indent=2))
        if self.root != self.final:
            self.root = atomic_folder.swap_in(self.root, self.final)
        self._closed = True

    def abort(self) -> None:
        """Give up a dataset being written: a replacement is deleted (the old dataset stays); a new folder is left
        as it is (without ``meta/info.json``: not a dataset)."""
        if not self._closed and self.root != self.final:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = self.final
        self._closed = True

    def info(self) -> dict:
        pix_fmt = VIDEO_CODECS[self.video_codec][0]
        features: dict[str, dict] = {}
        for key, (h, w) in self.cameras.items():
            features[key] = {"dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"],
                             "info": {"video.height": h, "video.width": w, "video.codec": self.video_codec,
                                      "video.pix_fmt": pix_fmt, "video.is_depth_map": False, "video.fps": self.fps,
                                      "video.channels": 3, "has_audio": False}}
        if self.state_dim is not None:
            features[STATE_KEY] = {"dtype": "float32", "shape": [self.state_dim], "names": self.state_names}
        features[ACTION_KEY] = {"dtype": "float32", "shape": [self.action_dim], "names": self.action_names}
        for key in INDEX_COLUMNS:
            features[key] = {"dtype": "float32" if key == "timestamp" else "int64", "shape": [1], "names": None}
        n = len(self.episodes)
        return {"codebase_version": CODEBASE_VERSION, "robot_type": self.robot_type, "total_episodes": n,
                "total_frames": self.num_frames, "total_tasks": len(self.tasks), "total_videos": n * len(self.cameras),
                "total_chunks": max(1, math.ceil(n / CHUNK_SIZE)), "chunks_size": CHUNK_SIZE, "fps": self.fps,
                "splits": {"train": f"0:{n}"}, "data_path": DATA_PATH, "video_path": VIDEO_PATH if self.cameras else None,
                "features": features}



def _fixed_list(values: np.ndarray):
    import pyarrow as pa

    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# --------------------------------------------------------------------------------------------------
# reader
# --------------------------------------------------------------------------------------------------


def is_dataset(folder: str | Path) -> bool:
    """``folder`` is a LeRobot dataset: it has ``meta/info.json``."""
    return (Path(folder) / INFO_PATH).is_file()
