"""The typed keys of ``model=openvla_oft`` (and its tiny preset): types and ranges, declared next to the policy and
registered with it (``@register_policy("openvla_oft", config=OpenVLAOFTConfig)``); the values live in
``config/model/_openvla_oft_base.yaml``. :func:`~embodirl.models.openvla_oft.resolve.build_config` resolves them against
the env and a checkpoint into the network's :class:`~embodirl.models.openvla_oft.resolve.OFTConfig`."""

from dataclasses import dataclass
from typing import Any

from embodirl.config_fields import num, one_of, required, section
from embodirl.models.base import CommonModelConfig

#: ``model.greedy_decoding``: the argmax over the action bins, or over the whole vocabulary (OFT's evaluation)
GREEDY_DECODINGS = ("action_bins", "vocabulary")


@dataclass
class VisionTower:
    hidden_size: int = num(1)
    num_hidden_layers: int = num(1)
    num_attention_heads: int = num(1)
    intermediate_size: int = num(1)
    patch_size: int = num(1)


@dataclass
class Vision:
    dino: VisionTower = section(VisionTower)
    siglip: VisionTower = section(VisionTower)


@dataclass
class LLM:
    hidden_size: int = num(1)
    intermediate_size: int = num(1)
    num_hidden_layers: int = num(1)
    num_attention_heads: int = num(1)
    num_key_value_heads: int = num(1)
    vocab_size: int = num(1)
    max_position_embeddings: int = num(1)
    rms_norm_eps: float = num(0, lo_open=True)
    rope_theta: float = num(0, lo_open=True)


@dataclass
class Lora:
    enabled: bool = required()
    rank: int = num(1)
    alpha: float = num(0, lo_open=True)
    dropout: float = num(0, 1, hi_open=True)
    target_modules: Any = required()          # all-linear, or a list of module names
    modules_to_save: list[str] = required()


@dataclass
class ValueHead:
    hidden_sizes: list[int] = required()


@dataclass
class OpenVLAOFTConfig(CommonModelConfig):
    """``model=openvla_oft`` / ``openvla_oft_tiny`` (config/model/_openvla_oft_base.yaml)."""

    base_path: str | None = required()
    device: str | None = required()
    unnorm_key: str | None = required()
    normalization: str = required()
    dtype: str = required()
    attn_implementation: str = required()
    action_dim: int | None = num(1, null=True)
    num_bins: int = num(2)
    num_images_in_input: int | None = num(1, null=True)
    use_proprio: bool | None = required()
    proprio_dim: int | None = num(1, null=True)
    use_l1_regression: bool | None = required()
    greedy_decoding: str = one_of(GREEDY_DECODINGS)
    value_head: ValueHead = section(ValueHead)
    center_crop: bool = required()
    image_size: int = num(1)
    gradient_checkpointing: bool = required()
    vision: Vision = section(Vision)
    llm: LLM = section(LLM)
    lora: Lora = section(Lora)
