"""File names a dataset's own metadata gives (``meta/info.json``'s ``data_path`` and ``video_path`` templates) stay
inside the dataset's folder: a template that climbs out with ``../`` (a dataset downloaded from elsewhere) is refused
in one sentence before any file outside is read, where the reader used to read whatever it named."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from embodirl.demos.lerobot.layout import DATA_PATH, INFO_PATH, DatasetError
from embodirl.demos.lerobot.reader import LeRobotDataset
from embodirl.demos.lerobot.writer import LeRobotWriter


@pytest.mark.parametrize("key, template", [
    ("data_path", "../elsewhere/episode_{episode_index:06d}.parquet"),
    ("video_path", "/tmp/videos/{video_key}/episode_{episode_index:06d}.mp4"),
])
def test_a_template_outside_the_dataset_is_refused_in_one_sentence(tmp_path, key, template):
    root = tmp_path / "demo"
    rng = np.random.default_rng(0)
    with LeRobotWriter(root, fps=10, cameras={"base_camera": (8, 8)}, action_dim=2) as writer:
        writer.add_episode(images={"base_camera": rng.integers(0, 256, (3, 8, 8, 3), dtype=np.uint8)},
                           actions=rng.normal(size=(3, 2)).astype(np.float32), task="push")
    if key == "data_path":    # the parquet file is where the template points: only the folder rule stops the read
        (tmp_path / "elsewhere").mkdir()
        shutil.copy(root / DATA_PATH.format(episode_chunk=0, episode_index=0),
                    tmp_path / "elsewhere" / "episode_000000.parquet")
    info = json.loads((root / INFO_PATH).read_text())
    info[key] = template
    (root / INFO_PATH).write_text(json.dumps(info))
    with pytest.raises(DatasetError) as exc:
        LeRobotDataset(root)
    message = str(exc.value)
    assert "\n" not in message and f"{root / INFO_PATH}'s {key} names " in message
    assert f"outside the dataset folder {root}" in message
