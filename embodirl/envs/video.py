"""Episode videos: one mp4 per finished episode of selected envs, with an optional caption (task, step,
chunk reward, success) under the picture.

:class:`VideoRecorder` consumes what :class:`~embodirl.envs.vector.vector_env.ProcessVectorEnv` returns for its
recorded envs (``record_env_ids``): ``info["frames"][i]`` holds one ``[h, w, 3]`` uint8 frame per
executed low-level step (cameras side by side), ``info["reset_frames"][i]`` the first frame of a new
episode. Frames stream into an open ffmpeg writer (no episode is held in memory); when the episode
ends the file is renamed to its final name, which says whether it succeeded::

    <out_dir>/step_120/libero_10_env3_task3_ep2_success.mp4

A restarted simulator's episode is invalid: its partial video is discarded.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import imageio.v2 as imageio
import numpy as np
from PIL import Image, ImageDraw, ImageFont

from embodirl.envs.base import VideoConfig

if TYPE_CHECKING:
    from imageio.core.format import Format

log = logging.getLogger(__name__)

CODEC = "libx264"
PIXEL_FORMAT = "yuv420p"         # plays everywhere; needs even width and height
MIN_CAPTION_WIDTH = 256          # frames narrower than this are enlarged (nearest) so captions are legible
CAPTION_FONT_PX = 13
CAPTION_LINE_PX = 16
CAPTION_MARGIN_PX = 4
CAPTION_BACKGROUND = (0, 0, 0)
CAPTION_TEXT = (255, 255, 255)
CAPTION_SUCCESS = (80, 230, 80)


def step_folder(step: int | None) -> str:
    """``step_<n>``, the one step-folder format of a run (checkpoints, evaluations, videos); ``""`` for None
    (a recorder whose output folder already is a step's, as evaluation's ``eval/step_<n>/videos/``)."""
    return "" if step is None else f"step_{int(step)}"


def episode_video_name(step: int | None, env_name: str, task_id: int, episode: int, success: bool,
                       env_id: int | None = None) -> str:
    """Relative file name of one episode's video, e.g. ``step_120/libero_10_env3_task3_ep2_success.mp4``."""
    env_part = "" if env_id is None else f"_env{env_id}"
    outcome = "success" if success else "fail"
    return str(Path(step_folder(step)) / f"{env_name}{env_part}_task{task_id}_ep{episode}_{outcome}.mp4")


def _font(size: int = CAPTION_FONT_PX):
    return ImageFont.load_default(size=size)


def caption(frame: np.ndarray, lines: Sequence[str], *, success: bool = False) -> np.ndarray:
    """``frame`` ``[h, w, 3]`` enlarged to at least :data:`MIN_CAPTION_WIDTH` wide, with ``lines`` of
    text in a black band underneath: ``[k*h + band, k*w, 3]`` with ``k = ceil(256 / w)`` (1 if wider).
    The last line is drawn green when ``success``."""
    h, w = frame.shape[:2]
    scale = max(1, math.ceil(MIN_CAPTION_WIDTH / w))
    big = frame.repeat(scale, axis=0).repeat(scale, axis=1) if scale > 1 else frame
    band = 2 * CAPTION_MARGIN_PX + CAPTION_LINE_PX * len(lines)
    canvas = Image.new("RGB", (w * scale, h * scale + band), CAPTION_BACKGROUND)
    canvas.paste(Image.fromarray(np.ascontiguousarray(big)), (0, 0))
    draw = ImageDraw.Draw(canvas)
    font = _font()
    for k, line in enumerate(lines):
        colour = CAPTION_SUCCESS if success and k == len(lines) - 1 else CAPTION_TEXT
        draw.text((CAPTION_MARGIN_PX, h * scale + CAPTION_MARGIN_PX + k * CAPTION_LINE_PX), line, fill=colour,
                  font=font)
    return np.asarray(canvas)


def caption_size(frame_hw: tuple[int, int], num_lines: int) -> tuple[int, int]:
    """``(height, width)`` of :func:`caption`'s output for a frame of ``frame_hw``."""
    h, w = frame_hw
    scale = max(1, math.ceil(MIN_CAPTION_WIDTH / w))
    return h * scale + 2 * CAPTION_MARGIN_PX + CAPTION_LINE_PX * num_lines, w * scale


def _even(frame: np.ndarray) -> np.ndarray:
    # yuv420p subsamples chroma 2x2: pad odd sizes by one black row / column
    h, w = frame.shape[:2]
    if h % 2 == 0 and w % 2 == 0:
        return frame
    return np.pad(frame, ((0, h % 2), (0, w % 2), (0, 0)))


class VideoWriter:
    """An mp4 written frame by frame to a temporary name, renamed by :meth:`finish` (atomic)."""

    def __init__(self, directory: str | os.PathLike, fps: float):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.tmp_path = self.directory / f".partial_{uuid.uuid4().hex}.mp4"
        self.fps = fps
        self.num_frames = 0
        self._writer: Format.Writer | None = None

    def append(self, frame: np.ndarray) -> None:
        if self._writer is None:
            self._writer = imageio.get_writer(self.tmp_path, fps=self.fps, codec=CODEC, pixelformat=PIXEL_FORMAT,
                                              macro_block_size=1, ffmpeg_log_level="error")
        self._writer.append_data(_even(frame))
        self.num_frames += 1

    def finish(self, path: str | os.PathLike) -> Path | None:
        """Close and move to ``path``; None (nothing written) when no frame was appended."""
        if self._writer is None:
            return None
        self._writer.close()
        self._writer = None
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp_path.replace(path)
        return path

    def discard(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.tmp_path.unlink(missing_ok=True)


def write_video(path: str | os.PathLike, frames: Sequence[np.ndarray], fps: float = 10) -> Path:
    """Write ``frames`` ``[h, w, 3]`` uint8 to an mp4 at ``path``."""
    writer = VideoWriter(Path(path).parent, fps)
    for frame in frames:
        writer.append(frame)
    result = writer.finish(path)
    if result is None:
        raise ValueError(f"no frames to write to {path}")
    return result


@dataclass
class _Episode:
    """The recording in progress for one env."""

    writer: VideoWriter
    task_id: int
    step: int = 0                        # low-level steps so far
    success: bool = False
    finished: bool = False


@dataclass
class VideoRecorder:
    """Accumulates frames of ``env_ids`` across chunks and episode boundaries and writes one mp4 per
    finished episode.

    Call :meth:`on_reset` with ``venv.reset``'s info and :meth:`on_step` with ``venv.step``'s outputs;
    :meth:`flush` at the end of a rollout writes what is open (unfinished episodes are named by
    their success so far). ``env_ids`` are local indices of the vector env; names use
    ``env_offset + i``. ``step`` is the training step in the folder name.
    """

    out_dir: str | os.PathLike
    env_ids: Sequence[int]
    env_name: str
    task_descriptions: Sequence[str]
    fps: float                           # env.*.video.fps
    overlay: bool                        # env.*.video.overlay
    env_offset: int = 0
    step: int | None = 0                 # None: files straight in out_dir (no step_<n> folder)
    written: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.env_ids = [int(i) for i in self.env_ids]
        self._episodes: dict[int, _Episode] = {}
        self._episode_index = {i: 0 for i in self.env_ids}

    @classmethod
    def for_env(cls, venv, out_dir: str | os.PathLike, video: VideoConfig, *, env_offset: int = 0, step: int | None = 0
                ) -> VideoRecorder:
        """A recorder of ``venv.record_env_ids`` named after ``venv.spec`` with an env split's typed ``video``
        section (``fps``, ``overlay``)."""
        return cls(out_dir, env_ids=venv.record_env_ids, env_name=venv.spec.name,
                   task_descriptions=venv.spec.task_descriptions, fps=video.fps, overlay=video.overlay,
                   env_offset=env_offset, step=step)

    # -- frames in -------------------------------------------------------------------------------
    def on_reset(self, info: dict) -> None:
        """Start episodes of the recorded envs that ``reset`` returned a first frame for."""
        for i in self.env_ids:
            frames = info["frames"][i]
            if frames:
                self._begin(i, int(info["task_id"][i]), frames[0])

    def on_step(self, reward: np.ndarray, terminated: np.ndarray, truncated: np.ndarray, info: dict) -> list[Path]:
        """Add one chunk's frames; returns the files written by episodes that ended here."""
        chunk_reward = reward.reshape(len(terminated), -1).sum(axis=1)             # (B,)
        done = np.logical_or(terminated, truncated)
        written: list[Path] = []
        for i in self.env_ids:
            episode = self._episodes.get(i)
            if info["restarted"][i]:      # the simulator was replaced: the episode is invalid
                if episode is not None:
                    self._discard(episode)
                    del self._episodes[i]
            elif episode is not None and not episode.finished:
                frames = info["frames"][i] or []
                episode.success |= bool(info["success"][i])
                for frame in frames:
                    episode.step += 1
                    self._add(episode, frame, float(chunk_reward[i]))
                if done[i]:
                    written += self._finish(i, episode)
            reset_frames = info.get("reset_frames", [None] * len(done))[i]
            if reset_frames:
                self._begin(i, int(info["task_id"][i]), reset_frames[0])
        return written

    def flush(self) -> list[Path]:
        """Write the open episodes (unfinished ones are named by their success so far)."""
        written: list[Path] = []
        for i, episode in list(self._episodes.items()):
            if not episode.finished:
                written += self._finish(i, episode)
        self._episodes.clear()
        return written

    def close(self) -> None:
        for episode in self._episodes.values():
            self._discard(episode)
        self._episodes.clear()

    # -- internals -------------------------------------------------------------------------------
    def _lines(self, episode: _Episode, chunk_reward: float | None) -> list[str]:
        reward = "-" if chunk_reward is None else f"{chunk_reward:.3f}"
        return [self.task_descriptions[episode.task_id][:60], f"step {episode.step}  chunk reward {reward}",
                "success" if episode.success else "not yet successful"]

    def _render(self, episode: _Episode, frame: np.ndarray, chunk_reward: float | None) -> np.ndarray:
        if not self.overlay:
            return frame
        return caption(frame, self._lines(episode, chunk_reward), success=episode.success)

    def _begin(self, i: int, task_id: int, frame: np.ndarray) -> None:
        if i in self._episodes and not self._episodes[i].finished:
            self._discard(self._episodes[i])          # a reset in the middle of an episode
        writer = VideoWriter(Path(self.out_dir) / step_folder(self.step), self.fps)
        episode = _Episode(writer, task_id)
        self._episodes[i] = episode
        self._add(episode, frame, None)

    def _add(self, episode: _Episode, frame: np.ndarray, chunk_reward: float | None) -> None:
        episode.writer.append(self._render(episode, frame, chunk_reward))

    @staticmethod
    def _discard(episode: _Episode) -> None:
        episode.writer.discard()

    def _finish(self, i: int, episode: _Episode) -> list[Path]:
        episode.finished = True
        name = episode_video_name(self.step, self.env_name, episode.task_id, self._episode_index[i], episode.success,
                                  env_id=self.env_offset + i)
        self._episode_index[i] += 1
        path = episode.writer.finish(Path(self.out_dir) / name)
        if path is None:
            return []
        self.written.append(path)
        log.debug("wrote %s (%d frames)", path, episode.writer.num_frames)
        return [path]
