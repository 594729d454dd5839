"""Dataset statistics in OpenVLA-OFT's ``dataset_statistics.json`` format, and actor batches from a
:class:`~embodirl.demos.lerobot.reader.LeRobotDataset`.

Statistics (OpenVLA's ``save_dataset_statistics`` layout, one entry under ``unnorm_key``)::

    {key: {"action":  {"mean", "std", "max", "min", "q01", "q99": [A], "mask": [A]},
           "proprio": {... [S], "mask": [S]},  "num_transitions": int, "num_trajectories": int}}

``mask`` is False for an action dimension that only takes two values inside [-1, 1] (a binary gripper command,
already in the action tokens' range: OFT's LIBERO statistics leave the gripper unnormalised the same way), True
elsewhere; proprio dimensions are all normalised.

Batches: ``batch_indices(step)`` is a pure function of the step (epoch ``e`` visits the frames in the order of
a permutation drawn from ``(seed, e)``), so a resumed run draws exactly the samples a straight run would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from embodirl import data as D
from embodirl.models.normalization import BoundsNormalizer

#: ``model.normalization`` of policies that standardise (π0): ``(x - mean) / (std + 1e-8)``, as PI0Processor does
MEAN_STD = "mean_std"


class Standardizer:
    """Actions in dataset units -> standardised with one statistics block's ``mean`` and ``std``."""

    def __init__(self, entry: Mapping):
        self.mean = torch.as_tensor(entry["mean"], dtype=torch.float32)
        self.std = torch.as_tensor(entry["std"], dtype=torch.float32)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.float32) - self.mean) / (self.std + 1e-8)


def _feature(stats, mask: np.ndarray) -> dict:
    return {"mean": stats.mean.tolist(), "std": stats.std.tolist(), "max": stats.max.tolist(),
            "min": stats.min.tolist(), "q01": stats.q01.tolist(), "q99": stats.q99.tolist(),
            "mask": [bool(m) for m in mask]}


def action_mask(actions: np.ndarray) -> np.ndarray:
    """Per action dimension: False for a binary command inside [-1, 1] (left unnormalised), else True."""
    actions = np.asarray(actions, np.float64)
    mask = []
    for column in actions.T:
        values = np.unique(column)
        binary = len(values) == 2 and values.min() >= -1.0 and values.max() <= 1.0
        mask.append(not binary)
    return np.asarray(mask, bool)


def dataset_statistics(dataset, unnorm_key: str) -> dict:
    """The ``dataset_statistics.json`` content for ``dataset`` (a LeRobotDataset) under ``unnorm_key``."""
    action_stats = dataset.stats[dataset.action_key]
    entry = {"action": _feature(action_stats, action_mask(dataset.all_actions())),
             "num_transitions": int(len(dataset)), "num_trajectories": int(dataset.num_episodes)}
    if dataset.state_key is not None:
        state_stats = dataset.stats[dataset.state_key]
        entry["proprio"] = _feature(state_stats, np.ones(len(state_stats.q01), bool))
    return {unnorm_key: entry}


def batch_indices(num_samples: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Frame indices of training step ``step`` (1-based): positions ``(step-1)*B .. step*B`` of the endless
    sequence of per-epoch permutations."""
    start = (int(step) - 1) * int(batch_size)
    out: list[int] = []
    position = start
    while len(out) < batch_size:
        epoch, offset = divmod(position, num_samples)
        order = np.random.default_rng([int(seed), int(epoch)]).permutation(num_samples)
        take = order[offset: offset + batch_size - len(out)]
        out.extend(int(i) for i in take)
        position += len(take)
    return np.asarray(out, np.int64)


class BatchMaker:
    """Samples -> the actor's SFT batch: ``images`` uint8 ``[B, V, 3, h, w]`` (the env's cameras, in its
    order), ``state`` float32 ``[B, S]`` (raw; the policy normalises it with the same statistics),
    ``instruction`` (list), ``actions`` float32 ``[B, H, A]`` normalised to [-1, 1] with the statistics' bounds, or
    standardised with their mean and std (``normalization="mean_std"``, π0)."""

    def __init__(self, dataset, statistics_entry: Mapping, camera_keys: Sequence[str], *, use_state: bool,
                 normalization: str = "bounds_q99"):
        self.dataset = dataset
        self.camera_keys = list(camera_keys)
        self.use_state = use_state
        self.normalizer = (Standardizer(statistics_entry["action"]) if normalization == MEAN_STD
                           else BoundsNormalizer.from_statistics(statistics_entry["action"], normalization))

    def __call__(self, indices: Sequence[int] | np.ndarray) -> dict:
        samples = [self.dataset[int(i)] for i in indices]
        images = np.stack([np.stack([s.images[k].transpose(2, 0, 1) for k in self.camera_keys]) for s in samples])
        actions = torch.as_tensor(np.stack([s.actions for s in samples]), dtype=torch.float32)   # (B, H, A)
        batch = {D.IMAGES: torch.from_numpy(np.ascontiguousarray(images)),
                 "instruction": [s.instruction for s in samples],
                 "actions": self.normalizer.normalize(actions)}
        if self.use_state:
            batch[D.STATE] = torch.as_tensor(np.stack([s.proprio for s in samples]), dtype=torch.float32)
        return batch
