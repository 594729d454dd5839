"""RNG states in checkpoints: JSON that restores the python / numpy / torch generators exactly, read
without unpickling anything (issue 11), and old pickled ``rng.pt`` files read only by torch's restricted
unpickler."""

from __future__ import annotations

import json
import logging
import pickle
import random

import numpy as np
import pytest
import torch

from embodirl import checkpoint_layout as layout
from embodirl.runner import checkpoint as ckpt
from embodirl.runtime import rng_state, rng_state_from_json, rng_state_to_json, set_rng_state

#: first bytes of a pickle (protocol >= 2) and of a zip archive (torch.save)
PICKLE_MAGIC, ZIP_MAGIC = b"\x80", b"PK"


def _draws() -> tuple:
    """Numbers from every generator the state covers, including the cached-Gaussian paths."""
    return (random.random(), random.gauss(0.0, 1.0), np.random.rand(3).tolist(), np.random.randn(3).tolist(),
            torch.rand(3).tolist(), torch.randint(0, 1 << 30, (3,)).tolist())


def _advanced_state(seed: int = 0) -> dict:
    """A state with python's and numpy's cached Gaussian set (an odd number of normals drawn)."""
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    _draws()   # one python and three numpy normals: each keeps the second of its pair cached
    return rng_state()


def test_json_round_trip_draws_the_same_numbers():
    state = _advanced_state()
    assert state["python"][2] is not None and state["numpy"][3] == 1   # cached Gaussians are part of it
    expected = _draws()
    restored = rng_state_from_json(json.loads(json.dumps(rng_state_to_json(state))))
    assert restored["python"] == state["python"]
    assert restored["numpy"][0] == state["numpy"][0] and np.array_equal(restored["numpy"][1], state["numpy"][1])
    assert restored["numpy"][1].dtype == np.uint32 and restored["numpy"][2:] == state["numpy"][2:]
    assert torch.equal(restored["torch"], state["torch"]) and restored["torch"].dtype == torch.uint8
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    set_rng_state(restored)
    assert _draws() == expected


def test_cuda_states_round_trip_as_a_list():
    state = _advanced_state()
    state["cuda"] = [torch.arange(16, dtype=torch.uint8), torch.full((16,), 255, dtype=torch.uint8)]
    restored = rng_state_from_json(json.loads(json.dumps(rng_state_to_json(state))))
    assert [t.tolist() for t in restored["cuda"]] == [t.tolist() for t in state["cuda"]]


def _no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint's RNG state was unpickled")

    class Refused(pickle.Unpickler):
        def __init__(self, *args, **kwargs):
            refuse()

    for name in ("load", "loads"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(pickle, "Unpickler", Refused)
    monkeypatch.setattr(torch, "load", refuse)


def test_runner_part_holds_no_pickle_and_restores_without_unpickling(tmp_path, monkeypatch):
    driver = _advanced_state(0)
    workers = [_advanced_state(1), _advanced_state(2)]
    set_rng_state(driver)

    def write_runner(folder):   # what the runner's part writes besides state.json
        ckpt.save_rng(folder)
        ckpt.save_worker_rng(folder, workers)

    path = ckpt.save_checkpoint(tmp_path, 1, {layout.RUNNER: write_runner})
    runner = path / layout.RUNNER
    assert sorted(p.name for p in runner.iterdir()) == [layout.RNG, layout.WORKER_RNG]
    for file in runner.iterdir():
        head = file.read_bytes()[:2]
        assert not head.startswith(PICKLE_MAGIC) and head != ZIP_MAGIC, file
        json.loads(file.read_text())
    expected = _draws()

    _no_unpickling(monkeypatch)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    ckpt.load_rng(runner)
    assert _draws() == expected
    loaded = ckpt.load_worker_rng(runner)
    assert len(loaded) == 2
    for got, want in zip(loaded, workers):
        assert got["python"] == want["python"] and torch.equal(got["torch"], want["torch"])
        assert np.array_equal(got["numpy"][1], want["numpy"][1]) and got["numpy"][2:] == want["numpy"][2:]
    assert ckpt.load_worker_rng(tmp_path) is None   # no worker file: in-process workers


def test_old_pickled_rng_files_load_with_weights_only(tmp_path):
    driver, worker = _advanced_state(0), _advanced_state(1)
    torch.save(driver, tmp_path / layout.LEGACY_RNG)            # the format before rng.json
    torch.save([worker], tmp_path / layout.LEGACY_WORKER_RNG)
    set_rng_state(driver)
    expected = _draws()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    ckpt.load_rng(tmp_path)
    assert _draws() == expected
    [loaded] = ckpt.load_worker_rng(tmp_path)
    assert loaded["python"] == worker["python"] and np.array_equal(loaded["numpy"][1], worker["numpy"][1])


class _RunsCode:
    """A pickle that would create a folder when unpickled without restrictions."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        import os

        return os.makedirs, (self.target,)


def test_old_rng_file_with_code_is_not_run_and_the_generators_stay(tmp_path, caplog):
    target = tmp_path / "ran"
    state = _advanced_state(0)
    state["python"] = _RunsCode(target)
    torch.save(state, tmp_path / layout.LEGACY_RNG)
    torch.save([state], tmp_path / layout.LEGACY_WORKER_RNG)
    current = _advanced_state(3)
    expected = _draws()
    set_rng_state(current)
    with caplog.at_level(logging.WARNING, logger=ckpt.log.name):
        ckpt.load_rng(tmp_path)
        assert ckpt.load_worker_rng(tmp_path) is None
    assert not target.exists()
    assert _draws() == expected   # not restored: the generators keep their state
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("RNG state not restored" in w for w in warnings)


def test_a_missing_rng_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        ckpt.load_rng(tmp_path)
