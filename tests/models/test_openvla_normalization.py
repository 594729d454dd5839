"""Dataset statistics: un-normalisation with a gripper mask, proprio normalisation, unnorm_key resolution."""

import numpy as np
import pytest
import torch

from embodirl.errors import ConfigError
from embodirl.models.normalization import BoundsNormalizer, resolve_unnorm_key

ACTION_STATS = {"q01": [-0.5, -0.2, -1.0, 0.0, -0.1, -0.3, -1.0], "q99": [0.5, 0.6, 1.0, 0.2, 0.1, 0.3, 1.0],
                "min": [-1.0] * 7, "max": [1.0] * 7, "mask": [True] * 6 + [False]}
STATS = {"libero_10_no_noops": {"action": ACTION_STATS,
                                "proprio": {"q01": [-1.0] * 8, "q99": [3.0] * 8, "mask": [True] * 8}},
         "libero_spatial": {"action": ACTION_STATS}}


def test_unnormalize_matches_openvla_formula_and_passes_gripper_through():
    norm = BoundsNormalizer.from_statistics(ACTION_STATS, "bounds_q99")
    x = torch.rand(5, 8, 7) * 2 - 1  # (B, H, A) in [-1, 1]
    out = norm.unnormalize(x)
    low, high, mask = (np.array(ACTION_STATS[k]) for k in ("q01", "q99", "mask"))
    expected = np.where(mask, 0.5 * (x.numpy() + 1) * (high - low + 1e-8) + low, x.numpy())
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[..., 6], x[..., 6])  # gripper dimension untouched
    # the inverse recovers the policy space on masked dims
    np.testing.assert_allclose(norm.normalize(out)[..., :6].numpy(), x[..., :6].numpy(), atol=1e-5)


def test_bounds_uses_min_max():
    norm = BoundsNormalizer.from_statistics(ACTION_STATS, "bounds")
    assert torch.equal(norm.low, torch.full((7,), -1.0)) and torch.equal(norm.high, torch.ones(7))


def test_proprio_normalisation_clips():
    norm = BoundsNormalizer.from_statistics(STATS["libero_10_no_noops"]["proprio"])
    x = torch.tensor([[-1.0, 1.0, 3.0, 10.0, -10.0, 0.0, 2.0, 1.5]])
    out = norm.normalize(x)
    np.testing.assert_allclose(out.numpy(), [[-1.0, 0.0, 1.0, 1.0, -1.0, -0.5, 0.5, 0.25]], atol=1e-6)


def test_identity_passes_everything_through_exactly():
    norm = BoundsNormalizer.identity(7)
    x = torch.randn(4, 7) * 3
    assert torch.equal(norm.unnormalize(x), x) and torch.equal(norm.normalize(x), x)


def test_unnorm_key_resolution():
    assert resolve_unnorm_key(STATS, "libero_10") == "libero_10_no_noops"
    assert resolve_unnorm_key(STATS, "libero_spatial") == "libero_spatial"
    assert resolve_unnorm_key({"only": {}}, None) == "only"
    with pytest.raises(ConfigError, match=r"'libero_goal'.*available: libero_10_no_noops, libero_spatial"):
        resolve_unnorm_key(STATS, "libero_goal")
    with pytest.raises(ConfigError, match="several datasets"):
        resolve_unnorm_key(STATS, None)


def test_bad_statistics_rejected():
    with pytest.raises(ValueError, match="q99"):
        BoundsNormalizer.from_statistics({"q01": [0.0]})
    with pytest.raises(ConfigError, match="model.normalization"):
        BoundsNormalizer.from_statistics(ACTION_STATS, "normal")
