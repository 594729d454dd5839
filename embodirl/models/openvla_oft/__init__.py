"""OpenVLA-OFT (Kim et al. 2025) with LoRA, as RLinf / SimpleVLA-RL fine-tune it with RL.

Registered as policy ``openvla_oft`` (``model.name``). Files, along the dataflow:

* ``config.py``     - the model config group resolved against the env (sizes, LoRA, value head);
* ``autoconfig.py`` - what a checkpoint directory holds (L1 head, proprio, image count) configures the model;
* ``vision.py``     - fused DINOv2 + SigLIP backbone on transformers' ViTs;
* ``projector.py``  - patch / proprio projectors, L1 regression head, value head;
* ``modeling.py``   - the sequence layout and one bidirectional pass for a whole action chunk;
* ``sampling.py``   - temperature / top-k / top-p over the action ids, log-probs, entropy;
* ``lora.py``       - peft adapters and fully trainable heads;
* ``names.py``      - public (Prismatic/timm) parameter names <-> our modules, tensor by tensor;
* ``weights.py`` / ``adapters.py`` / ``hf_checkpoint.py`` - weight files, LoRA adapters, and the whole
  public checkpoint directory, read and written;
* ``policy.py``     - the :class:`~embodirl.models.base.Policy` (``act`` / ``evaluate`` / reference mode).
"""

from __future__ import annotations

from pathlib import Path

from embodirl.errors import ConfigError
from embodirl.models.openvla_oft.autoconfig import check_run, configure
from embodirl.models.openvla_oft.policy import OpenVLAOFTPolicy, build_policy
from embodirl.models.openvla_oft.resolve import build_config
from embodirl.models.openvla_oft.schema import OpenVLAOFTConfig
from embodirl.models.openvla_oft.weights import HUB_ID
from embodirl.models.registry import register_policy

__all__ = ["OpenVLAOFTPolicy", "build_policy", "build_openvla_oft"]


@register_policy("openvla_oft", config=OpenVLAOFTConfig)
def build_openvla_oft(model_cfg, env_spec) -> OpenVLAOFTPolicy:
    """Registry builder: ``builder(model_cfg, env_spec) -> Policy``."""
    return build_policy(model_cfg, env_spec)


def _check_config(model_cfg) -> None:
    """Cheap checks before any worker starts (no weights are built, nothing is downloaded)."""
    model = configure(model_cfg)
    build_config(model, None)
    for key, value in (("path", model.path), ("base_path", model.base_path)):
        if value and not Path(value).expanduser().exists() and not HUB_ID.fullmatch(str(value)):
            raise ConfigError(f"model.{key}", f"'{value}' is neither an existing directory nor a hub id (owner/name)")


def _check_spec(model_cfg, env_spec) -> None:
    """The sizes the config sets against the env's (what the checkpoint's config.json decides included)."""
    build_config(configure(model_cfg), env_spec)


build_openvla_oft.check_config = _check_config
build_openvla_oft.check_spec = _check_spec
build_openvla_oft.check_run = check_run
