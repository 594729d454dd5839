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
* ``policy.py``     - the :class:`~embodirl.models.base.Policy` (``act`` / ``score_actions`` / reference mode).
"""

from __future__ import annotations

from pathlib import Path

from embodirl.envs.conventions import ANY_ARM, OPEN01, OSC_POSE_DELTA, ActionConvention
from embodirl.errors import ConfigError
from embodirl.models.openvla_oft import autoconfig
from embodirl.models.openvla_oft.autoconfig import check_run, configure
from embodirl.models.openvla_oft.policy import OpenVLAOFTPolicy, build_policy
from embodirl.models.openvla_oft.resolve import build_config
from embodirl.models.openvla_oft.schema import OpenVLAOFTConfig
from embodirl.models.openvla_oft.weights import HUB_ID
from embodirl.models.registry import SFT_TOKENS, register_policy

__all__ = ["OpenVLAOFTPolicy", "build_policy", "build_openvla_oft"]

#: OFT's LIBERO statistics keys (``libero_spatial_no_noops``, ...) name the datasets its arm actions come from
LIBERO_STATISTICS_PREFIX = "libero"


def action_convention(model: OpenVLAOFTConfig) -> ActionConvention:
    """OFT's gripper, [0, 1] with 1 = open (its LIBERO data's, ``normalize_gripper_action`` binarises it at 0.5); the
    arm is LIBERO's OSC_POSE delta for a checkpoint whose statistics are all of LIBERO datasets (``libero_10_no_noops``,
    ...), else the env's (a random init, or SFT on the env's own demos)."""
    contents = autoconfig.inspect(str(model.path)) if model.path else None
    keys = contents.statistics_keys if contents is not None else ()
    libero = bool(keys) and all(str(k).startswith(LIBERO_STATISTICS_PREFIX) for k in keys)
    return ActionConvention(arm=OSC_POSE_DELTA if libero else ANY_ARM, gripper=OPEN01)


@register_policy("openvla_oft", config=OpenVLAOFTConfig, ray=True, sft=SFT_TOKENS, merge=True, compile=True,
                 value_head=True, action_convention=action_convention)
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


def _describe_checkpoint(path) -> str:
    """``embodirl doctor``'s checkpoint row: what the folder holds (a ConfigError for one without weights)."""
    contents = autoconfig.inspect(str(path))
    if contents is None:
        return f"{path}: a hub id not downloaded yet (checked when the worker loads it)"
    weights = sorted(p.name for p in contents.directory.glob("*.safetensors"))
    adapter = (contents.directory / "lora_adapter").is_dir() or (contents.directory / "adapter_config.json").is_file()
    if not weights and not adapter:
        raise ConfigError("model.path", f"{contents.directory} holds no *.safetensors weights and no LoRA adapter; point "
                                        "model.path at a checkpoint directory in the public OpenVLA-OFT layout")
    head = "L1 regression head" if contents.action_head is not None else "action tokens"
    rl = "evaluation only" if contents.action_head is not None else "RL-ready"
    return (f"{contents.directory.name}: {len(weights)} weight file(s), {head}, "
            f"{'proprio, ' if contents.proprio_projector is not None else ''}{contents.num_images} image(s), {rl}")


build_openvla_oft.check_config = _check_config
build_openvla_oft.describe_checkpoint = _describe_checkpoint
build_openvla_oft.check_spec = _check_spec
build_openvla_oft.check_run = check_run
