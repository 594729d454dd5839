"""LoRA adapters folded into the weights they adapt, for an inference copy (``rollout.merge_lora``), repeatably.

The first merge keeps the adapted layers' own weights in host memory (page-locked on a GPU machine: the adapted
layers' size once more); every merge restores them before folding, so a weight update re-merges from the originals
and repeated merges never accumulate rounding. After a merge the adapters are off in the forward (peft's ``merged``).
Shared by every policy that holds a peft model (OpenVLA-OFT, π0)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer


class AdapterMerger:
    def __init__(self):
        self._originals: list[torch.Tensor] | None = None

    def merge(self, peft_model: nn.Module, device: torch.device) -> None:
        from peft.tuners.lora import LoraLayer

        layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer)]
        if not layers:
            raise RuntimeError("this policy has no LoRA adapter to merge (model.lora.enabled is false)")
        if self._originals is None:
            pin = torch.cuda.is_available() and device.type == "cuda"
            self._originals = [_base_weight(layer).detach().to("cpu", copy=True) for layer in layers]
            if pin:
                self._originals = [w.pin_memory() for w in self._originals]
        with torch.no_grad():
            for layer, original in zip(layers, self._originals, strict=True):
                _base_weight(layer).copy_(original, non_blocking=True)
                layer.merged_adapters = []
                layer.merge()


def _base_weight(layer: LoraLayer) -> torch.Tensor:
    """The weight of a LoRA layer's base layer (a linear one: ``get_base_layer`` is typed as returning any Module)."""
    weight = layer.get_base_layer().weight
    assert isinstance(weight, torch.Tensor)
    return weight
