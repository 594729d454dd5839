"""The small MLPs around the LLM: patch projector, proprio projector, L1 regression head, value head.

Parameter names of the first three follow the public OpenVLA-OFT checkpoints (``projector.fc1/2/3``,
``proprio_projector--*.pt``: ``fc1/fc2``, ``action_head--*.pt``: ``model.layer_norm1 / fc1 /
mlp_resnet_blocks.N.ffn.{0,1} / layer_norm2 / fc2``), so checkpoints load without renaming.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

#: Prismatic's "fused-gelu-mlp" first widens to 4 x the fused vision width
FUSED_PROJECTOR_EXPANSION = 4
#: OFT's L1 regression head: an MLP-ResNet with two residual blocks of the LLM width
L1_HEAD_RESIDUAL_BLOCKS = 2
#: the value head's last layer starts small so that initial values are near zero
VALUE_HEAD_OUT_INIT_STD = 0.02


class FusedMLPProjector(nn.Module):
    """Fused-backbone projector: ``vision_dim -> 4 vision_dim -> llm_dim -> llm_dim`` with GELUs.
    ``(B, N, vision_dim)`` -> ``(B, N, llm_dim)``."""

    def __init__(self, vision_dim: int, llm_dim: int):
        super().__init__()
        wide = FUSED_PROJECTOR_EXPANSION * vision_dim
        self.fc1 = nn.Linear(vision_dim, wide)
        self.fc2 = nn.Linear(wide, llm_dim)
        self.fc3 = nn.Linear(llm_dim, llm_dim)
        self.act_fn1 = nn.GELU()
        self.act_fn2 = nn.GELU()

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act_fn2(self.fc2(self.act_fn1(self.fc1(patches)))))


class ProprioProjector(nn.Module):
    """OFT's proprio token: ``(B, S)`` normalised state -> ``(B, llm_dim)``."""

    def __init__(self, proprio_dim: int, llm_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(proprio_dim, llm_dim)
        self.fc2 = nn.Linear(llm_dim, llm_dim)
        self.act_fn1 = nn.GELU()

    def forward(self, proprio: torch.Tensor) -> torch.Tensor:
        # trainable heads may be kept in float32 while the rest of the model runs in bfloat16
        return self.fc2(self.act_fn1(self.fc1(proprio.to(self.fc1.weight.dtype))))


class _ResidualBlock(nn.Module):
    """Pre-LayerNorm feed-forward block with a residual connection."""

    def __init__(self, dim: int):
        super().__init__()
        self.ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(x)


class _MLPResNet(nn.Module):
    def __init__(self, num_blocks: int, input_dim: int, hidden_dim: int, output_dim: int):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(input_dim)
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.relu = nn.ReLU()
        self.mlp_resnet_blocks = nn.ModuleList(_ResidualBlock(hidden_dim) for _ in range(num_blocks))
        self.layer_norm2 = nn.LayerNorm(hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(self.layer_norm1(x)))
        for block in self.mlp_resnet_blocks:
            x = block(x)
        return self.fc2(self.layer_norm2(x))


class L1RegressionActionHead(nn.Module):
    """OFT's continuous head: the final hidden states of one action's A slots, concatenated, give that
    action. ``(B, H * A, llm_dim)`` -> normalised actions ``(B, H, A)``."""

    def __init__(self, llm_dim: int, action_dim: int, action_chunk: int):
        super().__init__()
        self.action_chunk = action_chunk
        self.model = _MLPResNet(L1_HEAD_RESIDUAL_BLOCKS, llm_dim * action_dim, llm_dim, action_dim)

    def forward(self, action_hidden: torch.Tensor) -> torch.Tensor:
        B = action_hidden.shape[0]
        per_action = action_hidden.reshape(B, self.action_chunk, -1)  # (B, H, A*D)
        return self.model(per_action.to(self.model.fc1.weight.dtype))  # (B, H, A)


class ValueHead(nn.Module):
    """MLP critic on the prompt's last hidden state: ``(B, llm_dim)`` -> ``(B, out_dim)`` with
    ``out_dim`` 1 (chunk level) or H (action level). GELU hidden layers, bias-free output layer."""

    def __init__(self, llm_dim: int, hidden_sizes: Sequence[int], out_dim: int):
        super().__init__()
        layers: list[nn.Module] = []
        width = llm_dim
        for size in hidden_sizes:
            layers += [nn.Linear(width, size), nn.GELU()]
            width = size
        layers.append(nn.Linear(width, out_dim, bias=False))
        self.mlp = nn.Sequential(*layers)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        linears = [m for m in self.mlp if isinstance(m, nn.Linear)]
        for m in linears[:-1]:
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)
        nn.init.normal_(linears[-1].weight, std=VALUE_HEAD_OUT_INIT_STD)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        first = cast(nn.Linear, self.mlp[0])     # nn.Sequential's index says only Module; the MLP starts linear
        return self.mlp(hidden.to(first.weight.dtype))
