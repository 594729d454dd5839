"""The LeRobot π0 checkpoint layout, read without LeRobot: the folder ``PI0Policy.save_pretrained`` and its processor
pipelines write (as on the hub for ``lerobot/pi0_base`` and ``lerobot/pi0_libero_finetuned``).

What a folder holds, as read in huggingface/lerobot @ 7427f31801f944f5ec9ce53cda02862ce7d1638b (main, 2026-08-23; the
same in v0.4.0 @ f25ac02e6c8fa9c467ab8462289e5f4aed3a2e85, the release whose π0 port wrote the hub checkpoints):

* ``config.json`` - ``src/lerobot/configs/policies.py`` (``PreTrainedConfig._save_pretrained``) dumps the policy's
  dataclass with draccus, its choice key ``"type": "pi0"`` first, then the fields of
  ``src/lerobot/policies/pi0/configuration_pi0.py``: ``paligemma_variant`` / ``action_expert_variant`` (the Gemma sizes
  of ``get_gemma_config`` in ``modeling_pi0.py``), ``chunk_size``, ``n_action_steps``, ``max_state_dim``,
  ``max_action_dim``, ``num_inference_steps``, the flow's time-sampling numbers, ``image_resolution``,
  ``input_features`` / ``output_features`` (``{key: {"type": "STATE"|"VISUAL"|"ACTION", "shape": [...]}}``),
  ``normalization_mapping`` and ``tokenizer_max_length``.
* ``model.safetensors`` - ``PI0Policy.model`` is ``PI0Pytorch`` (``modeling_pi0.py``): ``paligemma_with_expert``
  holds a ``PaliGemmaForConditionalGeneration`` (``paligemma``; the lm_head tied to the token embedding, stored once as
  ``lm_head``) and a ``GemmaForCausalLM`` expert (``gemma_expert``, its token embedding removed, its lm_head kept), next
  to ``action_in_proj``, ``action_out_proj``, ``state_proj`` and ``action_time_mlp_in`` / ``_out``. The VLM's vocabulary
  (257152), its SigLIP so400m/14 tower (intermediate 4304) and projector are fixed there, not in config.json.
  transformers' own conversion mapping (``conversion_mapping.py``, entry ``"pi0"``) renames those keys on load, so
  ``PI0ForConditionalGeneration.from_pretrained`` takes the file with a ``PI0Config`` built here.
* ``policy_preprocessor.json`` / ``policy_postprocessor.json`` - ``src/lerobot/processor/pipeline.py``
  (``DataProcessorPipeline._save_pretrained``): ``{"name", "steps": [{"registry_name", "config", "state_file"?}]}``; a
  step with tensors keeps them in ``<pipeline>_step_<i>_<registry_name>.safetensors``.
  ``src/lerobot/processor/normalize_processor.py``: the ``normalizer_processor`` step (preprocessor) and the
  ``unnormalizer_processor`` step (postprocessor) have config ``{"eps", "features", "norm_map"}`` and tensors
  ``<feature>.<stat>`` (``observation.state.mean``, ``action.std``, also min/max/quantiles and image statistics);
  ``MEAN_STD`` is ``(x - mean) / (std + eps)``, as :class:`~embodirl.models.pi0.policy.Pi0Policy` standardises.

The state's statistics come from the preprocessor's normaliser; the actions' from the postprocessor's unnormaliser (what
LeRobot applies to the policy's output), else the normaliser. The layout before these pipelines (normalisation buffers
inside model.safetensors, which ``src/lerobot/processor/migrate_policy_normalization.py`` moves out) belongs to
LeRobot's earlier π0 port, whose config has no ``paligemma_variant`` and whose weights transformers' PI0 does not take:
it is refused with a sentence.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from embodirl.errors import ConfigError
from embodirl.models.pi0.schema import Gemma

log = logging.getLogger(__name__)

PREPROCESSOR_FILE = "policy_preprocessor.json"
POSTPROCESSOR_FILE = "policy_postprocessor.json"
NORMALIZER, UNNORMALIZER, TOKENIZER = "normalizer_processor", "unnormalizer_processor", "tokenizer_processor"
MEAN_STD, IDENTITY = "MEAN_STD", "IDENTITY"
#: the feature keys LeRobot's constants name (OBS_STATE, ACTION), for a normaliser whose config lists no features
STATE_KEY, ACTION_KEY = "observation.state", "action"
#: config.json keys every LeRobot π0 dump carries (draccus writes every field)
REQUIRED = ("paligemma_variant", "action_expert_variant", "chunk_size", "max_state_dim", "max_action_dim",
            "num_inference_steps", "image_resolution")
#: flow-matching numbers copied as they are into transformers' PI0Config (the same names there)
FLOW_KEYS = ("time_sampling_beta_alpha", "time_sampling_beta_beta", "time_sampling_scale", "time_sampling_offset",
             "min_period", "max_period")


def _variant(width: int, depth: int, mlp_dim: int, num_heads: int, num_kv_heads: int, head_dim: int) -> Gemma:
    return Gemma(hidden_size=width, num_hidden_layers=depth, intermediate_size=mlp_dim, num_attention_heads=num_heads,
                 num_key_value_heads=num_kv_heads, head_dim=head_dim)


#: ``get_gemma_config`` of modeling_pi0.py (width, depth, mlp_dim, num_heads, num_kv_heads, head_dim), as the
#: schema's ``model.language`` / ``model.expert`` sizes
GEMMA_VARIANTS = {"gemma_300m": _variant(1024, 18, 4096, 8, 1, 256),
                  "gemma_2b": _variant(2048, 18, 16_384, 8, 1, 256)}
#: what ``PaliGemmaWithExpertModel`` fixes for a VLM of those variants: the vocabulary (and image token id) and the
#: SigLIP so400m/14 tower (PaliGemma's default vision config with intermediate_size 4304)
LEROBOT_VOCAB = 257_152
LEROBOT_VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
                  "patch_size": 14}


@dataclass
class LeRobotCheckpoint:
    """A LeRobot π0 folder, checked without building anything."""

    folder: Path
    config: dict
    weights: list[Path]
    #: PI0Processor's keys (``state_mean``, ``state_std``, ``actions_mean``, ``actions_std``) found in the processors
    statistics: dict[str, list[float]] = field(default_factory=dict)
    #: where each statistic came from, for ``embodirl doctor``
    sources: dict[str, str] = field(default_factory=dict)
    #: the tokenizer the preprocessor's tokenizer step names (LeRobot keeps it out of the folder)
    tokenizer_name: str | None = None

    @property
    def variants(self) -> tuple[str, str]:
        return self.config["paligemma_variant"], self.config["action_expert_variant"]

    def describe(self) -> str:
        c = self.config
        found = ", ".join(f"{k} ({v})" for k, v in self.sources.items()) or "none: identity"
        return (f"{self.folder.name}: LeRobot π0 ({' + '.join(self.variants)}), {len(self.weights)} weight file(s), "
                f"chunk {c['chunk_size']} x {c['max_action_dim']}, state {c['max_state_dim']}, "
                f"{c['num_inference_steps']} denoising steps, {c['image_resolution'][0]} px, statistics: {found}")


def is_lerobot_config(data: Mapping) -> bool:
    """LeRobot's draccus dump names its class with ``type``; transformers' config.json has ``model_type``."""
    return "type" in data and "model_type" not in data


def _error(file: Path, message: str) -> ConfigError:
    return ConfigError("model.path", f"{file} {message}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _positive_int(config: Mapping, key: str, file: Path) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _error(file, f"has {key} = {value!r}; a LeRobot π0 config.json gives a positive integer")
    return value


def _check_config(data: Mapping, file: Path) -> dict:
    """config.json's π0 fields, checked: one sentence naming the file and the key otherwise."""
    if data.get("type") != "pi0":
        raise _error(file, f"describes a LeRobot '{data.get('type')}' policy; embodirl's π0 loads LeRobot type pi0 "
                           "(use the model option of that policy)")
    if "paligemma_variant" not in data:
        raise _error(file, "has no paligemma_variant: it is LeRobot's π0 from before v0.4 (an earlier port, whose "
                           "weight names transformers' PI0 does not map); use one written by LeRobot 0.4 or later, "
                           "such as lerobot/pi0_base")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise _error(file, f"lacks {', '.join(missing)}; write it again with LeRobot's PI0Policy.save_pretrained")
    for key in ("chunk_size", "max_state_dim", "max_action_dim", "num_inference_steps"):
        _positive_int(data, key, file)
    for key in ("paligemma_variant", "action_expert_variant"):
        if not isinstance(data[key], str):
            raise _error(file, f"has {key} = {data[key]!r}; LeRobot names a Gemma variant such as gemma_2b")
    resolution = data["image_resolution"]
    if (not isinstance(resolution, list) or len(resolution) != 2 or not all(isinstance(r, int) for r in resolution)
            or resolution[0] != resolution[1] or resolution[0] < 1):
        raise _error(file, f"has image_resolution {resolution!r}; π0's SigLIP tower takes square images ([224, 224])")
    if data.get("use_relative_actions"):
        raise _error(file, "has use_relative_actions true (actions relative to the state), which embodirl's π0 does "
                           "not undo; use a checkpoint trained on absolute actions")
    for key in FLOW_KEYS:
        if key in data and (isinstance(data[key], bool) or not isinstance(data[key], int | float)):
            raise _error(file, f"has {key} = {data[key]!r}; a LeRobot π0 config.json gives a number")
    if int(data.get("empty_cameras") or 0):
        log.warning("%s: empty_cameras is %s; embodirl feeds the env's cameras only", file, data["empty_cameras"])
    return dict(data)


def _weights(folder: Path) -> list[Path]:
    """``model.safetensors`` (or its shards), each header readable."""
    from safetensors import safe_open

    weights = sorted(folder.glob("model*.safetensors"))
    if not weights:
        raise ConfigError("model.path", f"{folder} holds no model.safetensors; save the LeRobot policy again")
    for file in weights:
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as exc:   # safetensors raises its own error types for a bad header
            raise _error(file, f"is not a safetensors file ({_first_line(exc)}); write it again") from None
    return weights


@dataclass
class _Step:
    pipeline: Path            # the pipeline's JSON
    config: dict
    state_file: Path | None
    tensors: dict

    @property
    def features(self) -> dict:
        return self.config.get("features") or {}

    @property
    def norm_map(self) -> dict:
        return self.config.get("norm_map") or {}


def _pipeline_step(folder: Path, pipeline_file: str, registry_name: str) -> _Step | None:
    """The first step named ``registry_name`` of a saved processor pipeline, with its tensors; None without the file
    or the step."""
    from safetensors.torch import load_file

    path = folder / pipeline_file
    if not path.is_file():
        return None
    try:
        pipeline = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise _error(path, f"is not JSON ({_first_line(exc)}); write it again") from None
    steps = pipeline.get("steps") if isinstance(pipeline, dict) else None
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise _error(path, "has no list of steps; LeRobot's processor pipelines write {\"name\", \"steps\": [...]}")
    step = next((s for s in steps if s.get("registry_name") == registry_name), None)
    if step is None:
        return None
    config = step.get("config") or {}
    if not isinstance(config, dict) or not all(isinstance(config.get(k) or {}, dict) for k in ("features", "norm_map")):
        raise _error(path, f"gives its {registry_name} step a config that is not a mapping of mappings; write it again")
    name = step.get("state_file")
    if name is None:
        return _Step(path, config, None, {})
    state_file = folder / str(name)
    if Path(str(name)).name != str(name) or not state_file.is_file():
        raise _error(path, f"names the statistics file {name!r}, which is not in {folder}; copy the whole checkpoint")
    try:
        tensors = load_file(str(state_file))
    except Exception as exc:   # safetensors raises its own error types for a bad header
        raise _error(state_file, f"is not a safetensors file ({_first_line(exc)}); write it again") from None
    return _Step(path, config, state_file, tensors)


def _feature_key(step: _Step, feature_type: str, fallback: str) -> str:
    keys = [k for k, f in step.features.items() if isinstance(f, dict) and f.get("type") == feature_type]
    return keys[0] if keys else fallback


def _mean_std(step: _Step, feature_type: str, fallback: str, width: int):
    """``(mean, std)`` lists of a ``MEAN_STD`` feature, or None (identity: another mode or no tensors)."""
    import torch

    key = _feature_key(step, feature_type, fallback)
    mode = step.norm_map.get(feature_type, IDENTITY)
    if mode == IDENTITY:
        return None
    if mode != MEAN_STD:
        raise _error(step.pipeline, f"normalises {feature_type} with {mode}; embodirl's π0 standardises with mean and "
                                    "std (model.normalization: mean_std), so it needs a MEAN_STD checkpoint")
    mean, std = step.tensors.get(f"{key}.mean"), step.tensors.get(f"{key}.std")
    if mean is None or std is None:
        return None
    assert step.state_file is not None          # the tensors were read from it
    mean, std = mean.reshape(-1).float(), std.reshape(-1).float()
    if mean.numel() != std.numel() or mean.numel() > width or not bool(torch.isfinite(mean).all() & torch.isfinite(
            std).all()):
        raise _error(step.state_file, f"has {key}.mean/{key}.std of {mean.numel()}/{std.numel()} entries (finite, "
                                      f"equal and at most {width} expected); write it again")
    return mean.tolist(), std.tolist()


def _statistics(folder: Path, config: Mapping) -> tuple[dict, dict]:
    pre = _pipeline_step(folder, PREPROCESSOR_FILE, NORMALIZER)
    post = _pipeline_step(folder, POSTPROCESSOR_FILE, UNNORMALIZER)
    statistics, sources = {}, {}
    wanted = (("state", pre, "STATE", STATE_KEY, config["max_state_dim"]),
              ("actions", post, "ACTION", ACTION_KEY, config["max_action_dim"]),
              ("actions", pre, "ACTION", ACTION_KEY, config["max_action_dim"]))
    for name, step, feature_type, fallback, width in wanted:
        if step is None or f"{name}_mean" in statistics:
            continue
        found = _mean_std(step, feature_type, fallback, width)
        if found is not None:
            statistics[f"{name}_mean"], statistics[f"{name}_std"] = found
            assert step.state_file is not None      # found: tensors, read from it
            sources[name] = step.state_file.name
    for name in ("state", "actions"):
        if name not in sources:
            log.info("%s: no %s mean/std in %s/%s; the %s is not standardised (identity)", folder, name,
                     PREPROCESSOR_FILE, POSTPROCESSOR_FILE, name)
    return statistics, sources


def read(folder: Path, data: Mapping) -> LeRobotCheckpoint:
    """Check a LeRobot π0 folder whose config.json parsed to ``data``: its π0 fields, the weights' headers and the
    processors' statistics. One :class:`ConfigError` sentence naming the file otherwise."""
    config = _check_config(data, folder / "config.json")
    weights = _weights(folder)
    statistics, sources = _statistics(folder, config)
    tokenizer = _pipeline_step(folder, PREPROCESSOR_FILE, TOKENIZER)
    name = tokenizer.config.get("tokenizer_name") if tokenizer is not None else None
    return LeRobotCheckpoint(folder, config, weights, statistics, sources, str(name) if name else None)


def size_fix(checkpoint: LeRobotCheckpoint) -> str:
    """What to do when the weights do not fit the network :func:`network_config` built."""
    unknown = [f"{key} {name!r}" for key, name in zip(("paligemma_variant", "action_expert_variant"),
                                                      checkpoint.variants, strict=True) if name not in GEMMA_VARIANTS]
    if not unknown:
        return "use the checkpoint's own files"
    return (f"{checkpoint.folder / 'config.json'}'s {' and '.join(unknown)} LeRobot does not define, so the model "
            "option's sizes (model.language, model.vision, model.expert) stand in: give the ones of this network")


def _gemma(size: Gemma | None, preset: Gemma) -> dict:
    chosen = size if size is not None else preset
    return {f.name: int(getattr(chosen, f.name)) for f in fields(Gemma)}


def network_config(checkpoint: LeRobotCheckpoint, model):
    """transformers' ``PI0Config`` of the network the folder holds.

    The variants LeRobot defines (gemma_2b, gemma_300m) give their own sizes, and a VLM of them LeRobot's fixed
    vocabulary and SigLIP tower. A variant LeRobot does not define (a network its own PI0Config would refuse, such as a
    CPU-size test network) takes the ``model`` option's sizes (``model.language`` and ``model.vision`` for the VLM,
    ``model.expert``): the weights must then fit them, which loading checks."""
    from transformers import PI0Config

    file = checkpoint.folder / "config.json"
    c = checkpoint.config
    vlm_variant, expert_variant = checkpoint.variants
    vlm_size, expert_size = GEMMA_VARIANTS.get(vlm_variant), GEMMA_VARIANTS.get(expert_variant)
    for key, name, size, preset in (("paligemma_variant", vlm_variant, vlm_size, "model.language / model.vision"),
                                    ("action_expert_variant", expert_variant, expert_size, "model.expert")):
        if size is None:
            log.info("%s: %s %r is not one LeRobot defines (%s); the network takes %s's sizes", file, key, name,
                     ", ".join(GEMMA_VARIANTS), preset)
    text = _gemma(vlm_size, model.language)
    expert = _gemma(expert_size, model.expert)
    if vlm_size is not None:
        text["vocab_size"] = LEROBOT_VOCAB
        vision = dict(LEROBOT_VISION)
    else:
        text["vocab_size"] = int(model.language.vocab_size)
        vision = {k: int(getattr(model.vision, k)) for k in LEROBOT_VISION}
    for key in ("num_hidden_layers", "num_key_value_heads", "head_dim"):
        if text[key] != expert[key]:
            raise _error(file, f"pairs paligemma_variant {vlm_variant} and action_expert_variant {expert_variant}, "
                               f"whose {key} differ ({text[key]} and {expert[key]}); the expert reads the VLM's "
                               "key/value cache layer by layer, so they must agree")
    image_size = int(c["image_resolution"][0])
    if image_size % vision["patch_size"]:
        raise _error(file, f"has image_resolution {c['image_resolution']}, not a multiple of the SigLIP patch size "
                           f"{vision['patch_size']}")
    vlm = {"model_type": "paligemma", "text_config": {"model_type": "gemma", **text},
           "vision_config": {"model_type": "siglip_vision_model", **vision, "image_size": image_size,
                             "vision_use_head": False},
           "projection_dim": text["hidden_size"], "image_token_id": text["vocab_size"]}
    _check_shapes(checkpoint, text, expert)
    flow: dict[str, Any] = {k: float(c[k]) for k in FLOW_KEYS if k in c}    # PI0Config's keyword arguments
    return PI0Config(vlm_config=vlm, dit_config={"model_type": "gemma", **expert}, chunk_size=int(c["chunk_size"]),
                     max_state_dim=int(c["max_state_dim"]), max_action_dim=int(c["max_action_dim"]),
                     num_inference_steps=int(c["num_inference_steps"]), **flow)


def _check_shapes(checkpoint: LeRobotCheckpoint, text: Mapping, expert: Mapping) -> None:
    """The widths config.json implies against the weights' headers, before a network of them is built (a mismatch
    found by loading would first build it, billions of parameters for LeRobot's variants)."""
    from safetensors import safe_open

    c = checkpoint.config
    vlm_variant, expert_variant = checkpoint.variants
    widths = f"action_expert_variant {expert_variant!r}"
    expected = {
        "model.action_out_proj.weight": ([c["max_action_dim"], expert["hidden_size"]], f"max_action_dim and {widths}"),
        "model.action_in_proj.weight": ([expert["hidden_size"], c["max_action_dim"]], f"max_action_dim and {widths}"),
        "model.state_proj.weight": ([expert["hidden_size"], c["max_state_dim"]], f"max_state_dim and {widths}"),
        "model.paligemma_with_expert.paligemma.lm_head.weight": ([text["vocab_size"], text["hidden_size"]],
                                                                 f"paligemma_variant {vlm_variant!r}"),
    }
    for file in checkpoint.weights:
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            for name, (shape, because) in expected.items():
                # PI0Policy saves under its ``model`` attribute; checkpoints converted from openpi lack that prefix
                key = name if name in keys else name.removeprefix("model.")
                if key in keys and list(f.get_slice(key).get_shape()) != shape:
                    found = list(f.get_slice(key).get_shape())
                    raise _error(file, f"holds {key} of shape {found}, but config.json's {because} make {shape}; "
                                       "the config and the weights describe different networks")
