"""The moving average of the actor's trainable tensors (``actor.ema_decay > 0``) that evaluation acts with.

After every update (:meth:`MovingAverage.update`) ``ema = decay * ema + (1 - decay) * weights`` for each averaged
tensor; an evaluation swaps the average into the module and back (:meth:`MovingAverage.swap`). The average holds a
copy of each trainable tensor on that tensor's own device (FSDP2: this rank's shard, as a DTensor like it), so every
operation here is local to the rank. :class:`~embodirl.actor.actor.Actor` owns one (``None`` without an average) and
exposes it as ``actor.ema`` (the tensors by name), ``actor.ema_swapped``, ``swap_ema()`` and ``reset_ema()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

from embodirl.actor import fsdp


def stepped(trainable: Sequence[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer
            ) -> list[tuple[str, torch.nn.Parameter]]:
    """The tensors a moving average covers: those the optimizer has stepped (it holds their moments). The others keep
    their own value in evaluation: statistics no gradient reaches (the state normaliser), an idle value head."""
    state = optimizer.state      # read each time: loading an optimizer state replaces the mapping
    return [(name, p) for name, p in trainable if state.get(p)]


class MovingAverage:
    """Exponential moving average with ``decay`` of the ``trainable`` (name, parameter) pairs, starting at their
    current values. ``optimizer`` decides which tensors it covers (:meth:`averaged`)."""

    def __init__(self, trainable: Sequence[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer,
                 decay: float):
        self.decay = float(decay)
        self._trainable = trainable
        self._optimizer = optimizer
        #: the average of each trainable tensor, by parameter name
        self.tensors: dict[str, torch.Tensor] = {name: p.detach().clone() for name, p in trainable}
        self._fn = get_ema_multi_avg_fn(self.decay)
        #: whether the module holds the average now (between the two swaps around an evaluation)
        self.swapped = False

    def averaged(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The tensors the average covers (:func:`stepped`)."""
        return stepped(self._trainable, self._optimizer)

    def update(self) -> None:
        """After an update: ``ema = decay * ema + (1 - decay) * weights`` for every averaged tensor (a tensor joins
        with the weights it had before its first step, which is where its average started)."""
        if self.swapped:
            raise RuntimeError("the actor trained while its module held the moving average; call swap_ema() after "
                               "the evaluation")
        pairs = [(fsdp.local_tensor(self.tensors[n]), fsdp.local_tensor(p)) for n, p in self.averaged()]
        if pairs:
            self._fn([a for a, _ in pairs], [w for _, w in pairs], None)

    def swap(self) -> list[str]:
        """Exchange the averaged tensors with their average; returns their names (they changed in the module)."""
        names = []
        with torch.no_grad():
            for name, p in self.averaged():
                live, avg = fsdp.local_tensor(p), fsdp.local_tensor(self.tensors[name])
                held = live.clone()
                live.copy_(avg)
                avg.copy_(held)
                names.append(name)
        self.swapped = not self.swapped
        return names

    def reset(self, values: Mapping[str, torch.Tensor] | None = None) -> None:
        """Set the average to ``values`` (full tensors by name), or to the weights."""
        self.swapped = False
        with torch.no_grad():
            for name, p in self._trainable:
                target = self.tensors[name]
                if values is None:
                    fsdp.local_tensor(target).copy_(fsdp.local_tensor(p))
                elif fsdp.is_dtensor(target):
                    from torch.distributed.tensor import distribute_tensor

                    shard = distribute_tensor(values[name].to(p.device, p.dtype), target.device_mesh, target.placements)
                    fsdp.local_tensor(target).copy_(shard.to_local())
                else:
                    target.copy_(values[name].to(target.device, target.dtype))

    def evaluated(self) -> dict[str, torch.Tensor]:
        """Every trainable tensor as evaluation acts with it, un-sharded, on CPU (collective under FSDP): the average
        of the averaged tensors, the others' own value."""
        averaged = {name for name, _ in self.averaged()}
        return {name: fsdp.full_tensor(self.tensors[name] if name in averaged else p).to("cpu", copy=True)
                for name, p in self._trainable}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average's full (un-sharded) tensors on CPU, by name (collective under FSDP)."""
        return {n: fsdp.full_tensor(t).to("cpu", copy=True) for n, t in self.tensors.items()}
