"""File names a checkpoint's own index gives (``model.safetensors.index.json``'s ``weight_map``) stay inside the
checkpoint folder: a shard named ``../...`` (a checkpoint downloaded from elsewhere) is refused in one sentence
instead of being read from outside it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from embodirl.models.openvla_oft.weights import INDEX_FILE, CheckpointError, weight_files


def test_a_weight_map_outside_the_checkpoint_is_refused_in_one_sentence(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.zeros(2)}, tmp_path / "elsewhere.safetensors")      # a real file where the name points
    save_file({"v": torch.zeros(2)}, ckpt / "model-00001-of-00001.safetensors")
    (ckpt / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {
        "v": "model-00001-of-00001.safetensors", "w": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError) as exc:
        weight_files(ckpt)
    message = str(exc.value)
    assert "\n" not in message and message.startswith(f"model.path: {ckpt / INDEX_FILE} lists ../elsewhere")
    assert "outside the checkpoint" in message
