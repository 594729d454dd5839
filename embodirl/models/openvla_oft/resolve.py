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

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from embodirl import data as D
from embodirl.config_fields import instance
from embodirl.errors import ConfigError
from embodirl.models.action_tokenizer import LLAMA_BASE_VOCAB_SIZE
from embodirl.models.normalization import BOUNDS_KEYS
from embodirl.models.openvla_oft.schema import Lora, OpenVLAOFTConfig, VisionTower
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
class OFTConfig:
    """Everything the model, the processor and the checkpoint I/O need (see module docstring): ``model``, the typed
    ``model`` section itself, and the values this module resolves from it - its nulls filled from the env and the
    checkpoint, the dtype and attention kernel chosen. Nothing of the section is copied here."""

    model: OpenVLAOFTConfig
    action_dim: int
    num_images_in_input: int
    use_proprio: bool
    proprio_dim: int
    use_l1_regression: bool
    unnorm_key: str | None
    dtype: torch.dtype
    attn_implementation: str

    # --- derived sizes ---------------------------------------------------------------------------
    @property
    def tokens_per_decision(self) -> int:
        """L = H * A action tokens per decision."""
        return self.model.action_chunk * self.action_dim

    @property
    def patches_per_image(self) -> int:
        return (self.model.image_size // self.model.vision.dino.patch_size) ** 2

    @property
    def vision_dim(self) -> int:
        return self.model.vision.dino.hidden_size + self.model.vision.siglip.hidden_size

    @property
    def llm_dim(self) -> int:
        return self.model.llm.hidden_size

    # --- transformers configs ------------------------------------------------------------------
    def dino_config(self):
        from transformers import Dinov2WithRegistersConfig

        d = self.model.vision.dino
        return Dinov2WithRegistersConfig(
            hidden_size=d.hidden_size, num_hidden_layers=d.num_hidden_layers,
            num_attention_heads=d.num_attention_heads, mlp_ratio=d.intermediate_size // d.hidden_size,
            patch_size=d.patch_size, image_size=self.model.image_size, num_register_tokens=DINO_REGISTER_TOKENS,
            layerscale_value=DINO_LAYERSCALE_INIT, layer_norm_eps=VISION_LAYER_NORM_EPS, hidden_act="gelu",
            qkv_bias=True, attn_implementation=self.vision_attn_implementation)

    def siglip_config(self):
        from transformers import SiglipVisionConfig

        s = self.model.vision.siglip
        return SiglipVisionConfig(
            hidden_size=s.hidden_size, num_hidden_layers=s.num_hidden_layers,
            num_attention_heads=s.num_attention_heads, intermediate_size=s.intermediate_size,
            patch_size=s.patch_size, image_size=self.model.image_size, layer_norm_eps=VISION_LAYER_NORM_EPS,
            hidden_act=SIGLIP_HIDDEN_ACT, vision_use_head=True,
            attn_implementation=self.vision_attn_implementation)

    def llama_config(self):
        from transformers import LlamaConfig

        llm = dataclasses.asdict(self.model.llm)
        rope_theta = llm.pop("rope_theta")
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
def _check_tower(tower: VisionTower, key: str) -> None:
    if tower.hidden_size % tower.num_attention_heads:
        raise ConfigError(f"{key}.hidden_size", f"{tower.hidden_size} is not divisible by "
                                                f"num_attention_heads={tower.num_attention_heads}")
    if tower.num_hidden_layers < 2:
        raise ConfigError(f"{key}.num_hidden_layers", "needs at least 2 (features come from the second-to-last block)")


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


def _check_lora(lora: Lora) -> None:
    unknown = set(lora.modules_to_save) - set(TRAINABLE_HEADS)
    if unknown:
        raise ConfigError("model.lora.modules_to_save", f"unknown modules {sorted(unknown)}; choose among "
                                                        f"{', '.join(TRAINABLE_HEADS)}")


def build_config(cfg, env_spec=None) -> OFTConfig:
    """Resolve the ``model`` section (the typed :class:`OpenVLAOFTConfig`, or a DictConfig or plain mapping of it,
    converted here once) against ``env_spec`` (None: checks only). With a checkpoint in ``path``, pass what
    :func:`.autoconfig.configure` returns (the keys the checkpoint decides filled in); this module does not import
    the checkpoint readers, which import it."""
    model = instance(OpenVLAOFTConfig, cfg, "model")
    action_dim, num_images = model.action_dim, model.num_images_in_input
    use_proprio, proprio_dim, unnorm_key = model.use_proprio, model.proprio_dim, model.unnorm_key
    if env_spec is not None:
        cameras = len(env_spec.camera_names)
        if action_dim is None:
            action_dim = env_spec.action_dim
        elif action_dim != env_spec.action_dim:
            raise ConfigError("model.action_dim", f"is {action_dim} but env '{env_spec.name}' takes "
                                                  f"{env_spec.action_dim}-D actions; set it to null or {env_spec.action_dim}")
        if num_images is None:
            num_images = min(cameras, MAX_IMAGES_IN_INPUT)
        elif num_images > cameras:
            raise ConfigError("model.num_images_in_input", f"is {num_images} but env '{env_spec.name}' renders "
                                                           f"{cameras} camera(s) {env_spec.camera_names}")
        if use_proprio is None:
            use_proprio = env_spec.state_dim > 0
        if proprio_dim is None:
            proprio_dim = env_spec.state_dim
        if use_proprio and proprio_dim != env_spec.state_dim:
            raise ConfigError("model.proprio_dim", f"is {proprio_dim} but env '{env_spec.name}' has a "
                                                   f"{env_spec.state_dim}-D state; set it to null or use_proprio: false")
        if unnorm_key is None and env_spec.name:
            unnorm_key = env_spec.name
    # checks-only mode: unresolved nulls get placeholders that pass the checks below
    action_dim = action_dim if action_dim is not None else 1
    num_images = num_images if num_images is not None else 1
    use_proprio = bool(use_proprio)
    proprio_dim = proprio_dim if proprio_dim is not None else int(use_proprio)

    if model.value_type not in VALUE_TYPES:
        raise ConfigError("model.value_type", f"'{model.value_type}' is not one of {', '.join(VALUE_TYPES)}")
    if not 1 <= num_images <= MAX_IMAGES_IN_INPUT:
        raise ConfigError("model.num_images_in_input", f"must be 1 or 2, got {num_images}")
    if use_proprio and proprio_dim <= 0:
        raise ConfigError("model.proprio_dim", "must be positive when use_proprio is true")
    if model.dtype not in DTYPES:
        raise ConfigError("model.dtype", f"'{model.dtype}' is not one of {', '.join(DTYPES)}")
    if model.normalization not in BOUNDS_KEYS:
        raise ConfigError("model.normalization", f"'{model.normalization}' is not one of {', '.join(BOUNDS_KEYS)}")

    dino, siglip = model.vision.dino, model.vision.siglip
    _check_tower(dino, "model.vision.dino")
    _check_tower(siglip, "model.vision.siglip")
    for name, tower in (("dino", dino), ("siglip", siglip)):
        if model.image_size % tower.patch_size:
            raise ConfigError("model.image_size", f"{model.image_size} is not a multiple of the {name} patch size "
                                                  f"{tower.patch_size}")
    if dino.patch_size != siglip.patch_size:
        raise ConfigError("model.vision", "both towers must use one patch size (their patches are concatenated)")
    if dino.intermediate_size % dino.hidden_size:
        raise ConfigError("model.vision.dino.intermediate_size", "must be a multiple of hidden_size "
                                                                 "(DINOv2's MLP is sized by a ratio)")
    llm = model.llm
    if llm.vocab_size <= LLAMA_PAD_ID:
        raise ConfigError("model.llm.vocab_size", f"must exceed {LLAMA_PAD_ID} (Llama-2's {LLAMA_BASE_VOCAB_SIZE} "
                                                  f"ids plus OpenVLA's pad token), got {llm.vocab_size}")
    if llm.hidden_size % llm.num_attention_heads:
        raise ConfigError("model.llm.hidden_size", "is not divisible by num_attention_heads")
    if not 2 <= model.num_bins <= LLAMA_BASE_VOCAB_SIZE:
        raise ConfigError("model.num_bins", f"must lie in [2, {LLAMA_BASE_VOCAB_SIZE}], got {model.num_bins}")
    _check_lora(model.lora)
    return OFTConfig(model=model, action_dim=action_dim, num_images_in_input=num_images, use_proprio=use_proprio,
                     proprio_dim=proprio_dim, use_l1_regression=bool(model.use_l1_regression), unnorm_key=unnorm_key,
                     dtype=DTYPES[model.dtype], attn_implementation=resolve_attn_implementation(model.attn_implementation))


def load_preset(name: str, config_dir: str | Path | None = None) -> dict:
    """A model preset (``config/model/<name>.yaml``) as the plain ``model`` dict Hydra composes from it -
    enough for scripts and tests that do not go through Hydra. The ``defaults`` list is resolved (options
    of this group merged first, ``_self_`` last). A recipe written in the global package (``openvla_oft``:
    ``# @package _global_``) contributes its ``model`` node; its choices of other groups (``override
    /algorithm: ...``) and its keys outside ``model`` are not part of the model and are left out."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    from embodirl.paths import config_dir as default_config_dir

    group = Path(config_dir or default_config_dir()) / PRESETS_GROUP

    def load(preset: str):
        path = group / f"{preset}.yaml"
        node = OmegaConf.load(path)
        assert isinstance(node, DictConfig)     # a preset file is a mapping (of keys and its defaults list)
        defaults = node.pop("defaults", None) or []
        own = node.get(PRESETS_GROUP, OmegaConf.create({})) if _global_package(path) else node
        merged: DictConfig | ListConfig = OmegaConf.create({})
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
