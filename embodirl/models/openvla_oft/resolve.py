"""The OpenVLA-OFT model configuration: the ``model`` config group resolved against the environment.

``config/model/_openvla_oft_base.yaml`` holds every default of the network (``openvla_oft`` adds the GPU recipe,
``openvla_oft_tiny`` shrinks it); this module only reads, checks and derives.
Architecture sizes come from the YAML (a checkpoint must match them: a mismatching parameter shape is
reported by name when it loads). With a checkpoint (``path``), the keys it determines - the L1 head, the
proprio token, the image count - come from its files (:mod:`.autoconfig`). Keys still ``null`` take the
environment's value:

* ``action_dim`` -> ``env_spec.action_dim``;
* ``num_images_in_input`` -> the number of cameras;
* ``use_proprio`` -> whether the env has a state vector, ``proprio_dim`` -> ``env_spec.state_dim``;
* ``unnorm_key`` -> ``env_spec.name`` (the suite name, e.g. ``libero_10``).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from embodirl import data as D
from embodirl.errors import ConfigError
from embodirl.models.action_tokenizer import LLAMA_BASE_VOCAB_SIZE
from embodirl.models.normalization import BOUNDS_KEYS
from embodirl.models.processor import LLAMA_BOS_ID, LLAMA_PAD_ID, LLAMA_STOP_ID

log = logging.getLogger(__name__)

VALUE_TYPES = D.REWARD_TYPES        # one value per chunk or per action
#: heads that ``lora.modules_to_save`` can make fully trainable (the L1 action head: for ``embodirl sft``'s sft.l1_head)
TRAINABLE_HEADS = ("value_head", "proprio_projector", "action_head")
ATTN_IMPLEMENTATIONS = ("auto", "eager", "sdpa", "flash_attention_2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_IMAGES_IN_INPUT = 2  # agentview + wrist, sharing the towers and the projector (OFT)
#: timm's DINOv2 ViT-L/14 with 4 registers: the Prismatic "dinov2" tower
DINO_REGISTER_TOKENS = 4
#: LayerScale init of timm's DINOv2 (``init_values=1e-5``); only used for random initialisation
DINO_LAYERSCALE_INIT = 1e-5
VISION_LAYER_NORM_EPS = 1e-6
#: exact (erf) GELU. OpenVLA's SigLIP tower is timm's ``vit_so400m_patch14_siglip_224``, whose model args set no
#: ``act_layer``, so timm's VisionTransformer falls back to ``nn.GELU`` (exact); Prismatic's
#: ``timm_override_act_layers`` is ``[None, None]``. transformers' SiglipVisionConfig defaults to the tanh
#: approximation of Google's original SigLIP, which is not what OpenVLA was trained with.
SIGLIP_HIDDEN_ACT = "gelu"
PRESETS_GROUP = "model"


@dataclass(frozen=True)
class TowerSizes:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int


@dataclass(frozen=True)
class LoraSettings:
    enabled: bool
    rank: int
    alpha: float
    dropout: float
    target_modules: str | tuple[str, ...]   # "all-linear" or module names (see lora.py)
    modules_to_save: tuple[str, ...]        # fully trainable heads


@dataclass(frozen=True)
class OFTConfig:
    """Everything the model, the processor and the checkpoint I/O need (see module docstring)."""

    action_dim: int
    action_chunk: int
    num_bins: int
    num_images_in_input: int
    use_proprio: bool
    proprio_dim: int
    use_l1_regression: bool
    value_type: str
    value_head_hidden_sizes: tuple[int, ...]
    center_crop: bool
    image_size: int
    dtype: torch.dtype
    attn_implementation: str
    gradient_checkpointing: bool
    path: str | None
    unnorm_key: str | None
    normalization: str
    dino: TowerSizes
    siglip: TowerSizes
    llm: Mapping
    lora: LoraSettings

    # --- derived sizes ---------------------------------------------------------------------------
    @property
    def tokens_per_decision(self) -> int:
        """L = H * A action tokens per decision."""
        return self.action_chunk * self.action_dim

    @property
    def patches_per_image(self) -> int:
        return (self.image_size // self.dino.patch_size) ** 2

    @property
    def vision_dim(self) -> int:
        return self.dino.hidden_size + self.siglip.hidden_size

    @property
    def llm_dim(self) -> int:
        return int(self.llm["hidden_size"])

    # --- transformers configs ------------------------------------------------------------------
    def dino_config(self):
        from transformers import Dinov2WithRegistersConfig

        d = self.dino
        return Dinov2WithRegistersConfig(
            hidden_size=d.hidden_size, num_hidden_layers=d.num_hidden_layers,
            num_attention_heads=d.num_attention_heads, mlp_ratio=d.intermediate_size // d.hidden_size,
            patch_size=d.patch_size, image_size=self.image_size, num_register_tokens=DINO_REGISTER_TOKENS,
            layerscale_value=DINO_LAYERSCALE_INIT, layer_norm_eps=VISION_LAYER_NORM_EPS, hidden_act="gelu",
            qkv_bias=True, attn_implementation=self.vision_attn_implementation)

    def siglip_config(self):
        from transformers import SiglipVisionConfig

        s = self.siglip
        return SiglipVisionConfig(
            hidden_size=s.hidden_size, num_hidden_layers=s.num_hidden_layers,
            num_attention_heads=s.num_attention_heads, intermediate_size=s.intermediate_size,
            patch_size=s.patch_size, image_size=self.image_size, layer_norm_eps=VISION_LAYER_NORM_EPS,
            hidden_act=SIGLIP_HIDDEN_ACT, vision_use_head=True,
            attn_implementation=self.vision_attn_implementation)

    def llama_config(self):
        from transformers import LlamaConfig

        llm = dict(self.llm)
        rope_theta = float(llm.pop("rope_theta"))
        cfg = LlamaConfig(
            **llm, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
            bos_token_id=LLAMA_BOS_ID, eos_token_id=LLAMA_STOP_ID, pad_token_id=LLAMA_PAD_ID,
            tie_word_embeddings=False, attn_implementation=self.attn_implementation)
        # OFT's parallel decoding runs the decoder with full bidirectional attention over the whole
        # sequence (openvla-oft's transformers fork sets is_causal=False); transformers builds a
        # bidirectional padding mask when the config says so (see modeling.py for the layers' flag).
        cfg.is_causal = False
        return cfg

    @property
    def vision_attn_implementation(self) -> str:
        return self.attn_implementation


# --- construction from the config group ---------------------------------------------------------
def _tower(raw: Mapping, key: str) -> TowerSizes:
    try:
        sizes = TowerSizes(**{k: int(raw[k]) for k in TowerSizes.__dataclass_fields__})
    except (KeyError, TypeError) as exc:
        raise ConfigError(key, f"needs integer keys {', '.join(TowerSizes.__dataclass_fields__)} ({exc})") from None
    if sizes.hidden_size % sizes.num_attention_heads:
        raise ConfigError(f"{key}.hidden_size", f"{sizes.hidden_size} is not divisible by "
                                                f"num_attention_heads={sizes.num_attention_heads}")
    if sizes.num_hidden_layers < 2:
        raise ConfigError(f"{key}.num_hidden_layers", "needs at least 2 (features come from the second-to-last block)")
    return sizes


def resolve_attn_implementation(requested: str) -> str:
    """``auto``: FlashAttention-2 when the package is installed and a GPU is present, else SDPA."""
    if requested not in ATTN_IMPLEMENTATIONS:
        raise ConfigError("model.attn_implementation", f"'{requested}' is not one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    have_flash = importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()
    if requested == "auto":
        return "flash_attention_2" if have_flash else "sdpa"
    if requested == "flash_attention_2" and not have_flash:
        raise ConfigError("model.attn_implementation", "flash_attention_2 needs the flash-attn package and a CUDA "
                                                       "GPU; use auto or sdpa")
    return requested


def _lora(raw: Mapping) -> LoraSettings:
    missing = [k for k in LoraSettings.__dataclass_fields__ if k not in raw]
    if missing:
        raise ConfigError("model.lora", f"is missing {', '.join(missing)}")
    targets = raw["target_modules"]
    if not isinstance(targets, str):
        targets = tuple(str(t) for t in targets)
    settings = LoraSettings(enabled=bool(raw["enabled"]), rank=int(raw["rank"]), alpha=float(raw["alpha"]),
                            dropout=float(raw["dropout"]), target_modules=targets,
                            modules_to_save=tuple(raw["modules_to_save"] or ()))
    if settings.enabled and settings.rank <= 0:
        raise ConfigError("model.lora.rank", f"must be positive, got {settings.rank}")
    unknown = set(settings.modules_to_save) - set(TRAINABLE_HEADS)
    if unknown:
        raise ConfigError("model.lora.modules_to_save", f"unknown modules {sorted(unknown)}; choose among "
                                                        f"{', '.join(TRAINABLE_HEADS)}")
    return settings


def build_config(cfg: Mapping, env_spec=None) -> OFTConfig:
    """Resolve the model config group (a plain mapping) against ``env_spec`` (None: checks only). With a
    checkpoint in ``path``, pass the mapping :func:`.autoconfig.configure` returns (the keys the checkpoint
    decides filled in); this module does not import the checkpoint readers, which import it."""
    cfg = dict(cfg)
    def need(key):
        if key not in cfg:
            raise ConfigError(f"model.{key}", "is missing from the model config")
        return cfg[key]

    action_dim = cfg.get("action_dim")
    num_images = cfg.get("num_images_in_input")
    use_proprio = cfg.get("use_proprio")
    proprio_dim = cfg.get("proprio_dim")
    unnorm_key = cfg.get("unnorm_key")
    if env_spec is not None:
        cameras = len(env_spec.camera_names)
        if action_dim is None:
            action_dim = env_spec.action_dim
        elif int(action_dim) != env_spec.action_dim:
            raise ConfigError("model.action_dim", f"is {action_dim} but env '{env_spec.name}' takes "
                                                  f"{env_spec.action_dim}-D actions; set it to null or {env_spec.action_dim}")
        if num_images is None:
            num_images = min(cameras, MAX_IMAGES_IN_INPUT)
        elif int(num_images) > cameras:
            raise ConfigError("model.num_images_in_input", f"is {num_images} but env '{env_spec.name}' renders "
                                                           f"{cameras} camera(s) {env_spec.camera_names}")
        if use_proprio is None:
            use_proprio = env_spec.state_dim > 0
        if proprio_dim is None:
            proprio_dim = env_spec.state_dim
        if use_proprio and int(proprio_dim) != env_spec.state_dim:
            raise ConfigError("model.proprio_dim", f"is {proprio_dim} but env '{env_spec.name}' has a "
                                                   f"{env_spec.state_dim}-D state; set it to null or use_proprio: false")
        if unnorm_key is None and env_spec.name:
            unnorm_key = env_spec.name
    # checks-only mode: unresolved nulls get placeholders that pass the checks below
    action_dim = int(action_dim if action_dim is not None else 1)
    num_images = int(num_images if num_images is not None else 1)
    use_proprio = bool(use_proprio) if use_proprio is not None else False
    proprio_dim = int(proprio_dim if proprio_dim is not None else int(use_proprio))

    value_type = str(need("value_type"))
    if value_type not in VALUE_TYPES:
        raise ConfigError("model.value_type", f"'{value_type}' is not one of {', '.join(VALUE_TYPES)}")
    if not 1 <= num_images <= MAX_IMAGES_IN_INPUT:
        raise ConfigError("model.num_images_in_input", f"must be 1 or 2, got {num_images}")
    if use_proprio and proprio_dim <= 0:
        raise ConfigError("model.proprio_dim", "must be positive when use_proprio is true")
    dtype_name = str(need("dtype"))
    if dtype_name not in DTYPES:
        raise ConfigError("model.dtype", f"'{dtype_name}' is not one of {', '.join(DTYPES)}")
    normalization = str(need("normalization"))
    if normalization not in BOUNDS_KEYS:
        raise ConfigError("model.normalization", f"'{normalization}' is not one of {', '.join(BOUNDS_KEYS)}")

    vision = need("vision")
    dino, siglip = _tower(vision["dino"], "model.vision.dino"), _tower(vision["siglip"], "model.vision.siglip")
    image_size = int(need("image_size"))
    for name, tower in (("dino", dino), ("siglip", siglip)):
        if image_size % tower.patch_size:
            raise ConfigError("model.image_size", f"{image_size} is not a multiple of the {name} patch size "
                                                  f"{tower.patch_size}")
    if dino.patch_size != siglip.patch_size:
        raise ConfigError("model.vision", "both towers must use one patch size (their patches are concatenated)")
    if dino.intermediate_size % dino.hidden_size:
        raise ConfigError("model.vision.dino.intermediate_size", "must be a multiple of hidden_size "
                                                                 "(DINOv2's MLP is sized by a ratio)")

    llm = dict(need("llm"))
    vocab = int(llm.get("vocab_size", 0))
    if vocab <= LLAMA_PAD_ID:
        raise ConfigError("model.llm.vocab_size", f"must exceed {LLAMA_PAD_ID} (Llama-2's {LLAMA_BASE_VOCAB_SIZE} "
                                                  f"ids plus OpenVLA's pad token), got {vocab}")
    if int(llm["hidden_size"]) % int(llm["num_attention_heads"]):
        raise ConfigError("model.llm.hidden_size", "is not divisible by num_attention_heads")
    for key in ("rms_norm_eps", "rope_theta"):
        if key not in llm:
            raise ConfigError(f"model.llm.{key}", "is missing from the model config")

    num_bins = int(need("num_bins"))
    if not 2 <= num_bins <= LLAMA_BASE_VOCAB_SIZE:
        raise ConfigError("model.num_bins", f"must lie in [2, {LLAMA_BASE_VOCAB_SIZE}], got {num_bins}")
    head = need("value_head")
    if "hidden_sizes" not in head:
        raise ConfigError("model.value_head.hidden_sizes", "is missing from the model config")
    return OFTConfig(
        action_dim=action_dim, action_chunk=int(need("action_chunk")), num_bins=num_bins,
        num_images_in_input=num_images, use_proprio=use_proprio, proprio_dim=proprio_dim,
        use_l1_regression=bool(need("use_l1_regression")), value_type=value_type,
        value_head_hidden_sizes=tuple(int(h) for h in head["hidden_sizes"]),
        center_crop=bool(need("center_crop")), image_size=image_size, dtype=DTYPES[dtype_name],
        attn_implementation=resolve_attn_implementation(str(need("attn_implementation"))),
        gradient_checkpointing=bool(need("gradient_checkpointing")),
        path=cfg.get("path"), unnorm_key=unnorm_key, normalization=normalization,
        dino=dino, siglip=siglip, llm=llm, lora=_lora(need("lora")))


def load_preset(name: str, config_dir: str | Path | None = None) -> dict:
    """A model preset (``config/model/<name>.yaml``) as the plain ``model`` dict Hydra composes from it -
    enough for scripts and tests that do not go through Hydra. The ``defaults`` list is resolved (options
    of this group merged first, ``_self_`` last). A recipe written in the global package (``openvla_oft``:
    ``# @package _global_``) contributes its ``model`` node; its choices of other groups (``override
    /algorithm: ...``) and its keys outside ``model`` are not part of the model and are left out."""
    from omegaconf import DictConfig, OmegaConf

    from embodirl.paths import config_dir as default_config_dir

    group = Path(config_dir or default_config_dir()) / PRESETS_GROUP

    def load(preset: str):
        path = group / f"{preset}.yaml"
        node = OmegaConf.load(path)
        defaults = node.pop("defaults", None) or []
        own = node.get(PRESETS_GROUP, OmegaConf.create({})) if _global_package(path) else node
        merged = OmegaConf.create({})
        self_seen = False
        for entry in defaults:
            if entry == "_self_":
                merged, self_seen = OmegaConf.merge(merged, own), True
            elif not isinstance(entry, DictConfig):  # `other@_here_` (or `other@model` from the global package)
                merged = OmegaConf.merge(merged, load(str(entry).split("@", 1)[0]))
        return merged if self_seen else OmegaConf.merge(merged, own)

    return OmegaConf.to_container(load(name), resolve=True)  # type: ignore[return-value]


def _global_package(path: Path) -> bool:
    """Whether the YAML file's header comment declares Hydra's ``# @package _global_``."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            return False
        if line[1:].split() == ["@package", "_global_"]:
            return True
    return False
