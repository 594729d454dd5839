"""Reading and writing OpenVLA-OFT checkpoints in the public layout.

A checkpoint is a directory (or a Hugging Face hub id, downloaded into the hub cache)::

    config.json                      Prismatic HF config (text_config, n_action_bins, image_sizes, norm_stats)
    model.safetensors | model-0000k-of-0000n.safetensors + model.safetensors.index.json
                                     weights under the original Prismatic/timm names (see names.py)
    dataset_statistics.json          action/proprio statistics (normalization.py)
    lora_adapter/                    peft adapter (adapter_config.json, adapter_model.safetensors)
    proprio_projector--<step>_checkpoint.pt   action_head--<step>_checkpoint.pt
    tokenizer files, preprocessor_config.json

Which LoRA adapter is applied how:

* public checkpoints with weight files are *merged* (OFT's fine-tuning script saves the merged model
  and, next to it, the adapter it merged): their ``lora_adapter/`` is not applied again;
* a directory without weight files but with ``lora_adapter/`` is an unmerged OFT run: the base weights
  come from ``model.base_path`` or the adapter's ``base_model_name_or_path`` and the adapter is merged
  into them while loading;
* checkpoints written here carry ``config.json["embodirl"]["adapter"] = "lora_adapter"``: the weight
  files hold the base (the KL reference) and the adapter is the live RL adapter, loaded into the
  policy's LoRA layers (or merged when ``model.lora.enabled`` is false). They add
  ``value_head--<step>_checkpoint.pt`` and, when the proprio projector is trained,
  ``reference_proprio--<step>_checkpoint.pt`` (the projector the reference policy uses), and write
  ``proprio_projector--<step>_checkpoint.pt`` as the trained one, so public tooling (base + adapter +
  projector) reads the trained policy.

Tensors and component files: :mod:`.weights`; adapters: :mod:`.adapters`. Every failure is one
:class:`CheckpointError` sentence naming the file or parameter. ``trust_remote_code`` is never needed:
the architecture is built here and the names are mapped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from embodirl import atomic_folder
from embodirl.models.normalization import STATS_FILENAME, load_statistics
from embodirl.models.openvla_oft.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    AdapterFile,
    adapter_as_deltas,
    lora_modules,
    public_adapter,
    read_adapter,
)
from embodirl.models.openvla_oft.lora import LORA_INIT
from embodirl.models.openvla_oft.modeling import OpenVLAOFT
from embodirl.models.openvla_oft.resolve import OFTConfig
from embodirl.models.openvla_oft.weights import (
    COMPONENT_PATTERN,
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_FILE,
    SINGLE_WEIGHTS_FILE,
    CheckpointError,
    CheckpointFileMissing,
    TensorSource,
    canonical_parameters,
    copy_state,
    find_component,
    load_component,
    load_public_weights,
    public_weights,
    resolve_checkpoint_dir,
    submodule_state,
    weight_files,
    write_weight_files,
)
from embodirl.models.processor import LLAMA_PAD_ID

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
PROPRIO, ACTION_HEAD, VALUE_HEAD, REFERENCE_PROPRIO = "proprio_projector", "action_head", "value_head", "reference_proprio"
#: our section inside config.json
MARKER = "embodirl"
FORMAT_VERSION = 1
#: ``config.json["embodirl"]`` key: true when the action tokens were trained (``embodirl sft``'s token loss);
#: read by autoconfig's RL-ready check
TOKENS_TRAINED = "action_tokens_trained"
LIVE_ADAPTER = "lora_adapter"
HASH_TOKENIZER = "hash_words"
#: files of a source checkpoint that a save carries over untouched (remote code, generation/processor settings)
PASSTHROUGH_SUFFIXES = (".py",)
PASSTHROUGH_FILES = ("generation_config.json", "processor_config.json", "added_tokens.json",
                     "special_tokens_map.json")
#: config.json fields the Prismatic/OpenVLA config class expects (written for randomly initialised models)
PRISMATIC_CONFIG: dict[str, Any] = {
    "architectures": ["OpenVLAForActionPrediction"], "model_type": "openvla",
    "vision_backbone_id": "dinosiglip-vit-so-224px", "llm_backbone_id": "llama2-7b-pure",
    "arch_specifier": "no-align+fused-gelu-mlp", "use_fused_vision_backbone": True,
    "timm_model_ids": ["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"],
    "timm_override_act_layers": [None, None], "image_resize_strategy": "resize-naive",
    "llm_max_length": 2048, "pad_token_id": LLAMA_PAD_ID, "pad_to_multiple_of": 64, "output_projector_states": False,
}
#: timm model families the fused DINOv2 + SigLIP backbone reproduces
SUPPORTED_TIMM_PREFIXES = ("vit_large_patch14_reg4_dinov2", "vit_so400m_patch14_siglip")


# --- loading ---------------------------------------------------------------------------------------
@dataclass
class LoadedCheckpoint:
    """What :func:`load_base` read besides the base weights; the policy applies the rest after LoRA wrapping."""

    directory: Path
    config: dict
    statistics: dict | None
    tokenizer: object | None          # transformers tokenizer, or None for the hashing tokenizer
    image_means_stds: tuple[list, list] | None
    live_adapter: AdapterFile | None = None
    trained_proprio: dict[str, torch.Tensor] | None = None


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None


def check_config_compatible(cfg: OFTConfig, config: Mapping, where: Path) -> None:
    """Cheap consistency checks between the model config and the checkpoint's config.json."""
    def mismatch(key, ours, theirs):
        raise CheckpointError(f"{where / CONFIG_FILE} has {key}={theirs} but the model config has {ours}")

    if config.get("use_fused_vision_backbone") is False:
        raise CheckpointError(f"{where / CONFIG_FILE} describes a single-tower vision backbone; only the fused "
                              "DINOv2 + SigLIP backbone is supported")
    timm_ids = config.get("timm_model_ids")
    if timm_ids and not all(str(t).startswith(p) for t, p in zip(timm_ids, SUPPORTED_TIMM_PREFIXES)):
        raise CheckpointError(f"{where / CONFIG_FILE} uses vision towers {timm_ids}; supported are "
                              f"{list(SUPPORTED_TIMM_PREFIXES)}")
    if "n_action_bins" in config and int(config["n_action_bins"]) != cfg.model.num_bins:
        mismatch("n_action_bins", cfg.model.num_bins, config["n_action_bins"])
    sizes = config.get("image_sizes")
    if sizes and any(int(s) != cfg.model.image_size for s in sizes):
        mismatch("image_sizes", cfg.model.image_size, sizes)
    text = config.get("text_config") or {}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "rms_norm_eps"):
        if key in text and float(text[key]) != float(getattr(cfg.model.llm, key)):
            mismatch(f"text_config.{key}", getattr(cfg.model.llm, key), text[key])


def _load_tokenizer(directories: Iterable[Path], marker: Mapping):
    for directory in directories:
        if any((directory / name).is_file() for name in TOKENIZER_FILES):
            from transformers import AutoTokenizer
            from transformers.utils import logging as hf_logging

            # AutoTokenizer peeks at config.json, whose model_type "openvla" transformers does not know:
            # keep its warning about that out of the logs (the architecture is not built from it)
            level = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()
            try:
                return AutoTokenizer.from_pretrained(str(directory))
            finally:
                hf_logging.set_verbosity(level)
    if marker.get("tokenizer") == HASH_TOKENIZER:
        return None
    first = next(iter(directories))
    raise CheckpointFileMissing(f"checkpoint {first} has no tokenizer (tokenizer.json / tokenizer.model)")


def load_base(core: OpenVLAOFT, cfg: OFTConfig, base_path_override: str | None = None) -> LoadedCheckpoint:
    """Load ``cfg.model.path`` into ``core`` (not yet LoRA-wrapped): base weights, heads, statistics, tokenizer."""
    assert cfg.model.path is not None           # called for a checkpoint only
    directory = resolve_checkpoint_dir(cfg.model.path)
    files = weight_files(directory)
    adapter_dir = directory / ADAPTER_DIR
    base_dir = directory
    config = _read_json(directory / CONFIG_FILE) if (directory / CONFIG_FILE).is_file() else None
    marker = (config or {}).get(MARKER) or {}
    merge: AdapterFile | None = None
    live: AdapterFile | None = None
    if not files:
        if not adapter_dir.is_dir():
            raise CheckpointFileMissing(f"checkpoint {directory} has no weight files ({SINGLE_WEIGHTS_FILE} or "
                                        f"{INDEX_FILE}) and no {ADAPTER_DIR}/")
        merge = read_adapter(adapter_dir)
        base_ref = base_path_override or merge.config.get("base_model_name_or_path")
        if not base_ref:
            raise CheckpointError(f"{adapter_dir / ADAPTER_CONFIG} names no base model; set model.base_path")
        base_dir = resolve_checkpoint_dir(base_ref)
        files = weight_files(base_dir)
        if not files:
            raise CheckpointFileMissing(f"base checkpoint {base_dir} has no weight files ({SINGLE_WEIGHTS_FILE} "
                                        f"or {INDEX_FILE})")
        if config is None and (base_dir / CONFIG_FILE).is_file():
            config = _read_json(base_dir / CONFIG_FILE)
    elif adapter_dir.is_dir():
        if marker.get("adapter") == LIVE_ADAPTER:
            live = read_adapter(adapter_dir)
            if not cfg.model.lora.enabled:
                merge, live = live, None
        else:
            log.info("%s: weights are merged; %s/ is the adapter already merged into them, not applied again",
                     directory, ADAPTER_DIR)
    if config is None:
        raise CheckpointFileMissing(f"checkpoint {directory} has no {CONFIG_FILE}")
    check_config_compatible(cfg, config, directory)

    with ExitStack() as stack:
        source = TensorSource(files, stack)
        if merge is not None:
            source.deltas = adapter_as_deltas(merge)
            source.replacements = dict(merge.extra)
            unknown = sorted(set(source.deltas) - source.names())
            if unknown:
                raise CheckpointError(f"{merge.path / ADAPTER_WEIGHTS} adapts '{unknown[0][:-len('.weight')]}', "
                                      f"which {base_dir} does not have")
        load_public_weights(core, cfg, source, base_dir)

    loaded = LoadedCheckpoint(directory=directory, config=config, statistics=None, tokenizer=None,
                              image_means_stds=None, live_adapter=live)
    _load_heads(core, cfg, directory, loaded)
    stats_path = directory / STATS_FILENAME
    if stats_path.is_file():
        loaded.statistics = load_statistics(stats_path)
    elif config.get("norm_stats"):
        loaded.statistics = config["norm_stats"]
    loaded.tokenizer = _load_tokenizer([directory, base_dir] if base_dir != directory else [directory], marker)
    for d in (directory, base_dir):
        if (d / PREPROCESSOR_FILE).is_file():
            pre = _read_json(d / PREPROCESSOR_FILE)
            if pre.get("means") and pre.get("stds"):
                loaded.image_means_stds = (pre["means"], pre["stds"])
            break
    return loaded


def _load_heads(core: OpenVLAOFT, cfg: OFTConfig, directory: Path, loaded: LoadedCheckpoint) -> None:
    if cfg.use_proprio:
        assert core.proprio_projector is not None   # cfg.use_proprio builds it
        trained = find_component(directory, PROPRIO)
        if trained is None:
            raise CheckpointFileMissing(f"checkpoint {directory} has no {PROPRIO}--<step>_checkpoint.pt; set "
                                        "model.use_proprio: false to run without the proprio token")
        reference = find_component(directory, REFERENCE_PROPRIO)
        copy_state(core.proprio_projector, load_component(reference or trained), reference or trained)
        if reference is not None:
            loaded.trained_proprio = load_component(trained)
    if cfg.use_l1_regression:
        assert core.action_head is not None         # cfg.use_l1_regression builds it
        head = find_component(directory, ACTION_HEAD)
        if head is None:
            raise CheckpointFileMissing(f"checkpoint {directory} has no {ACTION_HEAD}--<step>_checkpoint.pt; set "
                                        "model.use_l1_regression: false to decode tokens")
        copy_state(core.action_head, load_component(head), head)
    value = find_component(directory, VALUE_HEAD)
    if value is not None:
        copy_state(core.value_head, load_component(value), value)


# --- saving ----------------------------------------------------------------------------------------
def save(core: torch.nn.Module, cfg: OFTConfig, directory: str | os.PathLike, *, step: int,
         model_cfg, statistics: Mapping | None, tokenizer, image_config: Mapping,
         source: LoadedCheckpoint | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
         marker: Mapping | None = None) -> Path:
    """Write the checkpoint layout described in the module docstring, atomically (:mod:`embodirl.atomic_folder`: into
    ``.<name>.writing-<pid>`` beside it; an existing folder is deleted only once the new one is in its place; what a
    killed export left is cleared first). ``marker``: entries added to ``config.json["embodirl"]`` (e.g.
    :data:`TOKENS_TRAINED` from ``embodirl sft``); a source checkpoint's :data:`TOKENS_TRAINED` record is carried
    over."""
    final = Path(directory).expanduser().resolve()
    tmp = atomic_folder.temporary(final)
    try:
        _write(core, cfg, tmp, final, step=step, model_cfg=model_cfg, statistics=statistics, tokenizer=tokenizer,
               image_config=image_config, source=source, max_shard_bytes=max_shard_bytes, marker=marker)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return atomic_folder.swap_in(tmp, final)


def _write(core, cfg: OFTConfig, out: Path, final: Path, *, step, model_cfg, statistics, tokenizer, image_config,
           source, max_shard_bytes, marker=None) -> None:
    write_weight_files(public_weights(core, cfg), out, max_shard_bytes)
    has_adapter = bool(lora_modules(core))
    config = dict(source.config) if source is not None else dict(PRISMATIC_CONFIG)
    text = dict(config.get("text_config") or {})
    text.update({k: v for k, v in dataclasses.asdict(cfg.model.llm).items() if k != "rope_theta"},
                model_type="llama", rope_theta=cfg.model.llm.rope_theta, pad_token_id=PRISMATIC_CONFIG["pad_token_id"])
    config.update(text_config=text, n_action_bins=cfg.model.num_bins, image_sizes=[cfg.model.image_size] * 2,
                  num_images_in_input=cfg.num_images_in_input)  # read back by autoconfig.py
    if statistics:
        config["norm_stats"] = dict(statistics)
    config[MARKER] = {"format_version": FORMAT_VERSION, "step": int(step),
                      "adapter": LIVE_ADAPTER if has_adapter else None,
                      "tokenizer": "files" if tokenizer is not None else HASH_TOKENIZER,
                      "model": dataclasses.asdict(model_cfg)}     # the typed model section, as JSON
    inherited = ((source.config.get(MARKER) or {}) if source is not None else {}).get(TOKENS_TRAINED)
    if inherited is not None:
        config[MARKER][TOKENS_TRAINED] = inherited
    config[MARKER].update(dict(marker or {}))
    with open(out / CONFIG_FILE, "w") as f:
        json.dump(config, f, indent=2)
    if statistics:
        with open(out / STATS_FILENAME, "w") as f:
            json.dump(statistics, f, indent=2)
    if has_adapter:
        _write_adapter(core, cfg, out / ADAPTER_DIR, final)
    base = canonical_parameters(core, "base")
    active = canonical_parameters(core, "active")
    components = {VALUE_HEAD: submodule_state(active, VALUE_HEAD)}
    if cfg.use_proprio:
        components[PROPRIO] = submodule_state(active, PROPRIO)
        reference = submodule_state(base, PROPRIO)
        if any(not torch.equal(reference[k], components[PROPRIO][k]) for k in reference):
            components[REFERENCE_PROPRIO] = reference
    if cfg.use_l1_regression:
        components[ACTION_HEAD] = submodule_state(active, ACTION_HEAD)
    for name, state in components.items():
        torch.save(state, out / COMPONENT_PATTERN.format(name=name, step=int(step)))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    if source is not None:
        for path in source.directory.iterdir():
            if path.is_file() and (path.suffix in PASSTHROUGH_SUFFIXES or path.name in PASSTHROUGH_FILES) \
                    and not (out / path.name).exists():
                shutil.copy2(path, out / path.name)
    if not (out / PREPROCESSOR_FILE).exists():
        src = source.directory / PREPROCESSOR_FILE if source is not None else None
        if src is not None and src.is_file():
            shutil.copy2(src, out / PREPROCESSOR_FILE)
        else:
            with open(out / PREPROCESSOR_FILE, "w") as f:
                json.dump(dict(image_config), f, indent=2)


def _write_adapter(core, cfg: OFTConfig, out: Path, final: Path) -> None:
    import peft
    from safetensors.torch import save_file

    tensors, rank_pattern, alpha_pattern, targets = public_adapter(core, cfg)
    out.mkdir()
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    # peft annotates lora_alpha as int; it only scales (alpha / r), and model.lora.alpha may be a float
    config = peft.LoraConfig(r=cfg.model.lora.rank, lora_alpha=cfg.model.lora.alpha,  # type: ignore[arg-type]
                             lora_dropout=cfg.model.lora.dropout, target_modules=targets,
                             rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, init_lora_weights=LORA_INIT,
                             bias="none", base_model_name_or_path=str(final))
    config.save_pretrained(str(out))
