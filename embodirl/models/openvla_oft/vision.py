"""The fused DINOv2 + SigLIP vision backbone of Prismatic / OpenVLA, on transformers' own ViT modules.

OpenVLA's ``PrismaticVisionBackbone`` runs two timm ViTs on one 6-channel image (channels 0-2
normalised for DINOv2, 3-5 for SigLIP) and concatenates, per patch, the features each tower produces
at the output of its *second-to-last* block (timm ``get_intermediate_layers(n={depth - 2})``: no final
norm, prefix tokens removed). Here the towers are transformers' ``Dinov2WithRegistersModel``
(timm ``vit_large_patch14_reg4_dinov2``: CLS + 4 register tokens, LayerScale) and
``SiglipVisionModel`` (timm ``vit_so400m_patch14_siglip_224``: no prefix tokens, MAP head), run block by
block so that the last block is skipped rather than computed and discarded. Their last block, final
norm and SigLIP's pooling head stay as modules so that checkpoints keep every public tensor.

With ``num_images_in_input = 2`` (agentview + wrist) both images go through the same towers as one
batch; their patches are concatenated image after image, as OFT does.
"""

from __future__ import annotations

import torch
from torch import nn

from embodirl.models.openvla_oft.resolve import DINO_REGISTER_TOKENS, OFTConfig
from embodirl.models.processor import CHANNELS_PER_IMAGE, RGB_CHANNELS


class FusedVisionBackbone(nn.Module):
    """pixels float ``[B, V * 6, S, S]`` -> patch features ``[B, V * P, D_dino + D_siglip]``."""

    def __init__(self, cfg: OFTConfig):
        super().__init__()
        from transformers import Dinov2WithRegistersModel, SiglipVisionModel

        self.num_images = cfg.num_images_in_input
        self.dino = Dinov2WithRegistersModel(cfg.dino_config())
        self.siglip = SiglipVisionModel(cfg.siglip_config())
        #: CLS + register tokens that precede DINOv2's patch tokens
        self.dino_prefix_tokens = 1 + DINO_REGISTER_TOKENS
        self.embed_dim = cfg.vision_dim
        self.num_patches = cfg.patches_per_image  # P, per image

    def dino_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """``(N, 3, S, S)`` -> ``(N, P, D_dino)`` from the second-to-last DINOv2 block."""
        hidden = self.dino.embeddings(pixels)  # (N, 1 + 4 + P, D): CLS, registers, patches
        for layer in self.dino.encoder.layer[:-1]:
            hidden = layer(hidden)
        return hidden[:, self.dino_prefix_tokens:]

    def siglip_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """``(N, 3, S, S)`` -> ``(N, P, D_siglip)`` from the second-to-last SigLIP block."""
        hidden = self.siglip.embeddings(pixels)  # (N, P, D)
        for layer in self.siglip.encoder.layers[:-1]:
            hidden = layer(hidden, None)
        return hidden

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        B, C, S, _ = pixel_values.shape
        V = self.num_images
        if C != V * CHANNELS_PER_IMAGE:
            raise ValueError(f"pixel_values has {C} channels, the backbone expects {V} image(s) x "
                             f"{CHANNELS_PER_IMAGE} = {V * CHANNELS_PER_IMAGE}")
        images = pixel_values.reshape(B * V, CHANNELS_PER_IMAGE, S, S)  # (B*V, 6, S, S)
        dino = self.dino_features(images[:, :RGB_CHANNELS])             # (B*V, P, D_dino)
        siglip = self.siglip_features(images[:, RGB_CHANNELS:])         # (B*V, P, D_siglip)
        fused = torch.cat([dino, siglip], dim=-1)                       # (B*V, P, D)
        return fused.reshape(B, V * fused.shape[1], fused.shape[2])     # (B, V*P, D)
