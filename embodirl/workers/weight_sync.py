"""Weight sync from the actor to inference workers, with a version counter.

After each update the actor publishes ``(version, tensors)``: the trainable tensors it changed (LoRA
adapter, value head). :class:`WeightPublisher` (driver side) keeps a CPU snapshot of every trainable
tensor it has seen, drops the ones whose values did not change, and produces a
:class:`WeightUpdate` *delta* ``base_version -> version``. Inference workers hold a
:class:`WeightReceiver`: a delta applies only on top of its base version, so a worker can never mix
tensors of different updates; a worker that missed one (it was restarted, or it is new) gets a *full*
update - the snapshot of every trainable tensor at the latest version - instead.

Every decision an inference worker makes carries the receiver's version (``weight_version`` in the
trajectory), which proves which weights produced which decision. No Ray here: the worker layer moves
updates (one ``ray.put`` shared by all inference workers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

INITIAL_VERSION = 0   # the weights a worker was built with (checkpoint or initialisation)


class WeightVersionError(RuntimeError):
    """An update does not apply to the receiver's version (it needs a full update)."""


@dataclass
class WeightUpdate:
    """Tensors moving ``base_version -> version``. ``full``: every trainable tensor (applies on any
    base); otherwise only the changed ones (applies on ``base_version`` exactly)."""

    version: int
    base_version: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    full: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class WeightPublisher:
    """Driver-side bookkeeping of published weights (see module docstring).

    ``initial`` is the trainable state the inference workers start from (version ``INITIAL_VERSION``);
    the snapshot only ever holds CPU tensors.
    """

    def __init__(self, initial: Mapping[str, torch.Tensor] | None = None, version: int = INITIAL_VERSION):
        self.version = int(version)
        self._snapshot: dict[str, torch.Tensor] = {k: _cpu(v) for k, v in (initial or {}).items()}

    def publish_weights(self, tensors: Mapping[str, torch.Tensor] | None = None, version: int | None = None, *,
                        full: bool = False) -> WeightUpdate:
        """Record an actor update and return the delta to send. ``version`` defaults to the next one
        and must increase. Tensors equal to the snapshot are left out of the delta. ``full`` (no ``tensors``):
        every trainable tensor at the current version instead (for new or restarted workers)."""
        if full:
            if tensors is not None:
                raise TypeError("publish_weights(full=True) sends the snapshot; start over from tensors with reset()")
            return WeightUpdate(version=self.version, base_version=self.version, tensors=dict(self._snapshot),
                                full=True)
        if tensors is None:
            raise TypeError("publish_weights() needs the tensors of the update (or full=True)")
        version = self.version + 1 if version is None else int(version)
        if version <= self.version:
            raise WeightVersionError(f"published version {version} is not newer than {self.version}")
        changed = {}
        for name, tensor in tensors.items():
            value = _cpu(tensor)
            old = self._snapshot.get(name)
            if old is None or old.shape != value.shape or old.dtype != value.dtype or not torch.equal(old, value):
                changed[name] = value
        self._snapshot.update(changed)
        update = WeightUpdate(version=version, base_version=self.version, tensors=changed)
        log.debug("weights v%d: %d changed tensor(s), %.2f MB", version, len(changed), update.nbytes / 2**20)
        self.version = version
        return update

    def reset(self, tensors: Mapping[str, torch.Tensor], version: int) -> WeightUpdate:
        """Start over from ``tensors`` (every trainable tensor) at ``version``: a run resumed from a
        checkpoint, or weights loaded for evaluation. Returns the full update that brings any worker
        there (workers must not hold a newer version)."""
        self.version = int(version)
        self._snapshot = {k: _cpu(v) for k, v in tensors.items()}
        return self.publish_weights(full=True)

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self._snapshot)


class WeightReceiver:
    """Inference-worker-side version tracking: applies updates through ``receive`` (the engine's
    ``receive_weights``) in order."""

    def __init__(self, receive: Callable[[dict[str, torch.Tensor]], None], version: int = INITIAL_VERSION):
        self._receive = receive
        self.version = int(version)

    def apply(self, update: WeightUpdate) -> bool:
        """Apply ``update``; returns False (and applies nothing) when it is not newer than what is held.
        Raises :class:`WeightVersionError` for a delta whose base is not the held version."""
        if update.version <= self.version and not (update.full and update.version == self.version):
            return False
        if not update.full and update.base_version != self.version:
            raise WeightVersionError(f"update v{update.base_version}->v{update.version} does not apply to "
                                     f"weights v{self.version}; send a full update")
        if update.tensors:
            self._receive(update.tensors)
        self.version = update.version
        return True


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()
