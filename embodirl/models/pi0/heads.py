"""π0's heads that train in place beside the network: the value head (RLinf's critic MLP, ``model.value_head``) and,
for Flow-Noise, the noise head that gives each denoising step its standard deviation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from embodirl.models.pi0 import flow


def _mlp(sizes: Sequence[int], activation: type[nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


def _first_linear(mlp: nn.Sequential) -> nn.Linear:
    """The MLP's first layer (:func:`_mlp` starts with a linear one; ``nn.Sequential``'s index says only Module)."""
    return cast(nn.Linear, mlp[0])


class ValueHead(nn.Module):
    """RLinf's critic MLP (rlinf/models/embodiment/modules/value_head.py @ 558aeb38, with the ReLU and the last layer's
    bias openpi_action_model.py gives it): ReLU between the layers, hidden layers Kaiming-normal (fan out), the last
    N(0, 0.02), zero biases; one value (``chunk_level``) or ``H`` (``action_level``) per feature vector."""

    def __init__(self, width: int, hidden_sizes: Sequence[int], outputs: int):
        super().__init__()
        self.mlp = _mlp([width, *hidden_sizes, outputs], nn.ReLU)
        linears = [m for m in self.mlp if isinstance(m, nn.Linear)]
        for layer in linears[:-1]:
            nn.init.kaiming_normal_(layer.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(layer.bias)
        nn.init.normal_(linears[-1].weight, mean=0.0, std=0.02)
        nn.init.zeros_(linears[-1].bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.mlp(features.to(_first_linear(self.mlp).weight.dtype)).float()


class NoiseHead(nn.Module):
    """Flow-Noise's standard deviation per action element from the expert's feature of each chunk position: a tanh
    MLP whose output goes through tanh and is mapped linearly onto the log-variance between ``log(low^2)`` and
    ``log(high^2)`` (:func:`.flow.log_variance_std`; RLinf's ``ExploreNoiseNet``,
    rlinf/models/embodiment/modules/explore_noise_net.py @ 558aeb38)."""

    def __init__(self, width: int, hidden_sizes: Sequence[int], outputs: int, low: float, high: float):
        super().__init__()
        self.mlp = _mlp([width, *hidden_sizes, outputs], nn.Tanh)
        self.low, self.high = float(low), float(high)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        raw = self.mlp(features.to(_first_linear(self.mlp).weight.dtype)).float()
        return flow.log_variance_std(raw, self.low, self.high)

