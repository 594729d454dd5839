"""π0's checkpoint folders, read: transformers' layout (``config.json`` of ``model_type`` pi0, safetensors weights, the
statistics in ``processor_config.json``, the trained heads in ``embodirl_heads.safetensors``, the tokenizer's files) or
LeRobot's (:mod:`.lerobot`); and written, in transformers' layout (:func:`save_checkpoint`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import PI0ForConditionalGeneration

from embodirl.errors import ConfigError
from embodirl.models.pi0 import lerobot
from embodirl.models.pi0.lora import merged_state_dict
from embodirl.models.pi0.openpi import fp32_on_load
from embodirl.models.pi0.schema import Pi0ModelConfig

log = logging.getLogger(__name__)

#: the statistics file an exported π0 checkpoint carries (transformers' PI0Processor keys)
PROCESSOR_FILE = "processor_config.json"
HEADS_FILE = "embodirl_heads.safetensors"
STAT_KEYS = ("state_mean", "state_std", "actions_mean", "actions_std")
#: PaliGemma's vocabulary: a checkpoint with it reads prompts through PaliGemma's tokenizer, whose files it must carry
PALIGEMMA_VOCAB = 257_152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def _read_config(path: str | Path) -> tuple[Path, dict]:
    """``(folder, config.json parsed)``: one :class:`ConfigError` sentence naming the file when it is absent or not a
    JSON object."""
    folder = Path(path).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError("model.path", f"{folder} has no config.json; give a transformers- or LeRobot-layout π0 "
                                        "checkpoint folder")
    try:
        data = json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError("model.path", f"{config} is not JSON ({str(exc).splitlines()[0]}); write it again") from None
    if not isinstance(data, dict):
        raise ConfigError("model.path", f"{config} is not a JSON object; write it again")
    return folder, data


def _check_tokenizer(folder: Path, vocab_size: int, name: str | None = None) -> None:
    """A checkpoint with PaliGemma's vocabulary reads its prompts in PaliGemma's token ids, which only PaliGemma's
    tokenizer gives: one :class:`ConfigError` sentence when its files are not in the folder (the hashing tokenizer
    would hand the trained network arbitrary ids). Smaller vocabularies (``pi0_tiny``'s) hash their words."""
    if vocab_size < PALIGEMMA_VOCAB or any((folder / f).is_file() for f in TOKENIZER_FILES):
        return
    source = name or "google/paligemma-3b-pt-224"
    raise ConfigError("model.path", f"{folder} holds a π0 with PaliGemma's {vocab_size}-token vocabulary but no "
                                    f"tokenizer: copy the tokenizer files of {source} (tokenizer.json or "
                                    "tokenizer.model, with tokenizer_config.json and special_tokens_map.json) into it")


def check_checkpoint(path: str | Path) -> str:
    """A π0 folder, read without building anything: transformers' layout (``config.json`` says ``model_type`` pi0,
    every weight file's header reads, the statistics file parses) or LeRobot's (:mod:`.lerobot`). One
    :class:`ConfigError` sentence naming the file otherwise; else a one-line description (``embodirl doctor``)."""
    from safetensors import safe_open

    folder, data = _read_config(path)
    config = folder / "config.json"
    if lerobot.is_lerobot_config(data):
        checkpoint = lerobot.read(folder, data)
        if checkpoint.variants[0] in lerobot.GEMMA_VARIANTS:       # a VLM of LeRobot's: PaliGemma's vocabulary
            _check_tokenizer(folder, lerobot.LEROBOT_VOCAB, checkpoint.tokenizer_name)
        return checkpoint.describe()
    if data.get("model_type") != "pi0":
        raise ConfigError("model.path", f"{config} describes a '{data.get('model_type')}' model; π0 checkpoints say "
                                        "model_type pi0 (use the model option of that checkpoint)")
    weights = sorted(p for p in folder.glob("*.safetensors") if p.name != HEADS_FILE)
    if not weights:
        raise ConfigError("model.path", f"{folder} holds no *.safetensors weights; export the checkpoint again")
    for file in [*weights, *([folder / HEADS_FILE] if (folder / HEADS_FILE).is_file() else [])]:
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as exc:   # safetensors raises its own error types for a bad header
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError("model.path", f"{file} is not a safetensors file ({reason}); write it again") from None
    text_config = (data.get("vlm_config") or {}).get("text_config") or {}
    _check_tokenizer(folder, int(text_config.get("vocab_size", PALIGEMMA_VOCAB)))
    statistics = "no statistics (identity)"
    if (folder / PROCESSOR_FILE).is_file():
        try:
            found = [k for k in STAT_KEYS if k in json.loads((folder / PROCESSOR_FILE).read_text())]
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError("model.path", f"{folder / PROCESSOR_FILE} is not JSON ({str(exc).splitlines()[0]}); "
                                            "write it again") from None
        statistics = f"statistics ({', '.join(found) or 'none'})"
    heads = "value/noise heads" if (folder / HEADS_FILE).is_file() else "no trained heads"
    return (f"{folder.name}: π0, {len(weights)} weight file(s), chunk {data.get('chunk_size')} x "
            f"{data.get('max_action_dim')}, {statistics}, {heads}")


def _from_pretrained(folder: Path, dtype: torch.dtype, device, *,
                     fix: str = "use the checkpoint's own files", **kwargs):
    """``PI0ForConditionalGeneration.from_pretrained`` (:data:`.openpi.FP32_PARAMETERS` loaded in float32,
    :func:`.openpi.fp32_on_load`) that lets no weight go missing, stay unused or change shape (transformers would
    initialise it at random and go on): one :class:`ConfigError` sentence ending in ``fix`` instead."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()          # one bar per load in every worker's log otherwise
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()           # its load report is many lines; the sentence below says what matters
    network: PI0ForConditionalGeneration
    info: dict[str, list]
    try:
        with fp32_on_load():
            # output_loading_info=True makes it a (model, info) pair, which transformers' annotation does not say
            network, info = PI0ForConditionalGeneration.from_pretrained(  # type: ignore[misc]
                str(folder), dtype=dtype, device_map=str(device), output_loading_info=True,
                ignore_mismatched_sizes=True, **kwargs)
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError("model.path", f"{folder} is not a loadable π0 checkpoint ({first})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    problems = [(what, sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(key) or ()))
                for what, key in (("missing", "missing_keys"), ("unused", "unexpected_keys"),
                                  ("of another shape", "mismatched_keys"))]
    problems = [(what, keys) for what, keys in problems if keys]
    if problems:
        told = ", ".join(f"{len(keys)} {what} (e.g. {keys[0]})" for what, keys in problems)
        raise ConfigError("model.path", f"{folder}'s weights do not fit the network its config describes: {told}; "
                                        f"{fix}")
    return network


def load_checkpoint(path: str | Path, dtype: torch.dtype, device, model: Pi0ModelConfig):
    """``(network, statistics, tokenizer or None, heads)`` from a transformers- or LeRobot-layout π0 folder (a LeRobot
    network of variants LeRobot does not define takes ``model``'s sizes, see :func:`.lerobot.network_config`)."""
    folder, data = _read_config(path)
    if lerobot.is_lerobot_config(data):
        checkpoint = lerobot.read(folder, data)
        config = lerobot.network_config(checkpoint, model)
        network = _from_pretrained(folder, dtype, device, fix=lerobot.size_fix(checkpoint), config=config,
                                   attn_implementation=model.attn_implementation)
        statistics = checkpoint.statistics or None
        if config.num_inference_steps != model.flow.num_steps:
            log.info("%s was sampled with %d denoising steps; model.flow.num_steps = %d runs here", folder,
                     config.num_inference_steps, model.flow.num_steps)
        tokenizer_name = checkpoint.tokenizer_name
    else:
        network = _from_pretrained(folder, dtype, device)
        statistics = None
        if (folder / PROCESSOR_FILE).is_file():
            statistics = {k: v for k, v in json.loads((folder / PROCESSOR_FILE).read_text()).items() if k in STAT_KEYS}
        tokenizer_name = None
    _check_tokenizer(folder, int(network.config.vlm_config.text_config.vocab_size), tokenizer_name)
    tokenizer = None
    if any((folder / f).is_file() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    heads = None
    if (folder / HEADS_FILE).is_file():
        from safetensors.torch import load_file

        heads = load_file(str(folder / HEADS_FILE))
    return network, statistics, tokenizer, heads



def processor_statistics(statistics: Mapping) -> dict[str, list[float]]:
    """The standardisation statistics of ``statistics``: PI0Processor's keys (``state_mean``, ``state_std``,
    ``actions_mean``, ``actions_std``), or the ``dataset_statistics.json`` layout ``embodirl sft`` computes (one entry
    with ``action`` and ``proprio`` blocks; their ``mean`` and ``std`` are used)."""
    if not any(k in statistics for k in STAT_KEYS):
        entries = [v for v in statistics.values() if isinstance(v, Mapping) and "action" in v]
        if len(entries) != 1:
            raise ValueError("π0 statistics need state/actions mean and std, or one dataset_statistics entry")
        entry = entries[0]
        statistics = {"actions_mean": entry["action"]["mean"], "actions_std": entry["action"]["std"]}
        if "proprio" in entry:
            statistics.update(state_mean=entry["proprio"]["mean"], state_std=entry["proprio"]["std"])
    return {k: list(map(float, statistics[k])) for k in STAT_KEYS if k in statistics}


def statistics_tensors(statistics: Mapping[str, Sequence[float]] | None, state_width: int, action_width: int,
                       device: torch.device) -> dict[str, torch.Tensor]:
    """Standardisation statistics padded to the network's widths: state ``[state_width]`` (``max_state_dim``), actions
    ``[action_width]`` (``max_action_dim``); identity where the checkpoint says nothing."""
    out = {}
    for key, width in (("state", state_width), ("actions", action_width)):
        mean = torch.zeros(width, dtype=torch.float32, device=device)
        std = torch.ones(width, dtype=torch.float32, device=device)
        if statistics is not None and f"{key}_mean" in statistics:
            m = torch.as_tensor(statistics[f"{key}_mean"], dtype=torch.float32).reshape(-1)
            s = torch.as_tensor(statistics[f"{key}_std"], dtype=torch.float32).reshape(-1)
            if m.numel() > width or s.numel() != m.numel():
                raise ConfigError("model.path", f"the checkpoint's {key}_mean/{key}_std have {m.numel()}/"
                                                f"{s.numel()} entries; the network takes at most {width}")
            mean[: m.numel()] = m.to(device)
            std[: s.numel()] = s.to(device)
        out[f"{key}_mean"], out[f"{key}_std"] = mean, std
    return out


def save_checkpoint(directory: str | Path, network: nn.Module, processor: Mapping[str, object],
                    heads: Mapping[str, nn.Module | None], tokenizer, *, step: int = 0,
                    marker: Mapping | None = None) -> Path:
    """A transformers ``PI0ForConditionalGeneration`` folder of ``network`` (``from_pretrained`` reads it back, LoRA
    folded in, ``step`` and ``marker`` in its config's ``embodirl`` entry), ``processor`` (the statistics and sizes)
    in :data:`PROCESSOR_FILE`, the heads that are there in :data:`HEADS_FILE`, and the tokenizer's files."""
    from safetensors.torch import save_file
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plain = PI0ForConditionalGeneration._from_config(network.config)
    plain.load_state_dict(merged_state_dict(network), strict=True, assign=True)
    plain.config.embodirl = {"step": int(step), **dict(marker or {})}
    plain.save_pretrained(str(directory))
    (directory / PROCESSOR_FILE).write_text(json.dumps(dict(processor), indent=2))
    tensors = {f"{name}.{k}": v.detach().cpu().contiguous() for name, head in heads.items()
               if head is not None for k, v in head.state_dict().items()}
    if tensors:
        save_file(tensors, str(directory / HEADS_FILE), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory
