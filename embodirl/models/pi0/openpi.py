"""What π0 takes from openpi (Physical-Intelligence/openpi @ 15a9616a), written from its code: images resized with
padding (:func:`resize_with_pad`), prompts cleaned before tokenising (:func:`clean_prompt`), and the parameters kept in
float32 when the rest runs in bfloat16 (:data:`FP32_PARAMETERS`, :func:`keep_fp32_`, :func:`fp32_on_load`).
``tests/models/test_pi0_preprocessing.py`` checks each against values derived from openpi's algorithms."""

from __future__ import annotations

import contextlib
import functools
import re

import torch
import torch.nn.functional as F
from transformers import PI0ForConditionalGeneration

#: the parameters openpi keeps in float32 when π0 runs in bfloat16: SigLIP's patch embedding (weight and bias) and
#: position embedding, and every Gemma RMSNorm weight (each layer's input and post-attention norm and the final norm,
#: of the VLM and of the action expert) - openpi's ``PaliGemmaWithExpertModel.to_bfloat16_for_selected_params``
#: (Physical-Intelligence/openpi src/openpi/models_pytorch/gemma_pytorch.py @ 15a9616a), which RLinf's π0 calls
#: (rlinf/models/embodiment/openpi/__init__.py @ 558aeb38). Regular expressions over PI0ForConditionalGeneration's
#: parameter names
FP32_PARAMETERS = (r"vision_tower\.embeddings\.patch_embedding\.", r"vision_tower\.embeddings\.position_embedding\.",
                   r"\.input_layernorm\.", r"\.post_attention_layernorm\.", r"(language_model|dit)\.norm\.")


def clean_prompt(text: str) -> str:
    """An instruction as openpi cleans it before tokenising: surrounding whitespace stripped, underscores and newlines
    as spaces (``PaligemmaTokenizer.tokenize``, Physical-Intelligence/openpi src/openpi/models/tokenizer.py @
    15a9616a). LIBERO's task names (``pick_up_the_black_bowl``) read as words."""
    return text.strip().replace("_", " ").replace("\n", " ")


def resize_with_pad(images: torch.Tensor, size: int) -> torch.Tensor:
    """Float images with values in [0, 255], ``[N, 3, h, w]`` -> ``[N, 3, size, size]``, as openpi's ``ResizeImages``
    transform resizes uint8 camera images for π0 (Physical-Intelligence/openpi src/openpi/transforms.py with
    packages/openpi-client/src/openpi_client/image_tools.py ``resize_with_pad``, PIL bilinear; the JAX
    src/openpi/shared/image_tools.py ``resize_with_pad`` is the same map) @ 15a9616a: one scale for both sides so that
    the longer one fits (``ratio = max(w / size, h / size)``, sides ``int(side / ratio)``), bilinear interpolation
    with the kernel widened by the scale when shrinking (PIL's and ``jax.image.resize``'s antialiasing), rounded to
    whole levels, and placed on black (0) with ``(size - side) // 2`` pixels before it (the odd one after). An image
    of the size already is returned as it is, as openpi returns it. PIL rounds between its horizontal and vertical
    passes, this once at the end (as the JAX version): a pixel may differ by one level."""
    h, w = images.shape[-2:]
    if (h, w) == (size, size):
        return images
    ratio = max(w / size, h / size)
    rh, rw = int(h / ratio), int(w / ratio)
    resized = F.interpolate(images, size=(rh, rw), mode="bilinear", antialias=True, align_corners=False)
    resized = resized.round().clamp(0.0, 255.0)
    top, left = (size - rh) // 2, (size - rw) // 2
    return F.pad(resized, (left, size - rw - left, top, size - rh - top), value=0.0)


@contextlib.contextmanager
def fp32_on_load():
    """``PI0ForConditionalGeneration.from_pretrained`` inside loads :data:`FP32_PARAMETERS` in float32 when the rest
    loads in a lower precision, so a checkpoint's float32 values of them stay as stored: transformers reads
    ``_keep_in_fp32_modules_strict`` from the class it loads, set here for the call only (a subclass would lose the
    weight renaming LeRobot's layout needs, which transformers applies to its own classes only)."""
    cls = PI0ForConditionalGeneration
    own = "_keep_in_fp32_modules_strict" in cls.__dict__
    saved = cls.__dict__.get("_keep_in_fp32_modules_strict")
    cls._keep_in_fp32_modules_strict = list(FP32_PARAMETERS)
    try:
        yield
    finally:
        if own:
            cls._keep_in_fp32_modules_strict = saved
        else:
            del cls._keep_in_fp32_modules_strict


def keep_fp32_(network) -> None:
    """:data:`FP32_PARAMETERS` in float32 whatever the network's dtype, and SigLIP's embeddings handed to its (lower
    precision) encoder in the encoder's dtype, as openpi's SigLIP does (its ``modeling_siglip.py`` replacement casts
    the embeddings to bfloat16 when the encoder is bfloat16)."""
    pattern = re.compile("|".join(FP32_PARAMETERS))
    for name, param in network.named_parameters():
        if pattern.search(name) and param.dtype != torch.float32:
            param.data = param.data.float()
    vision = network.model.vlm.vision_tower
    encoder_dtype = vision.encoder.layers[0].self_attn.q_proj.weight.dtype
    hooked = any(getattr(h, "func", None) is _to_dtype for h in vision.embeddings._forward_hooks.values())
    if encoder_dtype != torch.float32 and not hooked:
        vision.embeddings.register_forward_hook(functools.partial(_to_dtype, dtype=encoder_dtype))


def _to_dtype(module, args, output, *, dtype):
    return output.to(dtype)
