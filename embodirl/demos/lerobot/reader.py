"""Reading a LeRobot v2.0/v2.1 dataset: :class:`LeRobotDataset` (the format: :mod:`embodirl.demos.lerobot`)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from embodirl.demos.lerobot.layout import (
    ACTION_KEY,
    CHUNK_SIZE,
    EPISODES_PATH,
    INFO_PATH,
    READABLE_VERSIONS,
    STATE_KEY,
    STATS_PATH,
    TASKS_PATH,
    DatasetError,
    EpisodeData,
    FeatureStats,
    Sample,
    _decode_image,
    camera_key,
    decode_video,
    probe_video,
)
from embodirl.paths import inside


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
    ``info.json`` order). ``video_cache_bytes``: how much decoded video is kept in memory (videos are decoded
    one whole episode at a time; the least recently used episodes go first, the newest always stays). A bound in
    bytes, not episodes: 100 PushCube episodes at 64 px are 14 MB and must all stay (with 64 of 100 kept, a
    batch of 32 random frames decoded a dozen episodes at every SFT step), while 64 LIBERO episodes at 256 px
    with two cameras would be about 12 GB.

    All metadata and parquet frames are read (and checked) at construction, and every video's container opened;
    videos are decoded on first use.

    Attributes: ``info`` (meta/info.json), ``episodes_meta`` (meta/episodes.jsonl rows), ``fps``, ``camera_keys``,
    ``action_dim``, ``state_dim`` (None without proprio), ``num_episodes``, ``episode_lengths`` (int64 [E]),
    ``episode_starts`` (int64 [E], global index of each episode's frame 0), ``tasks`` (task_index -> instruction),
    ``stats`` (feature key -> :class:`FeatureStats`, computed from the frames for ``action`` and the state feature).
    Every frame's actions and proprio at once, as arrays: :meth:`all_actions`, :meth:`all_proprio`.
    """

    def __init__(self, root: str | Path, *, action_chunk: int = 1, action_key: str = ACTION_KEY,
                 state_key: str | None = STATE_KEY, cameras: Sequence[str] | None = None,
                 video_cache_bytes: int = 2 << 30):
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
        for ep in self.episode_indices:          # every video's container, now (they are decoded on first use)
            for key in self._video_keys:
                probe_video(self._path("video_path", int(ep), key))
        self._video_cache: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._video_cache_bytes = int(video_cache_bytes)
        self.stats = {self.action_key: FeatureStats.of(self._actions)}
        if self.state_key is not None:
            assert self._states is not None     # read with the state key (there is at least one episode)
            self.stats[self.state_key] = FeatureStats.of(self._states)

    # -- loading -----------------------------------------------------------------------------------
    def _path(self, template_key: str, ep: int, video_key: str | None = None) -> Path:
        fields: dict[str, int | str] = dict(episode_chunk=ep // self.chunks_size, episode_index=ep)
        if video_key is not None:
            fields["video_key"] = video_key
        name = self.info[template_key].format(**fields)
        path = inside(self.root, name)
        if path is None:     # a dataset from elsewhere must not make this process read (or probe) files outside it
            raise DatasetError(f"{self.root / INFO_PATH}'s {template_key} names {name} for episode {ep}, outside the "
                               f"dataset folder {self.root}; a dataset's file names stay inside its folder")
        return path

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
        while len(self._video_cache) > 1 and self.video_cache_nbytes > self._video_cache_bytes:
            self._video_cache.popitem(last=False)
        return out

    @property
    def video_cache_nbytes(self) -> int:
        """Bytes of decoded frames held now."""
        return sum(a.nbytes for frames in self._video_cache.values() for a in frames.values())

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

    def convert_actions(self, convert) -> None:
        """Replace every frame's action by ``convert(actions)`` (``[len(self), action_dim]`` -> the same shape) and its
        statistics with the converted ones: ``embodirl sft`` reads the env's native actions a dataset records in the
        convention of the policy it trains (:meth:`embodirl.envs.conventions.ActionConversion.from_env`)."""
        converted = np.ascontiguousarray(convert(self._actions.copy()), dtype=np.float32)
        if converted.shape != self._actions.shape:
            raise ValueError(f"convert changed the actions' shape {self._actions.shape} to {converted.shape}")
        self._actions = converted
        self.stats[self.action_key] = FeatureStats.of(converted)

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
