"""The transformers towers, fed public (timm-named) weights, compute what timm's ViTs compute.

timm cannot be installed here, so the reference is a plain re-implementation of timm's
VisionTransformer forward (fused qkv, LayerScale, DINOv2's ``no_embed_class`` position embedding and
register tokens, exact GELU in both towers) stopped after the second-to-last block, with prefix tokens removed -
Prismatic's ``get_intermediate_layers(n={depth - 2})``.
"""

import torch
import torch.nn.functional as F

from embodirl.envs.base import EnvSpec
from embodirl.models.openvla_oft.modeling import build_model
from embodirl.models.openvla_oft.resolve import build_config, load_preset
from embodirl.models.openvla_oft.weights import public_weights


def timm_vit_features(sd, prefix, pixels, *, depth, heads, patch, dino):
    """timm ViT patch features from the output of block ``depth - 2`` (0-based), prefix tokens dropped."""
    p = lambda name: sd[prefix + name]
    x = F.conv2d(pixels, p("patch_embed.proj.weight"), p("patch_embed.proj.bias"), stride=patch)
    x = x.flatten(2).transpose(1, 2)                                    # (N, P, D)
    N, _, D = x.shape
    x = x + p("pos_embed")                                              # patches only (no_embed_class / no CLS)
    n_prefix = 0
    if dino:
        x = torch.cat([p("cls_token").expand(N, -1, -1), p("reg_token").expand(N, -1, -1), x], dim=1)
        n_prefix = 1 + p("reg_token").shape[1]
    # timm's VisionTransformer uses nn.GELU (exact) unless a model sets act_layer; neither OpenVLA tower does
    # (vit_so400m_patch14_siglip_224's model args name no act_layer), so both run the erf GELU
    act = F.gelu
    hd = D // heads
    for i in range(depth - 1):
        b = f"blocks.{i}."
        h = F.layer_norm(x, (D,), p(b + "norm1.weight"), p(b + "norm1.bias"), eps=1e-6)
        qkv = F.linear(h, p(b + "attn.qkv.weight"), p(b + "attn.qkv.bias"))
        q, k, v = qkv.reshape(N, -1, 3, heads, hd).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * hd ** -0.5).softmax(-1) @ v    # (N, heads, T, hd)
        h = F.linear(attn.transpose(1, 2).reshape(N, -1, D), p(b + "attn.proj.weight"), p(b + "attn.proj.bias"))
        x = x + (h * p(b + "ls1.scale_factor") if dino else h)
        h = F.layer_norm(x, (D,), p(b + "norm2.weight"), p(b + "norm2.bias"), eps=1e-6)
        h = F.linear(act(F.linear(h, p(b + "mlp.fc1.weight"), p(b + "mlp.fc1.bias"))),
                     p(b + "mlp.fc2.weight"), p(b + "mlp.fc2.bias"))
        x = x + (h * p(b + "ls2.scale_factor") if dino else h)
    return x[:, n_prefix:]


def test_fused_towers_match_timm_reference():
    spec = EnvSpec(action_dim=7, max_episode_steps=10, task_descriptions=["t"], camera_names=["a", "w"],
                   state_dim=8, name="libero_10")
    cfg = build_config(load_preset("openvla_oft_tiny"), spec)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():  # make every vision tensor matter (LayerScale starts at 1e-5)
        for name, param in model.vision.named_parameters():
            param.normal_(0.0, 0.2 if "layer_scale" not in name else 1.0)
        model.vision.dino.embeddings.position_embeddings[:, 0].zero_()
    sd = public_weights(model, cfg)
    pixels = torch.randn(3, 12, cfg.model.image_size, cfg.model.image_size)  # B=3, two images of 6 channels
    with torch.no_grad():
        ours = model.vision(pixels)                                  # (3, 2*P, D_dino + D_siglip)
        images = pixels.reshape(6, 6, cfg.model.image_size, cfg.model.image_size)
        kw = dict(patch=14)
        towers = cfg.model.vision
        dino = timm_vit_features(sd, "vision_backbone.featurizer.", images[:, :3], depth=towers.dino.num_hidden_layers,
                                 heads=towers.dino.num_attention_heads, dino=True, **kw)
        siglip = timm_vit_features(sd, "vision_backbone.fused_featurizer.", images[:, 3:],
                                   depth=towers.siglip.num_hidden_layers, heads=towers.siglip.num_attention_heads,
                                   dino=False, **kw)
        reference = torch.cat([dino, siglip], dim=-1).reshape(3, -1, cfg.vision_dim)
    assert ours.shape == (3, 2 * cfg.patches_per_image, cfg.vision_dim)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    # the last block is not on the path: changing it changes nothing
    with torch.no_grad():
        model.vision.dino.encoder.layer[-1].mlp.fc1.weight.add_(1.0)
        model.vision.siglip.encoder.layers[-1].mlp.fc1.weight.add_(1.0)
        assert torch.equal(model.vision(pixels), ours)
