"""Dataset statistics and (un-)normalisation of actions and proprio, as OpenVLA-OFT checkpoints use them.

A fine-tuned OpenVLA(-OFT) checkpoint ships ``dataset_statistics.json`` (and a copy as ``norm_stats`` in
``config.json``)::

    {"libero_10_no_noops": {"action":  {"mean", "std", "max", "min", "q01", "q99": [A], "mask": [A] bool},
                            "proprio": {... same keys, [S] ...},
                            "num_transitions": int, "num_trajectories": int}, ...}

The policy emits actions in [-1, 1]; :class:`BoundsNormalizer` maps them back to the dataset's range
with the 1st/99th percentiles (``bounds_q99``, LIBERO/Bridge) or min/max (``bounds``, ALOHA). Dimensions
whose ``mask`` entry is False (the gripper) pass through unchanged. The statistics entry is chosen with
``unnorm_key``; OpenVLA-OFT's LIBERO checkpoints name their entries ``<suite>_no_noops``, so a key is
tried as given and then with that suffix.

Without statistics (a randomly initialised policy) the normaliser is the identity over [-1, 1]: every
dimension is masked out, so values pass through exactly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from embodirl.errors import ConfigError

STATS_FILENAME = "dataset_statistics.json"
NO_NOOPS_SUFFIX = "_no_noops"
#: OpenVLA adds this to ``high - low`` so that constant dimensions do not divide by zero.
BOUNDS_EPS = 1e-8
#: normalisation type -> (low key, high key) in the statistics
BOUNDS_KEYS = {"bounds_q99": ("q01", "q99"), "bounds": ("min", "max")}


def load_statistics(path: str | Path) -> dict:
    """Read a ``dataset_statistics.json`` file."""
    with open(path) as f:
        return json.load(f)


def resolve_unnorm_key(stats: Mapping, key: str | None, config_key: str = "model.unnorm_key") -> str:
    """The statistics entry for ``key``: ``key`` itself, else ``key + '_no_noops'``; ``None`` is
    accepted when there is exactly one entry. Raises :class:`ConfigError` listing the available keys."""
    available = sorted(stats)
    if key is None:
        if len(available) == 1:
            return available[0]
        raise ConfigError(config_key, f"the checkpoint has statistics for several datasets; choose one of: "
                                      f"{', '.join(available)}")
    for candidate in (key, key + NO_NOOPS_SUFFIX):
        if candidate in stats:
            return candidate
    raise ConfigError(config_key, f"'{key}' (or '{key}{NO_NOOPS_SUFFIX}') is not in the checkpoint's dataset "
                                  f"statistics; available: {', '.join(available) or 'none'}")


class BoundsNormalizer(torch.nn.Module):
    """Affine map between a dataset's ``[low, high]`` and [-1, 1] on the masked dimensions.

    Buffers (float32 ``[D]``): ``low``, ``high``, ``mask`` (bool), created on ``device`` (default: torch's
    current default device) and moved by ``.to()``. Elementwise over ``(..., D)``.
    """

    low: torch.Tensor
    high: torch.Tensor
    mask: torch.Tensor

    def __init__(self, low, high, mask=None, *, clip: bool = True, device: torch.device | str | None = None):
        super().__init__()
        self.clip = clip
        low = torch.as_tensor(low, dtype=torch.float32, device=device)
        high = torch.as_tensor(high, dtype=torch.float32, device=device)
        mask = (torch.ones_like(low, dtype=torch.bool) if mask is None
                else torch.as_tensor(mask, dtype=torch.bool, device=low.device))
        if not (low.shape == high.shape == mask.shape) or low.ndim != 1:
            raise ValueError(f"low/high/mask must be 1-D of one length, got {tuple(low.shape)}, "
                             f"{tuple(high.shape)}, {tuple(mask.shape)}")
        self.register_buffer("low", low)
        self.register_buffer("high", high)
        self.register_buffer("mask", mask)

    @classmethod
    def identity(cls, dim: int, *, device: torch.device | str | None = None) -> BoundsNormalizer:
        """Pass-through (no statistics): every dimension masked out and no clipping, so values are
        returned unchanged in both directions."""
        return cls([-1.0] * dim, [1.0] * dim, [False] * dim, clip=False, device=device)

    @classmethod
    def from_statistics(cls, entry: Mapping, kind: str = "bounds_q99", *,
                        device: torch.device | str | None = None) -> BoundsNormalizer:
        """From one ``{"q01", "q99", "min", "max", "mask", ...}`` block of the statistics."""
        if kind not in BOUNDS_KEYS:
            raise ConfigError("model.normalization", f"unknown normalisation '{kind}'; use one of "
                                                     f"{', '.join(BOUNDS_KEYS)}")
        low_key, high_key = BOUNDS_KEYS[kind]
        missing = [k for k in (low_key, high_key) if k not in entry]
        if missing:
            raise ValueError(f"dataset statistics lack {missing} needed for '{kind}' normalisation")
        return cls(entry[low_key], entry[high_key], entry.get("mask"), device=device)

    @property
    def dim(self) -> int:
        return self.low.shape[0]

    def unnormalize(self, x: torch.Tensor) -> torch.Tensor:
        """[-1, 1] -> dataset units on masked dims; ``(..., D)`` float32."""
        x = x.to(torch.float32)
        scaled = 0.5 * (x + 1.0) * (self.high - self.low + BOUNDS_EPS) + self.low  # (..., D)
        return torch.where(self.mask, scaled, x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Dataset units -> [-1, 1] on masked dims; the result is clipped to [-1, 1] as OpenVLA-OFT does
        for proprio (except for the identity normaliser)."""
        x = x.to(torch.float32)
        scaled = 2.0 * (x - self.low) / (self.high - self.low + BOUNDS_EPS) - 1.0  # (..., D)
        out = torch.where(self.mask, scaled, x)
        return out.clamp(-1.0, 1.0) if self.clip else out
