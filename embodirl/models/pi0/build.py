"""Building a :class:`~.policy.Pi0Policy`: a randomly initialised network of ``model``'s sizes
(:func:`network_config`) or a checkpoint's (:func:`.checkpoint.load_checkpoint`), its trained heads, and what
trains."""

from __future__ import annotations

import logging

import torch
from transformers import PI0ForConditionalGeneration

from embodirl.errors import ConfigError
from embodirl.models.pi0.checkpoint import load_checkpoint
from embodirl.models.pi0.lora import expert_parameters
from embodirl.models.pi0.openpi import keep_fp32_
from embodirl.models.pi0.policy import Pi0Policy
from embodirl.models.pi0.schema import Pi0ModelConfig

log = logging.getLogger(__name__)


def network_config(model: Pi0ModelConfig):
    """The ``PI0Config`` of a randomly initialised network of ``model``'s sizes."""
    from transformers import PI0Config

    lang, exp, vis = model.language, model.expert, model.vision
    if lang.num_hidden_layers != exp.num_hidden_layers:
        raise ConfigError("model.expert.num_hidden_layers", f"is {exp.num_hidden_layers}; the action expert reads the "
                                                            f"VLM's cache layer by layer, so it needs the VLM's "
                                                            f"{lang.num_hidden_layers}")
    for key in ("num_key_value_heads", "head_dim"):
        if getattr(lang, key) != getattr(exp, key):
            raise ConfigError(f"model.expert.{key}", f"is {getattr(exp, key)}; the expert reads the VLM's key/value "
                                                     f"cache, so it needs model.language.{key} = {getattr(lang, key)}")
    if model.image_size % vis.patch_size:
        raise ConfigError("model.image_size", f"{model.image_size} is not a multiple of the patch size {vis.patch_size}")
    text = {"model_type": "gemma", "hidden_size": lang.hidden_size, "num_hidden_layers": lang.num_hidden_layers,
            "intermediate_size": lang.intermediate_size, "num_attention_heads": lang.num_attention_heads,
            "num_key_value_heads": lang.num_key_value_heads, "head_dim": lang.head_dim, "vocab_size": lang.vocab_size}
    vision = {"model_type": "siglip_vision_model", "hidden_size": vis.hidden_size,
              "intermediate_size": vis.intermediate_size, "num_hidden_layers": vis.num_hidden_layers,
              "num_attention_heads": vis.num_attention_heads, "patch_size": vis.patch_size,
              "image_size": model.image_size, "vision_use_head": False}
    expert = {"model_type": "gemma", "hidden_size": exp.hidden_size, "num_hidden_layers": exp.num_hidden_layers,
              "intermediate_size": exp.intermediate_size, "num_attention_heads": exp.num_attention_heads,
              "num_key_value_heads": exp.num_key_value_heads, "head_dim": exp.head_dim}
    return PI0Config(vlm_config={"model_type": "paligemma", "text_config": text, "vision_config": vision,
                                 "projection_dim": lang.hidden_size, "image_token_id": lang.vocab_size},
                     dit_config=expert, chunk_size=model.chunk_size, max_state_dim=model.max_state_dim,
                     max_action_dim=model.max_action_dim, num_inference_steps=model.flow.num_steps)



def _image_count(model: Pi0ModelConfig, env_spec) -> int:
    cameras = len(env_spec.camera_names) if env_spec is not None else 0
    if model.num_images_in_input is not None:
        if env_spec is not None and model.num_images_in_input > cameras:
            raise ConfigError("model.num_images_in_input", f"is {model.num_images_in_input} but env "
                                                           f"'{env_spec.name}' has {cameras} camera(s)")
        return int(model.num_images_in_input)
    if cameras == 0:
        raise ConfigError("model.name", f"π0 needs camera images but env '{getattr(env_spec, 'name', '?')}' has none; "
                                        "use a pixel env (e.g. maniskill_pushcube_rgb, libero_*, toy_reach)")
    return cameras



def build_policy(model_cfg, env_spec=None, *, device: torch.device | str | None = None) -> Pi0Policy:
    """The policy ``model`` describes: random init (``path: null``, the sizes below) or a checkpoint (its own sizes).
    Trainable: the heads, the action expert with ``model.train_expert``, the adapters with ``model.lora``."""
    from embodirl.config_fields import instance
    from embodirl.dtypes import parse_dtype
    from embodirl.models.base import default_dtype

    model = instance(Pi0ModelConfig, model_cfg, "model")
    device = torch.device(device or model.device or "cpu")
    dtype = parse_dtype(model.dtype)
    assert dtype is not None                    # model.dtype is one of float32, bfloat16, float16
    action_dim = int(env_spec.action_dim) if env_spec is not None else model.max_action_dim
    heads = statistics = tokenizer = None
    if model.path:
        if device.type == "meta":
            raise ConfigError("model.device", "a checkpoint cannot be loaded onto the meta device")
        network, statistics, tokenizer, heads = load_checkpoint(model.path, dtype, device, model)
    else:
        config = network_config(model)
        config._attn_implementation = model.attn_implementation
        with torch.device(device), default_dtype(dtype):
            network = PI0ForConditionalGeneration(config)
        # every tensor on the build device, non-persistent buffers included: in one clean-clone suite run the time
        # embedding's sinusoid_freq buffer came out on the CPU in a model built on meta (not reproduced alone)
        network.to(device)  # type: ignore[arg-type]  # transformers' wrapper of .to is annotated as taking the model
    keep_fp32_(network)
    network.requires_grad_(False)
    if action_dim > network.config.max_action_dim:
        raise ConfigError("model.max_action_dim", f"is {network.config.max_action_dim} but env has {action_dim}-D actions")
    if model.action_chunk > network.config.chunk_size:
        raise ConfigError("model.action_chunk", f"is {model.action_chunk} but the network predicts "
                                                f"{network.config.chunk_size} actions per decision (model.chunk_size)")
    if env_spec is not None and env_spec.state_dim > network.config.max_state_dim:
        raise ConfigError("model.max_state_dim", f"is {network.config.max_state_dim} but env '{env_spec.name}' has a "
                                                 f"{env_spec.state_dim}-D state")
    with default_dtype(dtype):
        policy = Pi0Policy(model, network, action_dim=action_dim, num_images=_image_count(model, env_spec),
                           statistics=statistics, tokenizer=tokenizer,
                           task_descriptions=env_spec.task_descriptions if env_spec is not None else None,
                           action_low=env_spec.action_low if env_spec is not None else -1.0,
                           action_high=env_spec.action_high if env_spec is not None else 1.0)
    if heads:
        for name in ("value_head", "noise_head"):
            head = getattr(policy, name)
            part = {k[len(name) + 1:]: v for k, v in heads.items() if k.startswith(name + ".")}
            if head is None or not part:
                continue
            own = head.state_dict()
            if {k: tuple(v.shape) for k, v in part.items()} != {k: tuple(v.shape) for k, v in own.items()}:
                # a head of other settings (e.g. written before the value head read the expert): it starts fresh
                log.warning("%s: the checkpoint's %s has other shapes than model.%s makes; it starts fresh",
                            model.path, name, "value_head" if name == "value_head" else "flow")
                continue
            head.load_state_dict(part)
    for head in (policy.value_head, policy.noise_head):
        if head is not None:
            head.requires_grad_(True)
    if model.train_expert:
        for _, param in expert_parameters(policy.network):
            param.requires_grad_(True)
    return policy

