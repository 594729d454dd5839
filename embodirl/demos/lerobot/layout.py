"""The LeRobot v2.1 layout shared by the writer and the reader: paths, feature keys, codecs, the error, the
sample types, statistics and video encoding/decoding (the format: :mod:`embodirl.demos.lerobot`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

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
        # PyAV types a codec named by a plain str as any stream kind; VIDEO_CODECS are video codecs
        stream = cast("av.VideoStream", container.add_stream(codec, rate=int(fps), options=dict(options)))
        stream.width, stream.height, stream.pix_fmt = w, h, pix_fmt
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def probe_video(path: Path) -> None:
    """Open an mp4's container and find its video stream without decoding a frame (milliseconds): a missing,
    truncated or garbage file is a :class:`DatasetError` when the dataset is opened, not mid-training."""
    import av

    if not path.is_file():
        raise DatasetError(f"{path} is missing (a video of the dataset)")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise DatasetError(f"{path} holds no video stream")
    except (av.FFmpegError, ValueError, IndexError) as exc:
        raise DatasetError(f"{path} is not a readable video ({type(exc).__name__}: {exc}); the dataset is damaged: "
                           "write it again") from None


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
    try:        # a cell without bytes (None) is an empty buffer: not an image
        return np.asarray(Image.open(io.BytesIO(b"" if data is None else data)).convert("RGB"), np.uint8)
    except Exception as exc:
        raise DatasetError(f"{where} holds an image that could not be decoded ({exc})") from None


# --------------------------------------------------------------------------------------------------
# writer
# --------------------------------------------------------------------------------------------------
