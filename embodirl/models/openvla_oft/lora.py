"""LoRA on the OFT network through peft: which linear layers get adapters, which heads stay fully trainable.

``target_modules: all-linear`` means every ``nn.Linear`` on the forward path: the vision blocks that
run (all but each tower's last), the projector, and the decoder layers. Like peft's own
``all-linear``, the LM head is left out; so are layers the forward never runs (each tower's last block,
SigLIP's pooling head), where an adapter would only collect zero gradients. A list of names selects,
peft style, the linear layers whose qualified name equals or ends with ``.<name>`` (``q_proj``,
``language_model.lm_head``, ...); ``all-linear`` inside such a list stands for the set above, so
``[all-linear, lm_head]`` also adapts the LM head (a randomly initialised small model needs that to move
its action distribution: its frozen head cannot rank the bins, see config/model/openvla_oft_tiny.yaml).

``modules_to_save`` lists the heads that stay fully trainable. The proprio projector becomes a peft
"module to save": a trainable copy is used while adapters are active, the original
under :meth:`peft.PeftModel.disable_adapter`, so the reference policy for KL is exactly the model as
loaded. The value head is trained in place instead: the reference policy has no use for values, so a
frozen copy would only cost memory; so is OFT's L1 action head when listed (``embodirl sft``'s
``sft.l1_head``). All adapters start at zero (B = 0), so a freshly wrapped policy acts
exactly like the loaded one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from torch import nn

from embodirl.errors import ConfigError
from embodirl.models.openvla_oft.modeling import OpenVLAOFT
from embodirl.models.openvla_oft.schema import Lora

if TYPE_CHECKING:
    from peft import PeftModel

#: OpenVLA-OFT's LoRA init (openvla-oft ``finetune.py``): A ~ N(0, 1/r), B = 0
LORA_INIT: Final = "gaussian"
#: heads that can be fully trainable "modules to save" but never carry a LoRA adapter
HEAD_MODULES = ("value_head", "proprio_projector", "action_head")
#: inside these the linear weights are read directly (nn.MultiheadAttention), so LoRA cannot apply
NON_ADAPTABLE = ("vision.siglip.head",)
ADAPTER_NAME = "default"
#: the target_modules value (alone or in a list) for every linear layer on the forward path but the LM head
ALL_LINEAR = "all-linear"
VALUE_HEAD = "value_head"
ACTION_HEAD = "action_head"


def _forward_path_prefixes(core: OpenVLAOFT) -> tuple[str, ...]:
    cfg = core.cfg
    dino_blocks = [f"vision.dino.encoder.layer.{i}." for i in range(cfg.model.vision.dino.num_hidden_layers - 1)]
    siglip_blocks = [f"vision.siglip.encoder.layers.{i}." for i in range(cfg.model.vision.siglip.num_hidden_layers - 1)]
    return (*dino_blocks, *siglip_blocks, "projector.", "language_model.model.layers.")


def lora_target_names(core: OpenVLAOFT, target_modules) -> list[str]:
    """Qualified names of the linear layers that get adapters (see module docstring)."""
    linears = [name for name, mod in core.named_modules()
               if isinstance(mod, nn.Linear)
               and not name.startswith(HEAD_MODULES) and not name.startswith(NON_ADAPTABLE)]
    if isinstance(target_modules, str):
        target_modules = (target_modules,)
    chosen: list[str] = []
    unmatched: list[str] = []
    for target in target_modules:
        if target == ALL_LINEAR:
            prefixes = _forward_path_prefixes(core)
            chosen.extend(name for name in linears if name.startswith(prefixes))
            continue
        hits = [name for name in linears if name == target or name.endswith("." + target)]
        (chosen.extend(hits) if hits else unmatched.append(target))
    if unmatched:
        raise ConfigError("model.lora.target_modules", f"{unmatched} match no linear layer of the model "
                                                       "(use e.g. q_proj, fc1, lm_head or all-linear)")
    return sorted(set(chosen), key=linears.index)


def apply_lora(core: OpenVLAOFT, settings: Lora) -> PeftModel:
    """Wrap ``core`` in a :class:`peft.PeftModel` (adapters at zero). ``core`` is modified in place and
    stays reachable as ``peft_model.get_base_model()``."""
    import peft

    targets = lora_target_names(core, settings.target_modules)
    to_save = [name for name in settings.modules_to_save
               if name not in (VALUE_HEAD, ACTION_HEAD) and getattr(core, name, None) is not None]
    # peft annotates lora_alpha as int; it only scales (alpha / r), and model.lora.alpha may be a float
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha,  # type: ignore[arg-type]
                             lora_dropout=settings.dropout,
                             target_modules=targets, modules_to_save=to_save or None,
                             init_lora_weights=LORA_INIT, bias="none")
    on_meta = core.projector.fc1.weight.is_meta  # structure only: create the adapters on meta too
    wrapped = peft.get_peft_model(core, config, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=on_meta)
    core.value_head.requires_grad_(VALUE_HEAD in settings.modules_to_save)
    if core.action_head is not None:  # OFT's L1 head (embodirl sft's sft.l1_head): trained in place, as the value head
        core.action_head.requires_grad_(ACTION_HEAD in settings.modules_to_save)
    return wrapped


def peft_parameter_names(module: nn.Module) -> set[str]:
    """Qualified names (within ``module``) of the parameters peft saves as an adapter: the LoRA
    matrices of every tuner layer and the trainable copies of the modules to save."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    names: set[str] = set()
    for prefix, mod in module.named_modules():
        if isinstance(mod, BaseTunerLayer):
            held = mod.adapter_layer_names
        elif isinstance(mod, ModulesToSaveWrapper):
            held = ("modules_to_save",)
        else:
            continue
        for attr in held:
            container = getattr(mod, attr, None)
            if isinstance(container, nn.Module):
                names.update(f"{prefix}.{attr}.{name}" for name, _ in container.named_parameters())
    return names
