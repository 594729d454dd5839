"""The weight files of a checkpoint: locating them, and moving tensors between them and the network.

Public weight files (``model.safetensors`` or shards with ``model.safetensors.index.json``) hold the
Prismatic/timm names; :mod:`.names` maps every tensor onto this package's modules. Loading is strict:
a missing tensor, an unexpected tensor or a wrong shape is one :class:`CheckpointError` sentence naming
the parameter and the file. Component files (``<name>--<step>_checkpoint.pt``: proprio projector, action
head, value head) are read with ``torch.load(weights_only=True)`` and lose a DDP ``module.`` prefix.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from embodirl.errors import ConfigError
from embodirl.models.openvla_oft.lora import ADAPTER_NAME
from embodirl.models.openvla_oft.names import OURS_ONLY, parameter_rules, public_alias
from embodirl.models.openvla_oft.resolve import OFTConfig
from embodirl.paths import inside

if TYPE_CHECKING:
    from safetensors import safe_open

SINGLE_WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_NAME = "model-{index:05d}-of-{total:05d}.safetensors"
COMPONENT_PATTERN = "{name}--{step}_checkpoint.pt"
DDP_PREFIX = "module."
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
#: a Hugging Face hub repository id
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


class CheckpointError(ConfigError):
    """A checkpoint does not fit the model, or one of its files is unreadable; the message is one sentence naming
    the file or parameter, under the key that named the checkpoint (default ``model.path``), and reaches the user
    as every configuration error does (exit status 2, no traceback)."""

    def __init__(self, message: str, key: str = "model.path"):
        super().__init__(key, message)


class CheckpointFileMissing(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs is absent."""


# --- locating files ---------------------------------------------------------------------------------
#: sub-folders of a checkpoint whose files a load reads too (the LoRA adapter of an exported run)
CHECKED_SUBDIRS = ("", "lora_adapter")


def check_readable(directory: str | os.PathLike, key: str = "model.path") -> None:
    """Read every file of checkpoint ``directory`` a load would read, as far as its header: JSON files parse,
    safetensors headers parse, ``*.pt`` heads are torch's zip archives. Raises :class:`CheckpointError` naming the
    first damaged file, before any worker starts (a truncated download otherwise fails deep inside a worker)."""
    import zipfile

    from safetensors import safe_open

    for sub in CHECKED_SUBDIRS:
        folder = Path(directory) / sub
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            try:
                if path.suffix == ".json":
                    with open(path) as f:
                        json.load(f)
                elif path.suffix == ".safetensors":
                    with safe_open(str(path), framework="pt") as f:
                        f.keys()
                elif path.suffix == ".pt" and not zipfile.is_zipfile(path):
                    raise ValueError("not a torch zip archive")
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); the checkpoint "
                                      "is damaged: write or download it again", key) from None
            except Exception as exc:
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                kind = {".safetensors": "a safetensors file", ".pt": "a torch checkpoint"}.get(path.suffix, "readable")
                raise CheckpointError(f"{path} is not {kind} ({reason}); the checkpoint is damaged or incomplete: "
                                      "write or download it again", key) from None
def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """A local directory, or a hub id (``owner/name``) fetched with ``huggingface_hub.snapshot_download``."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.exists():
        raise CheckpointError(f"checkpoint path '{path}' is a file; give the checkpoint directory")
    if not HUB_ID.fullmatch(str(path)):
        raise CheckpointFileMissing(f"checkpoint directory '{path}' does not exist")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=str(path)))
    except Exception as exc:  # offline, unknown repo, auth: one sentence either way
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointFileMissing(f"checkpoint '{path}' is neither a local directory nor downloadable from "
                                    f"the Hugging Face hub ({reason})") from None


def weight_files(directory: Path) -> list[Path]:
    """The safetensors weight files of a checkpoint directory (empty when it has none)."""
    index = directory / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        outside = [n for n in names if inside(directory, n) is None]
        if outside:     # a downloaded checkpoint must not make this process read files outside it
            raise CheckpointError(f"{index} lists {outside[0]} in its weight_map, outside the checkpoint {directory}; "
                                  "a checkpoint's weight files stay inside its folder")
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise CheckpointFileMissing(f"{index} lists {missing[0]}, which is not in {directory}")
        return [directory / n for n in names]
    single = directory / SINGLE_WEIGHTS_FILE
    return [single] if single.is_file() else []


def find_component(directory: Path, name: str) -> Path | None:
    """``<name>--<step>_checkpoint.pt`` in ``directory`` (None when absent; several is an error)."""
    hits = sorted(p for p in directory.glob(f"{name}--*_checkpoint.pt"))
    if len(hits) > 1:
        raise CheckpointError(f"{directory} holds several {name}--*_checkpoint.pt files "
                              f"({', '.join(p.name for p in hits)}); keep one")
    return hits[0] if hits else None


def load_component(path: Path) -> dict[str, torch.Tensor]:
    """A component state dict, DDP ``module.`` prefix stripped."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {(k[len(DDP_PREFIX):] if k.startswith(DDP_PREFIX) else k): v for k, v in state.items()}


def copy_state(module: torch.nn.Module, state: Mapping[str, torch.Tensor], source: Path) -> None:
    """Strict ``load_state_dict`` whose failures name ``source`` and the parameter."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing:
        raise CheckpointError(f"{source.name} lacks parameter '{missing[0]}' ({len(missing)} missing)")
    if unexpected:
        raise CheckpointError(f"{source.name} holds parameters the model does not have: {unexpected[:5]}")
    for key, tensor in state.items():
        if tuple(own[key].shape) != tuple(tensor.shape):
            raise CheckpointError(f"parameter '{key}' in {source.name} has shape {tuple(tensor.shape)} but the "
                                  f"model expects {tuple(own[key].shape)}")
    with torch.no_grad():
        for key, tensor in state.items():
            own[key].copy_(tensor)


# --- parameter access on a (possibly peft-wrapped) network -------------------------------------------
def canonical_parameters(core: torch.nn.Module, which: str = "base") -> dict[str, torch.nn.Parameter]:
    """Unwrapped name -> parameter. ``base``: the loaded weights (LoRA base layers, original heads);
    ``active``: what the policy uses with adapters on (trained copies of modules-to-save)."""
    out: dict[str, torch.nn.Parameter] = {}
    copy_tag, original_tag = f".modules_to_save.{ADAPTER_NAME}.", ".original_module."
    for name, param in core.named_parameters():
        if ".lora_" in name:
            continue
        if copy_tag in name:
            if which == "active":
                out[name.replace(copy_tag, ".")] = param
            continue
        if original_tag in name:
            if which == "base":
                out[name.replace(original_tag, ".")] = param
            continue
        out[name.replace(".base_layer.", ".")] = param
    return out


def submodule_state(params: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) + 1:]: v.detach().cpu().clone() for k, v in params.items() if k.startswith(prefix + ".")}


# --- public weight tensors ---------------------------------------------------------------------------
class TensorSource:
    """Lazy view of the public tensors of one or more safetensors files, with LoRA deltas merged on read."""

    def __init__(self, files: list[Path], stack: ExitStack):
        from safetensors import safe_open

        self.files = files
        self._where: dict[str, tuple[safe_open, Path]] = {}
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            for key in handle.keys():
                self._where[key] = (handle, path)
        self.deltas: dict[str, list[torch.Tensor]] = {}
        self.replacements: dict[str, torch.Tensor] = {}

    def names(self) -> set[str]:
        return set(self._where)

    def file_of(self, name: str) -> str:
        return self._where[name][1].name if name in self._where else "the weight files"

    def lookup(self, name: str) -> str | None:
        """The stored spelling of ``name`` (accepting LayerScale's ``gamma``), or None."""
        if name in self._where:
            return name
        alias = public_alias(name)
        return alias if alias in self._where else None

    def shape(self, key: str) -> tuple[int, ...]:
        handle, _ = self._where[key]
        return tuple(handle.get_slice(key).get_shape())

    def get(self, key: str, public_name: str) -> torch.Tensor:
        handle, _ = self._where[key]
        tensor = self.replacements.get(public_name)
        if tensor is None:
            tensor = handle.get_tensor(key)
        for delta in self.deltas.get(public_name, []):
            tensor = (tensor.float() + delta.float()).to(tensor.dtype)
        return tensor


def load_public_weights(core: torch.nn.Module, cfg: OFTConfig, source: TensorSource, where: Path) -> None:
    """Copy every public tensor into ``core`` through the explicit rules; strict on names and shapes."""
    params = canonical_parameters(core, "base")
    consumed: set[str] = set()
    plan = []
    for rule in parameter_rules(cfg):
        keys = []
        for name in rule.public:
            key = source.lookup(name)
            if key is None:
                raise CheckpointError(f"{where} lacks parameter '{name}' in its weight files")
            keys.append(key)
        expected = rule.converter.public_shapes([tuple(params[o].shape) for o in rule.ours])
        for name, key, shape in zip(rule.public, keys, expected):
            if source.shape(key) != tuple(shape):
                raise CheckpointError(f"parameter '{name}' in {source.file_of(key)} has shape {source.shape(key)} "
                                      f"but the model expects {tuple(shape)} (the model config's sizes must match "
                                      f"the checkpoint)")
        consumed.update(keys)
        plan.append((rule, keys))
    unexpected = sorted(source.names() - consumed)
    if unexpected:
        files = sorted({source.file_of(k) for k in unexpected})
        raise CheckpointError(f"{', '.join(files)} in {where} hold parameters the model does not have: "
                              f"{unexpected[:5]}")
    with torch.no_grad():
        for rule, keys in plan:
            tensors = [source.get(key, name) for key, name in zip(keys, rule.public)]
            for ours, tensor in zip(rule.ours, rule.converter.to_ours(tensors)):
                params[ours].copy_(tensor)
        for name in OURS_ONLY:
            params[name].zero_()


def public_weights(core: torch.nn.Module, cfg: OFTConfig) -> dict[str, torch.Tensor]:
    """The base weights under their public names (CPU, contiguous)."""
    params = canonical_parameters(core, "base")
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for rule in parameter_rules(cfg):
            tensors = rule.converter.to_public([params[o].detach() for o in rule.ours])
            for name, tensor in zip(rule.public, tensors):
                out[name] = tensor.cpu().contiguous().clone()
    return out


def write_weight_files(state: Mapping[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> None:
    """``model.safetensors`` or numbered shards plus ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in state:
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_WEIGHTS_FILE), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = SHARD_NAME.format(index=i, total=len(shards))
        save_file(shard, str(directory / fname), metadata=metadata)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(directory / INDEX_FILE, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
