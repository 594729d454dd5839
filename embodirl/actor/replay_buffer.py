"""Which trajectories the actor trains on: on-policy hand-off, or reuse of the last K rollouts.

``actor.replay_buffer``:

* ``reuse_last_k: 0`` (default) - on-policy: each rollout is trained on once, right after it was
  collected, and dropped.
* ``reuse_last_k: K > 0`` - the newest rollout is trained on together with up to K earlier ones whose
  rows are at most ``max_staleness`` weight versions old (``staleness = actor version -
  weight_version`` of the row's decisions). Older rows are dropped. The actor corrects for the
  policy change with importance weights from the stored behaviour log-probs (decoupled PPO, Hilton et
  al. 2022: the ratio is clipped against the current "proximal" policy, and the loss is weighted by
  ``pi_prox / pi_behaviour``, truncated).
* ``max_bytes`` bounds the memory: the oldest rollouts are evicted until the total fits (the newest is
  always kept). :meth:`ReplayBuffer.stats` reports the bytes held.

Rollouts are stored as they were prepared (advantages included), on CPU.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping

import torch
from tensordict import TensorDict

from embodirl import data as D
from embodirl.schema import sections

log = logging.getLogger(__name__)


def batch_nbytes(batch: TensorDict) -> int:
    # every leaf is a tensor (non-tensor data is a tensor collection, never a leaf): the check only narrows the type
    leaves = batch.values(include_nested=True, leaves_only=True)
    return int(sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)))


def row_versions(batch: TensorDict, default: int) -> torch.Tensor:
    """The weight version of each row ``(N,)`` (the oldest of its valid decisions); ``default`` when
    the batch carries no ``weight_version``."""
    N = batch.batch_size[0]
    if D.WEIGHT_VERSION not in batch.keys():
        return torch.full((N,), int(default), dtype=torch.int64)
    version = batch.get(D.WEIGHT_VERSION)
    valid = batch.get(D.VALID)
    big = torch.iinfo(torch.int64).max
    oldest = torch.where(valid, version, torch.full_like(version, big)).min(-1).values  # (N,)
    return torch.where(oldest == big, version[:, 0], oldest)


class ReplayBuffer:
    """Holds the last ``reuse_last_k + 1`` prepared rollouts (see module docstring)."""

    def __init__(self, *, reuse_last_k: int = 0, max_staleness: int = 1, max_bytes: float | None = None):
        if reuse_last_k < 0:
            raise ValueError(f"reuse_last_k must be >= 0, got {reuse_last_k}")
        self.reuse_last_k = int(reuse_last_k)
        self.max_staleness = int(max_staleness)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self._rollouts: deque[TensorDict] = deque()
        self.dropped_rows = 0

    @classmethod
    def from_config(cls, replay: sections.ReplayBufferSection) -> ReplayBuffer:
        """From the typed ``actor.replay_buffer`` section."""
        return cls(reuse_last_k=replay.reuse_last_k, max_staleness=replay.max_staleness, max_bytes=replay.max_bytes)

    @property
    def nbytes(self) -> int:
        return sum(batch_nbytes(b) for b in self._rollouts)

    def __len__(self) -> int:
        return len(self._rollouts)

    def add(self, batch: TensorDict, version: int | None = None) -> None:
        """Store a prepared rollout (moved to CPU); evict beyond K + 1 rollouts and ``max_bytes``.
        A rollout without ``weight_version`` is stamped with ``version`` (the weights that made it)."""
        batch = batch.to("cpu")
        if D.WEIGHT_VERSION not in batch.keys() and version is not None:
            batch = batch.copy()
            batch.set(D.WEIGHT_VERSION, torch.full(batch.batch_size, int(version), dtype=torch.int64))
        self._rollouts.append(batch)
        while len(self._rollouts) > self.reuse_last_k + 1:
            self._rollouts.popleft()
        while self.max_bytes is not None and len(self._rollouts) > 1 and self.nbytes > self.max_bytes:
            self._rollouts.popleft()
        if self.max_bytes is not None and self.nbytes > self.max_bytes:
            log.warning("replay buffer: the newest rollout alone (%.1f MB) exceeds max_bytes (%.1f MB)",
                        self.nbytes / 2**20, self.max_bytes / 2**20)

    def sample(self, current_version: int) -> TensorDict:
        """The rows to train on now: the newest rollout plus the reusable rows of earlier ones
        (staleness <= ``max_staleness``), concatenated along N. In on-policy mode the buffer is
        emptied. Earlier rollouts must share the newest one's T and fields."""
        if not self._rollouts:
            raise RuntimeError("the replay buffer is empty: add a rollout before sampling")
        newest = self._rollouts[-1]
        parts = []
        for batch in list(self._rollouts)[:-1]:
            staleness = current_version - row_versions(batch, current_version)  # (N,)
            keep = staleness <= self.max_staleness
            self.dropped_rows += int((~keep).sum())
            if keep.any():
                parts.append(batch[keep])
        parts.append(newest)
        if self.reuse_last_k == 0:
            self._rollouts.clear()
        return parts[0] if len(parts) == 1 else D.concat(parts)

    def state_dict(self) -> dict:
        """The held rollouts as plain nested dicts of CPU tensors (loadable with ``weights_only``)."""
        return {"rollouts": [{"batch_size": list(b.batch_size), "data": b.to_dict()} for b in self._rollouts],
                "dropped_rows": self.dropped_rows}

    def load_state_dict(self, state: Mapping) -> None:
        self._rollouts = deque(TensorDict(r["data"], batch_size=r["batch_size"]) for r in state["rollouts"])
        self.dropped_rows = int(state["dropped_rows"])

    def stats(self) -> dict[str, torch.Tensor]:
        return {"replay/bytes": torch.tensor(float(self.nbytes)), "replay/rollouts": torch.tensor(float(len(self))),
                "replay/dropped_rows": torch.tensor(float(self.dropped_rows))}
