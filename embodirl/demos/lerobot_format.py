"""LeRobot datasets on disk (the v2.0/v2.1 layout): a writer and a reader, without torch or torchvision.

Layout (LeRobot ``codebase_version`` v2.1, the paths of lerobot v0.3.3 ``lerobot/datasets/utils.py``)::

    <root>/meta/info.json               fps, features (dtype/shape/names), path templates, totals
    <root>/meta/episodes.jsonl          {"episode_index", "tasks": [str], "length"} per episode
    <root>/meta/tasks.jsonl             {"task_index", "task"} per instruction
    <root>/meta/episodes_stats.jsonl    {"episode_index", "stats": {feature: {min, max, mean, std, count}}}
    <root>/meta/stats.json              dataset stats per feature (min, max, mean, std, count, q01, q99)
    <root>/data/chunk-000/episode_000000.parquet     one row per frame: action, observation.state,
                                                     timestamp, frame_index, episode_index, index, task_index
    <root>/videos/chunk-000/observation.images.<camera>/episode_000000.mp4   one mp4 per camera and episode

Why not the ``lerobot`` package: it depends on torchvision; its standalone spin-off (``lerobot-dataset``) pins
numpy/huggingface-hub/datasets below this project's versions. pyarrow reads the parquet frames, PyAV
encodes and decodes the videos.

Videos: :class:`LeRobotWriter` encodes with ``libx264rgb`` at ``crf 0`` by default - lossless RGB H.264,
so the frames read back are exactly those recorded (the policy trains on the pixels the simulator
renders). ``video_codec="h264"`` writes the usual lossy ``yuv420p`` H.264 instead (smaller, not exact).
The reader decodes any codec FFmpeg knows (LeRobot's own ``libsvtav1`` included) and also reads
``image`` features stored in the parquet files (PNG/JPEG bytes, as some published datasets do).

Reading (the API the SFT path uses)::

    ds = LeRobotDataset("outputs/demos/PushCube-v1", action_chunk=8)
    len(ds)                     # frames, all episodes together
    s = ds[i]                   # Sample: images {camera key: uint8 [h, w, 3]}, proprio float32 [S] | None,
                                #   instruction str, actions float32 [H, A], action_mask bool [H],
                                #   episode_index, frame_index, index
    ds.stats["action"].q01      # per-dim float32 arrays: mean, std, min, max, q01, q99 (also "observation.state")
    ds.all_actions()            # every frame's action, float32 [N, A], row i = sample i (read-only)
    ds.all_proprio()            # every frame's observation.state, float32 [N, S] (read-only), None without proprio
    ds.episode(e)               # a whole episode: EpisodeData (images [T, h, w, 3] per camera, actions, states, task)

The action chunk of frame t is ``actions[t : t + H]`` of its episode; rows past the episode's end repeat
its last action and have ``action_mask`` False (LeRobot's ``action_is_pad`` convention, inverted: True
marks a real row). A missing or corrupt file raises :class:`DatasetError`, one sentence naming the file.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embodirl.errors import ConfigError

CODEBASE_VERSION = "v2.1"
READABLE_VERSIONS = ("v2.0", "v2.1")
CHUNK_SIZE = 1000                                  # episodes per chunk folder
INFO_PATH = "meta/info.json"
EPISODES_PATH = "meta/episodes.jsonl"
TASKS_PATH = "meta/tasks.jsonl"
EPISODES_STATS_PATH = "meta/episodes_stats.jsonl"
STATS_PATH = "meta/stats.json"
DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
ACTION_KEY = "action"
STATE_KEY = "observation.state"
IMAGE_PREFIX = "observation.images."
INDEX_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
VIDEO_CODECS = {"libx264rgb": ("rgb24", {"crf": "0"}),      # lossless RGB: exact frames
                "h264": ("yuv420p", {"crf": "18"}),          # lossy, smaller; even image sizes only
                "libsvtav1": ("yuv420p", {"crf": "30"})}     # LeRobot's default codec (lossy)
QUANTILES = (0.01, 0.99)


class DatasetError(ConfigError):
    """A dataset file is missing, unreadable or inconsistent; the message is one sentence naming the file.
    A :class:`~embodirl.errors.ConfigError`, so the CLI prints it and exits with status 2."""

    def __init__(self, message: str):
        super().__init__("", message)


# --------------------------------------------------------------------------------------------------
# data classes
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FeatureStats:
    """Per-dimension statistics of one low-dimensional feature over every frame of the dataset (float32 [D])."""

    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray
    q01: np.ndarray
    q99: np.ndarray
    count: int

    @classmethod
    def of(cls, values: np.ndarray) -> FeatureStats:
        v = np.asarray(values, np.float64).reshape(len(values), -1)
        q01, q99 = np.quantile(v, QUANTILES, axis=0)
        f32 = lambda a: np.asarray(a, np.float32)
        return cls(mean=f32(v.mean(0)), std=f32(v.std(0)), min=f32(v.min(0)), max=f32(v.max(0)),
                   q01=f32(q01), q99=f32(q99), count=int(len(v)))

    def to_json(self) -> dict:
        return {k: getattr(self, k).tolist() for k in ("mean", "std", "min", "max", "q01", "q99")} | {"count": [self.count]}


@dataclass
class Sample:
    """One training sample: the observation at frame ``frame_index`` of episode ``episode_index`` and the
    action chunk that starts there."""

    images: dict[str, np.ndarray]      # camera key -> uint8 [h, w, 3]
    proprio: np.ndarray | None         # float32 [S] (observation.state), None if the dataset has none
    instruction: str
    actions: np.ndarray                # float32 [H, A]
    action_mask: np.ndarray            # bool [H]: True for real rows, False for padding past the episode end
    episode_index: int
    frame_index: int
    index: int                         # global frame index (row of the dataset)


@dataclass
class EpisodeData:
    """A whole episode, as given to :meth:`LeRobotWriter.add_episode` and returned by :meth:`LeRobotDataset.episode`."""

    images: dict[str, np.ndarray]      # camera key -> uint8 [T, h, w, 3]
    actions: np.ndarray                # float32 [T, A]
    states: np.ndarray | None          # float32 [T, S]
    task: str
    episode_index: int = -1


def camera_key(name: str) -> str:
    """Feature key of a camera (``base_camera`` -> ``observation.images.base_camera``)."""
    return name if name.startswith(IMAGE_PREFIX) else IMAGE_PREFIX + name


# --------------------------------------------------------------------------------------------------
# video I/O (PyAV)
# --------------------------------------------------------------------------------------------------
def encode_video(path: Path, frames: np.ndarray, fps: int, codec: str = "libx264rgb") -> None:
    """Write uint8 ``frames`` [T, h, w, 3] as an mp4."""
    import av

    if codec not in VIDEO_CODECS:
        raise ValueError(f"video codec '{codec}' is not supported; choose one of {', '.join(VIDEO_CODECS)}")
    pix_fmt, options = VIDEO_CODECS[codec]
    t, h, w, _ = frames.shape
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=int(fps), options=dict(options))
        stream.width, stream.height, stream.pix_fmt = w, h, pix_fmt
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def decode_video(path: Path) -> np.ndarray:
    """All frames of an mp4 as uint8 [T, h, w, 3]; a missing or undecodable file is a :class:`DatasetError`."""
    import av

    if not path.is_file():
        raise DatasetError(f"{path} is missing (a video of the dataset)")
    try:
        with av.open(str(path)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    except (av.FFmpegError, ValueError, IndexError) as exc:
        raise DatasetError(f"{path} could not be decoded as a video ({type(exc).__name__}: {exc})") from None
    if not frames:
        raise DatasetError(f"{path} holds no video frames")
    return np.stack(frames)


def _decode_image(cell, where: str) -> np.ndarray:
    import io

    from PIL import Image

    data = cell.get("bytes") if isinstance(cell, Mapping) else cell
    try:
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), np.uint8)
    except Exception as exc:
        raise DatasetError(f"{where} holds an image that could not be decoded ({exc})") from None


# --------------------------------------------------------------------------------------------------
# writer
# --------------------------------------------------------------------------------------------------
class LeRobotWriter:
    """Write episodes into a new LeRobot v2.1 dataset at ``root``.

    ``cameras``: camera name (or feature key) -> (h, w). ``state_dim``: None for no ``observation.state``.
    Episodes are written as they are added (parquet + one mp4 per camera); :meth:`close` (or leaving the
    ``with`` block without an exception) writes ``meta/`` - a folder without ``meta/info.json`` is not a
    dataset. ``overwrite``: replace an existing folder at ``root``; otherwise an existing non-empty folder is
    an error.
    """

    def __init__(self, root: str | Path, *, fps: int, cameras: Mapping[str, Sequence[int]], action_dim: int,
                 state_dim: int | None = None, robot_type: str = "", video_codec: str = "libx264rgb",
                 action_names: Sequence[str] | None = None, state_names: Sequence[str] | None = None,
                 overwrite: bool = False):
        if video_codec not in VIDEO_CODECS:
            raise ConfigError("video_codec", f"'{video_codec}' is not supported; choose one of {', '.join(VIDEO_CODECS)}")
        self.root = Path(root)
        if self.root.exists() and any(self.root.iterdir()):
            if not overwrite:
                raise DatasetError(f"{self.root} already exists and is not empty; choose another folder or overwrite it")
            shutil.rmtree(self.root)
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
def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise DatasetError(f"{path} is missing; a LeRobot dataset folder holds meta/info.json, meta/episodes.jsonl "
                           "and meta/tasks.jsonl")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path} is not valid JSON ({exc})") from None


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise DatasetError(f"{path} is missing; a LeRobot v2 dataset lists its episodes and tasks in meta/*.jsonl")
    rows = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path} line {n} is not valid JSON ({exc})") from None
    return rows


def _column(table, name: str, path: Path) -> np.ndarray:
    """A parquet column as a numpy array: scalars [T], lists [T, D]."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if name not in table.column_names:
        raise DatasetError(f"{path} has no column '{name}' (its columns: {', '.join(table.column_names)})")
    col = table.column(name).combine_chunks()
    if pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or pa.types.is_large_list(col.type):
        flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
        return flat.reshape(len(col), -1) if len(col) else flat.reshape(0, 0)
    return col.to_numpy(zero_copy_only=False)


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class LeRobotDataset:
    """A LeRobot v2.0/v2.1 dataset on disk, as (images, proprio, instruction, action chunk) samples.

    ``root``: the dataset folder (``meta/info.json`` inside). ``action_chunk``: H, the model's action chunk
    length. ``action_key`` / ``state_key``: the low-dimensional features used as actions and proprio
    (``state_key=None``, or a dataset without it, gives ``proprio=None``). ``cameras``: the image features
    to return (feature keys or bare camera names; default every ``video``/``image`` feature in
    ``info.json`` order). ``video_cache_episodes``: decoded episodes kept in memory (videos are decoded one
    whole episode at a time).

    All metadata and parquet frames are read (and checked) at construction; videos are decoded on first use.

    Attributes: ``info`` (meta/info.json), ``episodes_meta`` (meta/episodes.jsonl rows), ``fps``, ``camera_keys``,
    ``action_dim``, ``state_dim`` (None without proprio), ``num_episodes``, ``episode_lengths`` (int64 [E]),
    ``episode_starts`` (int64 [E], global index of each episode's frame 0), ``tasks`` (task_index -> instruction),
    ``stats`` (feature key -> :class:`FeatureStats`, computed from the frames for ``action`` and the state feature).
    Every frame's actions and proprio at once, as arrays: :meth:`all_actions`, :meth:`all_proprio`.
    """

    def __init__(self, root: str | Path, *, action_chunk: int = 1, action_key: str = ACTION_KEY,
                 state_key: str | None = STATE_KEY, cameras: Sequence[str] | None = None,
                 video_cache_episodes: int = 64):
        if int(action_chunk) < 1:
            raise ValueError(f"action_chunk must be >= 1, got {action_chunk}")
        self.root = Path(root)
        if not self.root.is_dir():
            raise DatasetError(f"dataset folder {self.root} does not exist")
        self.action_chunk = int(action_chunk)
        self.info = info = _read_json(self.root / INFO_PATH)
        version = info.get("codebase_version")
        if version not in READABLE_VERSIONS:
            raise DatasetError(f"{self.root / INFO_PATH} declares codebase_version {version!r}; this reader reads LeRobot "
                               f"{' and '.join(READABLE_VERSIONS)} datasets")
        features = info.get("features")
        if not isinstance(features, dict) or "fps" not in info or "data_path" not in info:
            raise DatasetError(f"{self.root / INFO_PATH} lacks 'features', 'fps' or 'data_path'")
        self.fps = int(info["fps"])
        if action_key not in features:
            raise DatasetError(f"{self.root / INFO_PATH} has no feature '{action_key}' (its features: {', '.join(features)})")
        self.action_key = action_key
        self.state_key = state_key if state_key in features else None
        visual = [k for k, f in features.items() if f.get("dtype") in ("video", "image")]
        if cameras is None:
            self.camera_keys = visual
        else:
            self.camera_keys = [k if k in features else camera_key(k) for k in cameras]
            unknown = [k for k in self.camera_keys if k not in visual]
            if unknown:
                raise DatasetError(f"{self.root / INFO_PATH} has no image feature {', '.join(unknown)} (it has: "
                                   f"{', '.join(visual) or 'none'})")
        self._video_keys = [k for k in self.camera_keys if features[k]["dtype"] == "video"]
        if self._video_keys and not info.get("video_path"):
            raise DatasetError(f"{self.root / INFO_PATH} has video features but no 'video_path'")
        self.tasks = {int(r["task_index"]): str(r["task"]) for r in _read_jsonl(self.root / TASKS_PATH)}
        episodes = sorted(_read_jsonl(self.root / EPISODES_PATH), key=lambda r: r["episode_index"])
        if not episodes:
            raise DatasetError(f"{self.root / EPISODES_PATH} lists no episodes")
        self.chunks_size = int(info.get("chunks_size", CHUNK_SIZE))
        self.episode_indices = np.array([int(r["episode_index"]) for r in episodes], np.int64)
        self.episodes_meta = episodes            # the rows of meta/episodes.jsonl, by episode_index
        self._load_frames(episodes)
        self._video_cache: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._video_cache_size = max(1, int(video_cache_episodes))
        self.stats = {self.action_key: FeatureStats.of(self._actions)}
        if self.state_key is not None:
            self.stats[self.state_key] = FeatureStats.of(self._states)

    # -- loading -----------------------------------------------------------------------------------
    def _path(self, template_key: str, ep: int, video_key: str | None = None) -> Path:
        fields = dict(episode_chunk=ep // self.chunks_size, episode_index=ep)
        if video_key is not None:
            fields["video_key"] = video_key
        return self.root / self.info[template_key].format(**fields)

    def _load_frames(self, episodes: list[dict]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        actions, states, task_idx, lengths, images = [], [], [], [], []
        image_keys = [k for k in self.camera_keys if k not in self._video_keys]
        for row in episodes:
            ep = int(row["episode_index"])
            path = self._path("data_path", ep)
            if not path.is_file():
                raise DatasetError(f"{path} is missing (the frames of episode {ep})")
            try:
                table = pq.read_table(path)
            except (pa.ArrowException, OSError) as exc:
                raise DatasetError(f"{path} is not a readable parquet file ({exc})") from None
            n = table.num_rows
            if "length" in row and int(row["length"]) != n:
                raise DatasetError(f"{path} holds {n} frames but {self.root / EPISODES_PATH} says episode {ep} has "
                                   f"{row['length']}")
            if n == 0:
                raise DatasetError(f"{path} holds no frames")
            actions.append(_column(table, self.action_key, path).astype(np.float32).reshape(n, -1))
            if self.state_key is not None:
                states.append(_column(table, self.state_key, path).astype(np.float32).reshape(n, -1))
            if "task_index" in table.column_names:
                task_idx.append(_column(table, "task_index", path).astype(np.int64))
            else:                                   # an episode with one task and no per-frame index
                first = str(row["tasks"][0]) if row.get("tasks") else ""
                task_idx.append(np.full(n, next((i for i, t in self.tasks.items() if t == first), -1), np.int64))
            if image_keys:
                images.append({k: table.column(k).to_pylist() if k in table.column_names else
                               _column(table, k, path) for k in image_keys})
            lengths.append(n)
        self.episode_lengths = np.array(lengths, np.int64)
        self.episode_starts = np.concatenate([[0], np.cumsum(self.episode_lengths)[:-1]]).astype(np.int64)
        self._actions = np.concatenate(actions)
        self._states = np.concatenate(states) if states else None
        self._task_index = np.concatenate(task_idx)
        unknown = sorted(set(self._task_index.tolist()) - set(self.tasks))
        if unknown:
            raise DatasetError(f"{self.root / TASKS_PATH} has no task_index {unknown[0]}, which the frames use")
        self._frame_episode = np.repeat(np.arange(len(lengths)), self.episode_lengths)   # row -> position in episodes
        self._image_cells = images
        self.action_dim = int(self._actions.shape[1])
        self.state_dim = None if self._states is None else int(self._states.shape[1])

    def _episode_images(self, pos: int) -> dict[str, np.ndarray]:
        """Camera key -> uint8 [T, h, w, 3] of the episode at position ``pos`` (decoded videos are cached)."""
        if pos in self._video_cache:
            self._video_cache.move_to_end(pos)
            return self._video_cache[pos]
        ep, n = int(self.episode_indices[pos]), int(self.episode_lengths[pos])
        out = {}
        for key in self.camera_keys:
            if key in self._video_keys:
                path = self._path("video_path", ep, key)
                frames = decode_video(path)
                if len(frames) != n:
                    raise DatasetError(f"{path} holds {len(frames)} frames but episode {ep} has {n}")
            else:
                where = str(self._path("data_path", ep))
                frames = np.stack([_decode_image(c, where) for c in self._image_cells[pos][key]])
            out[key] = frames
        self._video_cache[pos] = out
        while len(self._video_cache) > self._video_cache_size:
            self._video_cache.popitem(last=False)
        return out

    # -- access ------------------------------------------------------------------------------------
    @property
    def num_episodes(self) -> int:
        return len(self.episode_lengths)

    def __len__(self) -> int:
        return int(self.episode_lengths.sum())

    def __getitem__(self, index: int) -> Sample:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for a dataset of {n} frames")
        index = int(index) % n
        pos = int(self._frame_episode[index])
        start, length = int(self.episode_starts[pos]), int(self.episode_lengths[pos])
        t = index - start
        rows = np.minimum(np.arange(t, t + self.action_chunk), length - 1)     # clamp: repeat the last action
        images = {k: v[t] for k, v in self._episode_images(pos).items()}
        return Sample(images=images, proprio=None if self._states is None else self._states[index].copy(),
                      instruction=self.tasks[int(self._task_index[index])],
                      actions=self._actions[start + rows].copy(), action_mask=np.arange(t, t + self.action_chunk) < length,
                      episode_index=int(self.episode_indices[pos]), frame_index=t, index=index)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def all_actions(self) -> np.ndarray:
        """Every frame's action as float32 ``[len(self), action_dim]``: row ``i`` is frame ``i`` of the dataset (the
        first action of ``self[i].actions``), episodes in ``episode_starts`` order. A read-only view of the frames
        read at construction (no copy, no video decoding); ``.copy()`` it to change it."""
        return _read_only(self._actions)

    def all_proprio(self) -> np.ndarray | None:
        """Every frame's proprio (the ``state_key`` feature) as float32 ``[len(self), state_dim]``, row ``i`` =
        ``self[i].proprio``; None when the dataset has no proprio. A read-only view, like :meth:`all_actions`."""
        return None if self._states is None else _read_only(self._states)

    def episode(self, episode_index: int) -> EpisodeData:
        """Every frame of one episode (by its ``episode_index``)."""
        hits = np.flatnonzero(self.episode_indices == int(episode_index))
        if not len(hits):
            raise IndexError(f"the dataset has no episode {episode_index}")
        pos = int(hits[0])
        s, n = int(self.episode_starts[pos]), int(self.episode_lengths[pos])
        return EpisodeData(images=dict(self._episode_images(pos)), actions=self._actions[s:s + n].copy(),
                           states=None if self._states is None else self._states[s:s + n].copy(),
                           task=self.tasks[int(self._task_index[s])], episode_index=int(episode_index))

    def stored_stats(self) -> dict:
        """``meta/stats.json`` as written (feature -> stat name -> nested lists); {} if the file is absent."""
        path = self.root / STATS_PATH
        return _read_json(path) if path.is_file() else {}
