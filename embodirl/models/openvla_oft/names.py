"""Explicit correspondence between the public OpenVLA-OFT parameter names and this package's modules.

Public checkpoints are Prismatic HF exports (``OpenVLAForActionPrediction``) whose vision towers are timm
models; here they are transformers modules. Every tensor is listed by a :class:`Rule`: the public
name(s), our name(s), and a lossless conversion both ways:

* ``same``       - one tensor, renamed;
* ``qkv``        - timm's fused ``attn.qkv`` (rows q, then k, then v; heads contiguous) <-> three
  projections ``q_proj``/``k_proj``/``v_proj``;
* ``cls_pos``    - timm DINOv2 (``no_embed_class``) has position embeddings for the patches only,
  ``[1, N, D]``; transformers' tensor has a CLS slot in front, ``[1, 1 + N, D]``, zero when loaded; a
  full fine-tune trains it, and writing folds it into ``cls_token`` (the same sum enters the encoder);
* ``pos_flat``   - timm SigLIP ``pos_embed [1, N, D]`` <-> ``position_embedding.weight [N, D]``;
* ``in_proj``    - timm's attention-pool ``q`` and ``kv`` linears <-> ``nn.MultiheadAttention``'s
  ``in_proj`` (rows q, k, v).

timm's LayerScale ``gamma`` is stored as ``scale_factor`` in the HF export (transformers used to rename
parameters called ``gamma``); both spellings are read, ``scale_factor`` is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from embodirl.models.openvla_oft.resolve import OFTConfig

PUBLIC_DINO = "vision_backbone.featurizer."
PUBLIC_SIGLIP = "vision_backbone.fused_featurizer."
OURS_DINO = "vision.dino."
OURS_SIGLIP = "vision.siglip."
#: HF export's name for timm LayerScale's ``gamma`` (and the timm spelling, accepted on load)
LAYERSCALE_PUBLIC, LAYERSCALE_TIMM = "scale_factor", "gamma"
QKV_PARTS = 3
#: parameters that exist only here and are not part of the public layout (unused by OFT's forward)
OURS_ONLY = (OURS_DINO + "embeddings.mask_token",)


def _split3(ts):
    return list(ts[0].chunk(QKV_PARTS, dim=0))


def _cat(ts):
    return [torch.cat(list(ts), dim=0)]


def _split_q_kv(ts):
    w = ts[0]
    d = w.shape[0] // QKV_PARTS
    return [w[:d], w[d:]]


def _cls_pos_to_ours(ts):
    cls, pos = ts
    return [cls, torch.cat([pos.new_zeros(1, 1, pos.shape[-1]), pos], dim=1)]


def _cls_pos_to_public(ts):
    # timm's DINOv2 adds no position embedding to CLS; ours has a slot for it (zero when loaded, trained by a
    # full fine-tune). CLS enters the encoder as cls_token + that slot at every resolution (interpolation
    # keeps it), so folding the slot into cls_token writes the same tower
    cls, pos = ts
    return [cls + pos[:, :1].to(cls.dtype), pos[:, 1:]]


@dataclass(frozen=True)
class Converter:
    to_ours: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
    to_public: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
    public_shapes: Callable[[Sequence[tuple[int, ...]]], list[tuple[int, ...]]]


def _qkv_public_shapes(shapes):
    return [(sum(s[0] for s in shapes), *shapes[0][1:])]


def _in_proj_public_shapes(shapes):
    rows, rest = shapes[0][0], tuple(shapes[0][1:])
    return [(rows // QKV_PARTS, *rest), (rows - rows // QKV_PARTS, *rest)]


#: kind -> (public -> ours, ours -> public, our shapes -> public shapes)
CONVERTERS = {
    "same": Converter(lambda ts: [ts[0]], lambda ts: [ts[0]], lambda s: [tuple(s[0])]),
    "qkv": Converter(_split3, _cat, _qkv_public_shapes),
    "cls_pos": Converter(_cls_pos_to_ours, _cls_pos_to_public,
                         lambda s: [tuple(s[0]), (s[1][0], s[1][1] - 1, s[1][2])]),
    "pos_flat": Converter(lambda ts: [ts[0][0]], lambda ts: [ts[0].unsqueeze(0)], lambda s: [(1, *s[0])]),
    "in_proj": Converter(_cat, _split_q_kv, _in_proj_public_shapes),
}


@dataclass(frozen=True)
class Rule:
    """``public`` tensors <-> ``ours`` tensors through ``CONVERTERS[kind]``."""

    public: tuple[str, ...]
    ours: tuple[str, ...]
    kind: str = "same"

    @property
    def converter(self) -> Converter:
        return CONVERTERS[self.kind]


def _wb(public: str, ours: str) -> list[Rule]:
    return [Rule((f"{public}.weight",), (f"{ours}.weight",)), Rule((f"{public}.bias",), (f"{ours}.bias",))]


def _qkv(public: str, ours: str, names: tuple[str, str, str]) -> list[Rule]:
    return [Rule((f"{public}.{p}",), tuple(f"{ours}.{n}.{p}" for n in names), "qkv") for p in ("weight", "bias")]


def dino_rules(num_layers: int) -> list[Rule]:
    P, O = PUBLIC_DINO, OURS_DINO
    rules = [Rule((P + "cls_token", P + "pos_embed"), (O + "embeddings.cls_token", O + "embeddings.position_embeddings"),
                  "cls_pos"),
             Rule((P + "reg_token",), (O + "embeddings.register_tokens",)),
             *_wb(P + "patch_embed.proj", O + "embeddings.patch_embeddings.projection"),
             *_wb(P + "norm", O + "layernorm")]
    for i in range(num_layers):
        p, o = f"{P}blocks.{i}", f"{O}encoder.layer.{i}"
        rules += [*_wb(f"{p}.norm1", f"{o}.norm1"),
                  *_qkv(f"{p}.attn.qkv", f"{o}.attention", ("q_proj", "k_proj", "v_proj")),
                  *_wb(f"{p}.attn.proj", f"{o}.attention.o_proj"),
                  Rule((f"{p}.ls1.{LAYERSCALE_PUBLIC}",), (f"{o}.layer_scale1.lambda1",)),
                  *_wb(f"{p}.norm2", f"{o}.norm2"),
                  *_wb(f"{p}.mlp.fc1", f"{o}.mlp.fc1"), *_wb(f"{p}.mlp.fc2", f"{o}.mlp.fc2"),
                  Rule((f"{p}.ls2.{LAYERSCALE_PUBLIC}",), (f"{o}.layer_scale2.lambda1",))]
    return rules


def siglip_rules(num_layers: int) -> list[Rule]:
    P, O = PUBLIC_SIGLIP, OURS_SIGLIP
    pool, head = P + "attn_pool", O + "head"
    rules = [Rule((P + "pos_embed",), (O + "embeddings.position_embedding.weight",), "pos_flat"),
             *_wb(P + "patch_embed.proj", O + "embeddings.patch_embedding"),
             *_wb(P + "norm", O + "post_layernorm"),
             Rule((f"{pool}.latent",), (f"{head}.probe",)),
             Rule((f"{pool}.q.weight", f"{pool}.kv.weight"), (f"{head}.attention.in_proj_weight",), "in_proj"),
             Rule((f"{pool}.q.bias", f"{pool}.kv.bias"), (f"{head}.attention.in_proj_bias",), "in_proj"),
             *_wb(f"{pool}.proj", f"{head}.attention.out_proj"),
             *_wb(f"{pool}.norm", f"{head}.layernorm"),
             *_wb(f"{pool}.mlp.fc1", f"{head}.mlp.fc1"), *_wb(f"{pool}.mlp.fc2", f"{head}.mlp.fc2")]
    for i in range(num_layers):
        p, o = f"{P}blocks.{i}", f"{O}encoder.layers.{i}"
        rules += [*_wb(f"{p}.norm1", f"{o}.layer_norm1"),
                  *_qkv(f"{p}.attn.qkv", f"{o}.self_attn", ("q_proj", "k_proj", "v_proj")),
                  *_wb(f"{p}.attn.proj", f"{o}.self_attn.out_proj"),
                  *_wb(f"{p}.norm2", f"{o}.layer_norm2"),
                  *_wb(f"{p}.mlp.fc1", f"{o}.mlp.fc1"), *_wb(f"{p}.mlp.fc2", f"{o}.mlp.fc2")]
    return rules


def language_rules(num_layers: int) -> list[Rule]:
    rules = [Rule(("language_model.model.embed_tokens.weight",), ("language_model.model.embed_tokens.weight",)),
             Rule(("language_model.model.norm.weight",), ("language_model.model.norm.weight",)),
             Rule(("language_model.lm_head.weight",), ("language_model.lm_head.weight",))]
    per_layer = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight")
    for i in range(num_layers):
        rules += [Rule((f"language_model.model.layers.{i}.{n}",), (f"language_model.model.layers.{i}.{n}",))
                  for n in per_layer]
    return rules


def parameter_rules(cfg: OFTConfig) -> list[Rule]:
    """Every tensor of the public model file(s) (``model*.safetensors``) for this configuration."""
    projector = [r for fc in ("fc1", "fc2", "fc3") for r in _wb(f"projector.{fc}", f"projector.{fc}")]
    return [*dino_rules(cfg.model.vision.dino.num_hidden_layers), *siglip_rules(cfg.model.vision.siglip.num_hidden_layers),
            *projector, *language_rules(cfg.model.llm.num_hidden_layers)]


def public_alias(name: str) -> str | None:
    """The other accepted spelling of a public name (LayerScale ``gamma``), or None."""
    suffix = "." + LAYERSCALE_PUBLIC
    if name.endswith(suffix):
        return name[: -len(suffix)] + "." + LAYERSCALE_TIMM
    return None


def linear_module_map(cfg: OFTConfig) -> dict[str, tuple[str, int | None]]:
    """Our linear module -> (public linear module, part): part is the q/k/v index (0/1/2) inside a fused
    timm ``qkv`` module, ``None`` for a one-to-one module. Used for LoRA adapters."""
    out: dict[str, tuple[str, int | None]] = {}
    for rule in parameter_rules(cfg):
        if not rule.public[0].endswith(".weight") or rule.kind not in ("same", "qkv"):
            continue
        public_module = rule.public[0][: -len(".weight")]
        for part, ours in enumerate(rule.ours):
            out[ours[: -len(".weight")]] = (public_module, part if rule.kind == "qkv" else None)
    return out
