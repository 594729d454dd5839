"""The typed keys of ``model=pi0`` and ``model=pi0_tiny`` (values in ``config/model/_pi0_base.yaml``)."""

from dataclasses import dataclass
from typing import Any

from embodirl.config_fields import num, one_of, required, section
from embodirl.models.base import CommonModelConfig
from embodirl.models.openvla_oft.schema import VisionTower  # the same keys as OpenVLA-OFT's
from embodirl.models.pi0.flow import METHODS

#: what the value head reads: the action expert's output over the chunk positions (RLinf's π0 mode,
#: ``value_after_vlm: False``) or the VLM's prefix (RLinf's π0.5 mode, ``value_after_vlm: True``)
VALUE_FEATURES = ("expert", "vlm_prefix")


@dataclass
class Gemma:
    hidden_size: int = num(1)
    intermediate_size: int = num(1)
    num_hidden_layers: int = num(1)
    num_attention_heads: int = num(1)
    num_key_value_heads: int = num(1)
    head_dim: int = num(1)


@dataclass
class Language(Gemma):
    vocab_size: int = num(2)


@dataclass
class Lora:
    enabled: bool = required()
    rank: int = num(1)
    alpha: float = num(0, lo_open=True)
    dropout: float = num(0, 1, hi_open=True)
    target_modules: Any = required()          # all-linear | expert | vlm, or a list of module-name suffixes


@dataclass
class Flow:
    method: str = one_of(METHODS)
    num_steps: int = num(1)
    noise_level: float = num(0, lo_open=True)           # Flow-SDE's a in sigma = a sqrt(t / (1 - t))
    noise_std_range: list[float] = required()           # Flow-Noise: [min, max] of the learned standard deviation
    noise_head_hidden_sizes: list[int] = required()
    joint_logprob: bool = required()    # Flow-Noise: mean over x_0's prior and the K steps (else the K steps only)


@dataclass
class ValueHead:
    hidden_sizes: list[int] = required()
    features: str = one_of(VALUE_FEATURES)
    detach: bool = required()           # no gradient from the value loss into the features (RLinf detach_critic_input)


@dataclass
class Pi0ModelConfig(CommonModelConfig):
    """``model=pi0`` / ``pi0_tiny`` (config/model/_pi0_base.yaml)."""

    device: str | None = required()
    dtype: str = one_of(("float32", "bfloat16", "float16"))
    attn_implementation: str = one_of(("sdpa", "eager"))
    normalization: str = one_of(("mean_std",))          # state and actions standardised (π0's statistics)
    chunk_size: int = num(1)                  # actions the network predicts per decision (action_chunk <= it run)
    max_action_dim: int = num(1)
    max_state_dim: int = num(1)
    image_size: int = num(14)
    num_images_in_input: int | None = num(1, null=True)     # null: the env's cameras
    max_prompt_tokens: int = num(1)
    flow: Flow = section(Flow)
    value_head: ValueHead = section(ValueHead)
    vision: VisionTower = section(VisionTower)
    language: Language = section(Language)
    expert: Gemma = section(Gemma)
    lora: Lora = section(Lora)
    train_expert: bool = required()     # the action expert's weights train in full, the VLM only through model.lora
