"""What trains in a π0 network besides the heads: the action expert in full (``model.train_expert``, RLinf's π0
recipe, :func:`expert_parameters`) or LoRA adapters through peft (``model.lora``, :func:`apply_lora`), and the weights
with those adapters folded in (:func:`merged_state_dict`, the public checkpoint's)."""

from __future__ import annotations

import torch
from torch import nn

from embodirl.errors import ConfigError

#: the action expert's parameters (``model.train_expert``): its Gemma layers and final norm, the action/state/time
#: projections and the velocity head. Not the expert's token embedding, which π0 never reads (it feeds the expert
#: embeddings; openpi deletes it: ``gemma_expert.model.embed_tokens = None`` in gemma_pytorch.py)
EXPERT_PREFIXES = ("model.dit.", "embed_action_time.", "action_out_proj.")
EXPERT_UNUSED = "model.dit.embed_tokens."


def expert_parameters(network) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of the action expert (:data:`EXPERT_PREFIXES`, without its unused token embedding)."""
    return [(name, p) for name, p in network.named_parameters()
            if name.startswith(EXPERT_PREFIXES) and not name.startswith(EXPERT_UNUSED)]



def lora_on_expert(targets) -> ConfigError:
    """The refusal of adapters on an expert that ``model.train_expert`` trains in full."""
    return ConfigError("model.lora.target_modules", f"{targets} puts adapters on the action expert, which "
                                                    "model.train_expert trains in full; use vlm, or set "
                                                    "model.train_expert=false")


def apply_lora(network, settings, *, train_expert: bool = False):
    """Wrap the network in a :class:`peft.PeftModel` with adapters (at zero) on its linear layers: ``all-linear``
    (the vision tower, the VLM, the expert and the action projections), ``expert`` (the action expert and the action
    projections), ``vlm`` (the vision tower and the VLM), or a list of module-name suffixes. With ``train_expert`` the
    expert trains in full, so adapters there are refused."""
    import peft

    linears = [name for name, m in network.named_modules() if isinstance(m, nn.Linear)]
    expert = [n for n in linears if n.startswith(("model.dit.", "embed_action_time.", "action_out_proj"))]
    vlm = [n for n in linears if n.startswith("model.vlm.")]
    groups = {"all-linear": expert + vlm, "expert": expert, "vlm": vlm}
    targets = settings.target_modules
    if isinstance(targets, str):
        targets = [targets]
    chosen: list[str] = []
    for target in targets:
        hits = groups.get(target) or [n for n in linears if n == target or n.endswith("." + target)]
        if not hits:
            raise ConfigError("model.lora.target_modules", f"'{target}' matches no linear layer of π0 (use all-linear, "
                                                           "expert, vlm or a name such as q_proj)")
        chosen.extend(hits)
    if train_expert and set(chosen) & set(expert):
        raise lora_on_expert(settings.target_modules)
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=sorted(set(chosen)), bias="none")
    on_meta = network.action_out_proj.weight.is_meta
    return peft.get_peft_model(network, config, low_cpu_mem_usage=on_meta)



def merged_state_dict(network: nn.Module) -> dict[str, torch.Tensor]:
    """``network``'s weights under their ``PI0ForConditionalGeneration`` names, each LoRA layer's delta folded into its
    base weight (nothing changes in the live model)."""
    from peft.tuners.lora import LoraLayer

    state = {}
    lora_layers = {name: m for name, m in network.named_modules() if isinstance(m, LoraLayer)}
    for name, tensor in network.state_dict().items():
        if ".lora_" in name:
            continue
        layer_name, _, leaf = name.rpartition(".base_layer.")
        if layer_name in lora_layers and leaf == "weight":
            layer = lora_layers[layer_name]
            with torch.no_grad():
                # peft's LoraLayer mixin leaves get_delta_weight to its layer classes (Linear here)
                delta = layer.get_delta_weight(layer.active_adapters[0])  # type: ignore[attr-defined]
                tensor = tensor + delta.to(tensor.dtype)
        state[name.replace(".base_layer.", ".")] = tensor.detach()
    return state
