"""LoRA adapters in the public layout (peft's ``adapter_config.json`` + ``adapter_model.safetensors``).

Public adapters name timm/Prismatic modules (``...featurizer.blocks.N.attn.qkv``); ours adapt the split
``q_proj``/``k_proj``/``v_proj``. :func:`public_adapter` and :func:`load_live_adapter` convert exactly in
both directions; :func:`adapter_as_deltas` turns any public adapter into weight deltas for merging.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from embodirl.models.openvla_oft.lora import ADAPTER_NAME
from embodirl.models.openvla_oft.names import QKV_PARTS, linear_module_map
from embodirl.models.openvla_oft.resolve import OFTConfig
from embodirl.models.openvla_oft.weights import CheckpointError, CheckpointFileMissing

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer

ADAPTER_DIR = "lora_adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_PREFIX = "base_model.model."


@dataclass
class AdapterFile:
    """One peft adapter directory read into memory: per public module ``(A [r, in], B [out, r], scaling)``."""

    path: Path
    config: dict
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # modules-to-save tensors, public names


def read_adapter(directory: Path) -> AdapterFile:
    cfg_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    for path in (cfg_path, weights_path):
        if not path.is_file():
            raise CheckpointFileMissing(f"LoRA adapter {directory} has no {path.name}")
    from safetensors.torch import load_file

    with open(cfg_path) as f:
        config = json.load(f)
    tensors = load_file(str(weights_path))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    extra = {}
    pattern = re.compile(r"^(?:base_model\.model\.)?(.+?)\.(lora_A|lora_B)(?:\.[\w-]+)?\.weight$")
    for key, tensor in tensors.items():
        match = pattern.match(key)
        if match:
            pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
        else:
            name = key[len(ADAPTER_PREFIX):] if key.startswith(ADAPTER_PREFIX) else key
            extra[name.replace(f".modules_to_save.{ADAPTER_NAME}", "")] = tensor
    modules = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise CheckpointError(f"{weights_path} has an incomplete LoRA pair for '{module}'")
        rank = pair["lora_A"].shape[0]
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", rank))
        rank_cfg = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", rank))
        if rank_cfg != rank:
            raise CheckpointError(f"{weights_path} stores rank {rank} for '{module}' but {ADAPTER_CONFIG} says {rank_cfg}")
        scaling = alpha / (rank ** 0.5 if config.get("use_rslora") else rank)
        modules[module] = (pair["lora_A"], pair["lora_B"], float(scaling))
    return AdapterFile(directory, config, modules, extra)


def _pattern_value(patterns: Mapping, module: str, default):
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def adapter_as_deltas(adapter: AdapterFile) -> dict[str, list[torch.Tensor]]:
    """Public weight name -> [scaling * B @ A] for merging an adapter into base weights."""
    return {f"{module}.weight": [scaling * (B.float() @ A.float())]
            for module, (A, B, scaling) in adapter.modules.items()}


def lora_modules(core: torch.nn.Module) -> dict[str, LoraLayer]:
    """Our LoRA-adapted linear layers by (unwrapped) module name."""
    from peft.tuners.lora import LoraLayer

    return {name: mod for name, mod in core.named_modules() if isinstance(mod, LoraLayer)}


def public_adapter(core: torch.nn.Module, cfg: OFTConfig) -> tuple[dict[str, torch.Tensor], dict, dict, list[str]]:
    """Our adapters in the public layout: tensors, rank_pattern, alpha_pattern, target module names.

    Three adapters on q/k/v of one timm ``qkv`` become one adapter on ``qkv``: rank r with the q/k/v
    ``B`` rows stacked when they share ``A`` (as after loading a public adapter), otherwise rank ``n r``
    with the ``A`` stacked and ``B`` block-diagonal - the same update, exactly (``alpha`` scaled by ``n``
    to keep ``alpha / r``). Rows of parts without an adapter are zero.
    """
    mapping = linear_module_map(cfg)
    rank, alpha = cfg.model.lora.rank, cfg.model.lora.alpha
    grouped: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor, LoraLayer]]] = {}
    for name, mod in lora_modules(core).items():
        if name not in mapping:
            raise CheckpointError(f"LoRA layer '{name}' has no public counterpart")
        public, part = mapping[name]
        own_A, own_B = _lora_weights(mod)
        A = own_A.detach().cpu()
        B = own_B.detach().cpu()
        grouped.setdefault(public, {})[part] = (A, B, mod)
    tensors, rank_pattern, alpha_pattern = {}, {}, {}
    for public, parts in grouped.items():
        if None in parts:
            A, B, _ = parts[None]
        else:
            present = sorted(p for p in parts if p is not None)     # None (a whole layer) is not among them here
            out = parts[present[0]][1].shape[0]
            As = [parts[p][0] for p in present]
            if len(present) == QKV_PARTS and all(torch.equal(As[0], a) for a in As[1:]):
                A = As[0]
                B = torch.cat([parts[p][1] for p in present], dim=0)
            else:
                A = torch.cat(As, dim=0)                                            # (n r, in)
                B = torch.zeros(QKV_PARTS * out, len(present) * rank, dtype=As[0].dtype)  # (3 out, n r)
                for j, p in enumerate(present):
                    B[p * out:(p + 1) * out, j * rank:(j + 1) * rank] = parts[p][1]
                if len(present) > 1:
                    rank_pattern[public] = len(present) * rank
                    alpha_pattern[public] = len(present) * alpha
        tensors[f"{ADAPTER_PREFIX}{public}.lora_A.weight"] = A.contiguous().clone()
        tensors[f"{ADAPTER_PREFIX}{public}.lora_B.weight"] = B.contiguous().clone()
    return tensors, rank_pattern, alpha_pattern, sorted(grouped)


def load_live_adapter(core: torch.nn.Module, cfg: OFTConfig, adapter: AdapterFile) -> None:
    """Load a public-layout adapter written by :func:`save` into our LoRA layers (exact inverse of
    :func:`public_adapter`)."""
    cfg_file = adapter.path / ADAPTER_CONFIG
    weights_file = adapter.path / ADAPTER_WEIGHTS
    lora = cfg.model.lora
    if int(adapter.config.get("r", -1)) != lora.rank or float(adapter.config.get("lora_alpha", -1)) != lora.alpha:
        raise CheckpointError(f"{cfg_file} has r={adapter.config.get('r')}, lora_alpha={adapter.config.get('lora_alpha')} "
                              f"but model.lora asks for rank={lora.rank}, alpha={lora.alpha}")
    mapping = linear_module_map(cfg)
    ours = lora_modules(core)
    by_public: dict[str, dict[int | None, LoraLayer]] = {}
    for name, mod in ours.items():
        public, part = mapping[name]
        by_public.setdefault(public, {})[part] = mod
    extra = sorted(set(adapter.modules) - set(by_public))
    if extra:
        raise CheckpointError(f"{weights_file} adapts {extra[:3]}, which have no LoRA layer in this model "
                              "(model.lora.target_modules)")
    missing = sorted(set(by_public) - set(adapter.modules))
    if missing:
        raise CheckpointError(f"{weights_file} has no adapter for '{missing[0]}' ({len(missing)} missing)")
    r = cfg.model.lora.rank
    with torch.no_grad():
        for public, parts in by_public.items():
            A, B, _ = adapter.modules[public]
            if None in parts:
                _assign_lora(parts[None], A, B, weights_file, public)
                continue
            present = sorted(p for p in parts if p is not None)     # None (a whole layer) is not among them here
            out = B.shape[0] // QKV_PARTS
            absent = [p for p in range(QKV_PARTS) if p not in parts]
            for p in absent:
                if torch.count_nonzero(B[p * out:(p + 1) * out]).item():
                    raise CheckpointError(f"{weights_file} adapts part {p} of '{public}', which has no LoRA layer here")
            if A.shape[0] == r:
                for p in present:
                    _assign_lora(parts[p], A, B[p * out:(p + 1) * out], weights_file, public)
            elif A.shape[0] == len(present) * r:
                for j, p in enumerate(present):
                    block = B[p * out:(p + 1) * out]
                    off = torch.cat([block[:, :j * r], block[:, (j + 1) * r:]], dim=1)
                    if torch.count_nonzero(off).item():
                        raise CheckpointError(f"{weights_file}'s adapter of '{public}' mixes q/k/v ranks and cannot be "
                                              f"split into rank-{r} adapters")
                    _assign_lora(parts[p], A[j * r:(j + 1) * r], block[:, j * r:(j + 1) * r], weights_file, public)
            else:
                raise CheckpointError(f"{weights_file} has rank {A.shape[0]} for '{public}', expected {r} or "
                                      f"{len(present) * r}")


def _lora_weights(mod: LoraLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``A`` and ``B`` weights of ``mod``'s adapter (linear layers; ``nn.ModuleDict``'s index says only Module)."""
    return (cast(torch.nn.Linear, mod.lora_A[ADAPTER_NAME]).weight,
            cast(torch.nn.Linear, mod.lora_B[ADAPTER_NAME]).weight)


def _assign_lora(mod: LoraLayer, A: torch.Tensor, B: torch.Tensor, source: Path, public: str) -> None:
    own_A, own_B = _lora_weights(mod)
    if own_A.shape != A.shape or own_B.shape != B.shape:
        raise CheckpointError(f"adapter of '{public}' in {source.name} has shapes {tuple(A.shape)}/{tuple(B.shape)} but "
                              f"the model's are {tuple(own_A.shape)}/{tuple(own_B.shape)}")
    own_A.copy_(A)
    own_B.copy_(B)
