"""Action tokens <-> normalised actions, against OpenVLA's numpy formulation."""

import numpy as np
import pytest
import torch

from embodirl.models.action_tokenizer import LLAMA_BASE_VOCAB_SIZE, ActionTokenizer


def openvla_reference_encode(actions: np.ndarray, n_bins: int = 256, vocab: int = 32000) -> np.ndarray:
    """OpenVLA's tokenizer written with numpy (clip, digitize, vocab - bin)."""
    bins = np.linspace(-1, 1, n_bins)
    return vocab - np.digitize(np.clip(actions, -1.0, 1.0), bins)


def openvla_reference_decode(ids: np.ndarray, n_bins: int = 256, vocab: int = 32000) -> np.ndarray:
    bins = np.linspace(-1, 1, n_bins)
    centers = (bins[:-1] + bins[1:]) / 2.0
    return centers[np.clip(vocab - ids - 1, 0, centers.shape[0] - 1)]


def test_action_ids_are_the_last_256_of_the_base_vocabulary():
    tok = ActionTokenizer()
    assert (tok.first_id, tok.end_id) == (LLAMA_BASE_VOCAB_SIZE - 256, LLAMA_BASE_VOCAB_SIZE) == (31744, 32000)
    grid = torch.linspace(-1.5, 1.5, 10001)
    ids = tok.encode(grid)
    assert ids.dtype == torch.int64
    assert bool(tok.is_action_id(ids).all())
    assert set(ids.tolist()) == set(range(31744, 32000))  # every id is reachable, nothing else


def test_encode_decode_match_openvla_numpy():
    tok = ActionTokenizer()
    rng = np.random.default_rng(0)
    actions = np.concatenate([rng.uniform(-1.2, 1.2, 5000), np.linspace(-1, 1, 256), [-1.0, 1.0, 0.0]])
    ids = tok.encode(torch.from_numpy(actions))
    np.testing.assert_array_equal(ids.numpy(), openvla_reference_encode(actions))
    np.testing.assert_allclose(tok.decode(ids).numpy(), openvla_reference_decode(ids.numpy()).astype(np.float32))


def test_token_action_round_trip():
    tok = ActionTokenizer()
    ids = torch.arange(tok.first_id, tok.end_id)
    back = tok.encode(tok.decode(ids))
    # every id but the one reached only by +1.0 exactly maps to its own bin centre and back
    assert torch.equal(back[1:], ids[1:])
    assert back[0].item() == tok.first_id + 1  # id 31744 shares the last centre with 31745 (OpenVLA's scheme)
    actions = torch.rand(1000, dtype=torch.float64) * 2 - 1
    err = (tok.decode(tok.encode(actions)).double() - actions).abs()
    assert err.max().item() <= tok.bin_width() / 2 + 1e-6


def test_index_ids_conversion_and_restricted_range():
    tok = ActionTokenizer(num_bins=16)
    index = torch.arange(16)
    ids = tok.index_to_ids(index)
    assert ids.min().item() == 32000 - 16 and ids.max().item() == 31999
    assert torch.equal(tok.ids_to_index(ids), index)
    assert not bool(tok.is_action_id(torch.tensor([31983, 32000, 0])).any())


def test_invalid_bin_count():
    with pytest.raises(ValueError):
        ActionTokenizer(num_bins=1)
