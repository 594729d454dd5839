"""Typed model groups (``model``), one schema per policy name. The policies' own ``check_config`` (and
OpenVLA-OFT's checkpoint rules) still check what only they know; this module types every key, gives it a
range and refuses keys the policy does not read. A policy registered by a user without an entry here has
its ``name``, ``action_chunk`` and ``value_type`` typed and the rest left to its builder.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embodirl.errors import ConfigError
from embodirl.schema.fields import num, one_of, required, section
from embodirl.schema.sections import reward_types

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _policies():
    from embodirl.models.registry import available_policies
    return available_policies()


@dataclass
class CommonModel:
    name: str = one_of(_policies)
    path: str | None = required()
    action_chunk: int = num(1)
    value_type: str | None = one_of(reward_types, null=True)     # null: no value head


@dataclass
class StateMLP(CommonModel):
    hidden_sizes: list[int] = required()
    critic_hidden_sizes: list[int] = required()
    activation: str = required()
    init_log_std: float = required()
    obs_norm: bool = required()
    dtype: str = one_of(("float32", "float64"))
    device: str | None = required()


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
class OpenVLAOFT(CommonModel):
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
    value_head: ValueHead = section(ValueHead)
    center_crop: bool = required()
    image_size: int = num(1)
    gradient_checkpointing: bool = required()
    vision: Vision = section(Vision)
    llm: LLM = section(LLM)
    lora: Lora = section(Lora)


#: model.name -> its schema
MODEL_SCHEMAS: dict[str, type] = {"state_mlp": StateMLP, "openvla_oft": OpenVLAOFT}


def model_schema(node: Any) -> tuple[type, bool]:
    name = node.get("name") if hasattr(node, "get") else None
    if not isinstance(name, str):
        raise ConfigError("model.name", "is missing; a model option names its policy")
    if name in MODEL_SCHEMAS:
        return MODEL_SCHEMAS[name], True
    return CommonModel, False


def model_rules(cfg) -> None:
    """Rules between the model, the algorithm and the disk."""
    from embodirl.algorithms.advantages import CRITIC_ESTIMATORS

    adv_type, value_type = cfg.algorithm.adv_type, cfg.model.get("value_type")
    if adv_type in CRITIC_ESTIMATORS and value_type is None:
        raise ConfigError("model.value_type", f"adv_type={adv_type} needs a value head: set model.value_type to "
                                              "chunk_level or action_level")
    if cfg.algorithm.reward_type == "action_level" and value_type == "chunk_level" and adv_type in CRITIC_ESTIMATORS:
        raise ConfigError("model.value_type", "action_level rewards with GAE need action_level values; set "
                                              "model.value_type=action_level")
    path = cfg.model.get("path")
    if path:
        local = Path(str(path)).expanduser()
        if not local.exists() and (str(path).startswith((".", "/", "~")) or not _HUB_ID.match(str(path))):
            raise ConfigError("model.path", f"'{path}' does not exist; give a checkpoint directory or a hub id like "
                                            "org/name")
