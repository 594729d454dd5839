"""OpenVLA-OFT's input processing, batched on tensors: camera images -> fused-tower pixels, instructions -> prompt ids.

Images follow OFT's LIBERO evaluation (``experiments/robot/openvla_utils.py`` of openvla-oft) and the
Prismatic image processor of the checkpoint:

1. when the camera renders another size than ``image_size``: OFT's ``resize_image_for_policy``, the scheme of
   its RLDS training data - a JPEG round trip at ``tf.image.encode_jpeg``'s default quality (Pillow's
   libjpeg-turbo, the same codec TensorFlow bundles), then TF's antialiased ``lanczos3`` resize
   (:func:`tf_lanczos3_resize`, TF's ``scale_and_translate`` kernel re-derived as two weight matrices), then
   round-half-even and clip to uint8 levels. ``tests/models/test_image_pipeline.py`` holds this to
   TensorFlow's own output (``scripts/make_image_goldens.py``) within one uint8 level;
2. optionally the "90 % area" centre crop of models trained with random-crop augmentation: TF
   ``crop_and_resize`` (bilinear, box corners on pixel centres) of the central ``sqrt(0.9)`` square back to
   ``image_size``, then TF's float->uint8 conversion (``x * 255.5`` truncated);
3. per-tower normalisation (DINOv2: ImageNet mean/std; SigLIP: 0.5/0.5) stacked on the channel axis,
   6 channels per image, images (agentview, then wrist) concatenated on the channel axis.

Prompts are OFT's ``In: What action should the robot take to {instruction.lower()}?\\nOut:``; the
ids always end with Llama-2's empty piece ``"▁"`` (29871), which OFT appends when the tokenizer does
not produce it, because the training sequences had it before the first action token. Checkpoints
bring their own tokenizer (``tokenizer.json``); a randomly initialised policy has no vocabulary to
match and uses :class:`HashWordTokenizer`, one id per word or punctuation mark (about as many tokens as
Llama-2's tokenizer produces, which keeps the tiny preset's sequences realistic in length).
"""

from __future__ import annotations

import functools
import io
import math
import re
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# --- Llama-2 special ids (OpenVLA's prompt and sequence layout) --------------------------------
LLAMA_BOS_ID = 1
LLAMA_STOP_ID = 2             # "</s>": OFT appends it after the action slots
LLAMA_EMPTY_PIECE_ID = 29871  # "▁": the piece between "Out:" and the first action token
LLAMA_PAD_ID = 32000          # OpenVLA's added "<PAD>" token
#: ids the hashing tokenizer may use: above Llama-2's special and byte-fallback ids ("<0xFF>" is 258),
#: below the action ids (the last 256 of the 32000)
HASH_ID_LOW, HASH_ID_HIGH = 259, 31744
PROMPT_TEMPLATE = "In: What action should the robot take to {instruction}?\nOut:"

# --- image constants -----------------------------------------------------------------------------
#: DINOv2 (timm ``vit_large_patch14_reg4_dinov2``) and SigLIP (``vit_so400m_patch14_siglip_224``) data configs
DINO_MEAN, DINO_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIGLIP_MEAN, SIGLIP_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
RGB_CHANNELS = 3
TOWERS = 2
CHANNELS_PER_IMAGE = RGB_CHANNELS * TOWERS
#: OFT evaluation crops the central 90 % of the image area (side sqrt(0.9)) for augmentation-trained models
CENTER_CROP_AREA = 0.9
UINT8_MAX = 255.0
#: TF ``convert_image_dtype`` float -> uint8 scales by ``max + 0.5`` before truncating
TF_FLOAT_TO_UINT8_SCALE = UINT8_MAX + 0.5
PROMPT_CACHE_SIZE = 4096
#: a JPEG round trip takes ~1 ms per image: fewer images than this per thread are not worth a thread
JPEG_IMAGES_PER_THREAD = 4
#: ``tf.image.encode_jpeg``'s default quality: OFT's resize_image_for_policy and its RLDS builder encode with it
OFT_JPEG_QUALITY = 95
LANCZOS3_RADIUS = 3.0
#: the value of pi in TF's LanczosKernelFunc (a float literal rounded to float32)
TF_PI = 3.14159265359


def _as_uint8_tensor(images) -> torch.Tensor:
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(np.ascontiguousarray(images))
    if images.dtype != torch.uint8:
        raise TypeError(f"images must be uint8, got {images.dtype}")
    return images


def jpeg_round_trip(images: torch.Tensor, quality: int = OFT_JPEG_QUALITY) -> torch.Tensor:
    """Encode and decode each uint8 image ``(N, 3, h, w)`` as TensorFlow does; returns uint8 ``(N, 3, h, w)``
    on the CPU (the codec runs there; callers keep this step on the CPU side, before the batch moves).
    Images are coded in parallel on up to ``torch.get_num_threads()`` threads (the codecs release the GIL).

    ``tf.image.encode_jpeg`` writes baseline JPEG with 4:2:0 chroma and the accurate integer DCT, which is
    what Pillow's encoder writes (same libjpeg-turbo coefficients); ``tf.io.decode_image`` decodes with
    libjpeg's *fast* integer IDCT (its ``dct_method`` default) and fancy upsampling, which Pillow cannot
    select, so simplejpeg (libjpeg-turbo with ``fastdct``) decodes. Each choice was checked against TF."""
    import simplejpeg
    from PIL import Image

    frames = images.permute(0, 2, 3, 1).contiguous().cpu().numpy()  # (N, h, w, 3)
    out = np.empty_like(frames)

    def code(i: int) -> None:
        buffer = io.BytesIO()
        Image.fromarray(frames[i]).save(buffer, format="JPEG", quality=quality, subsampling="4:2:0")
        out[i] = simplejpeg.decode_jpeg(buffer.getvalue(), colorspace="RGB", fastdct=True, fastupsample=False)

    threads = min(torch.get_num_threads(), len(frames) // JPEG_IMAGES_PER_THREAD)
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(code, range(len(frames))))
    else:
        for i in range(len(frames)):
            code(i)
    return torch.from_numpy(out).permute(0, 3, 1, 2)


def _lanczos(x: np.ndarray, radius: float) -> np.ndarray:
    """TF's ``LanczosKernelFunc`` (sampling_kernels.h) in float32, including its ``x <= 1e-3 -> 1`` limit."""
    x = np.abs(x).astype(np.float32)
    pi = np.float32(TF_PI)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = (np.float32(radius) * np.sin(pi * x) * np.sin(pi * x / np.float32(radius))
                 / (pi * pi * x * x)).astype(np.float32)
    return np.where(x <= 1e-3, np.float32(1.0), np.where(x > radius, np.float32(0.0), value))


@functools.lru_cache(maxsize=16)
def lanczos3_spans(in_size: int, out_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TF's antialiased ``lanczos3`` resampling along one axis (``ComputeSpansCore`` of
    tensorflow/core/kernels/image/scale_and_translate_op.cc), as ``index`` int64 ``(out_size, K)`` and
    ``weight`` float32 ``(out_size, K)``: output pixel ``x`` is ``sum_k weight[x, k] * input[index[x, k]]``.
    Output pixel ``x`` samples the input at ``(x + 0.5) / scale``; when shrinking the kernel is stretched by
    ``1 / scale``; taps are clamped to the image and the weights normalised to sum 1 (padding taps: weight 0)."""
    scale = np.float32(out_size) / np.float32(in_size)
    inv_scale = np.float32(1.0) / scale
    kernel_scale = max(inv_scale, np.float32(1.0))
    reach = np.float32(LANCZOS3_RADIUS) * kernel_scale
    K = min(2 * int(np.ceil(reach)) + 1, in_size)
    index = np.zeros((out_size, K), np.int64)
    weight = np.zeros((out_size, K), np.float32)
    for x in range(out_size):
        sample = (np.float32(x) + np.float32(0.5)) * inv_scale
        start = min(max(int(np.ceil(sample - reach - np.float32(0.5))), 0), in_size - 1)
        end = min(max(int(np.floor(sample + reach - np.float32(0.5))), 0), in_size - 1) + 1
        taps = np.arange(start, end, dtype=np.float32)
        w = _lanczos((taps + np.float32(0.5) - sample) / kernel_scale, LANCZOS3_RADIUS)
        index[x, : end - start] = np.arange(start, end)
        weight[x, : end - start] = w * (np.float32(1.0) / w.sum(dtype=np.float32))
    return torch.from_numpy(index), torch.from_numpy(weight)


@functools.lru_cache(maxsize=16)
def lanczos3_matrix(in_size: int, out_size: int) -> torch.Tensor:
    """:func:`lanczos3_spans` as a dense float32 ``(out_size, in_size)`` matrix: at these sizes one BLAS
    matmul beats gathering the few taps per pixel."""
    index, weight = lanczos3_spans(in_size, out_size)
    return torch.zeros(out_size, in_size).scatter_add_(1, index, weight)


def tf_lanczos3_resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """``tf.image.resize(method="lanczos3", antialias=True)`` of float images ``(N, C, h, w)`` ->
    ``(N, C, size, size)`` (float32, unrounded): rows first, then columns, as TF's kernel does."""
    _, _, h, w = images.shape
    rows = lanczos3_matrix(h, size).to(images.device)  # (size, h)
    cols = lanczos3_matrix(w, size).to(images.device)  # (size, w)
    x = torch.matmul(rows, images.float())              # (N, C, size, w)
    return torch.matmul(x, cols.T)                      # (N, C, size, size)


def oft_resize(images: torch.Tensor, size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """OFT's ``resize_image_for_policy`` on uint8 ``(N, 3, h, w)``: JPEG round trip (on the CPU, where the codec
    is), then lanczos3 resize, round-half-even and clip on ``device`` (default: the CPU). The decoded uint8
    images are what moves, before the resize: on a GPU the two matrix products take well under a millisecond
    instead of most of the CPU's share of ``policy.act``. Returns float32 uint8 levels ``(N, 3, size, size)``."""
    decoded = jpeg_round_trip(images)
    if device is not None:
        decoded = decoded.to(device, non_blocking=True)
    return torch.round(tf_lanczos3_resize(decoded.float(), size)).clamp(0.0, UINT8_MAX)


def tf_center_crop_and_resize(images: torch.Tensor, area: float, size: int) -> torch.Tensor:
    """TF ``crop_and_resize`` (bilinear) of the central square covering ``area`` of the image.

    ``images``: float ``(N, C, H, W)`` in [0, 1]. Box corners are normalised coordinates mapped onto pixel
    centres (``y = y1 * (H - 1) + i * (y2 - y1) * (H - 1) / (size - 1)``), which is ``grid_sample`` with
    ``align_corners=True``. Returns ``(N, C, size, size)``.
    """
    N, _, H, W = images.shape
    side = math.sqrt(min(max(area, 0.0), 1.0))
    lo, hi = (1.0 - side) / 2.0, (1.0 + side) / 2.0
    steps = torch.linspace(0.0, 1.0, size, device=images.device, dtype=torch.float32)  # (size,)
    # normalised box coordinate -> grid_sample coordinate in [-1, 1] (align_corners=True: -1/+1 = pixel centres)
    coords = 2.0 * (lo + steps * (hi - lo)) - 1.0  # (size,)
    gy, gx = torch.meshgrid(coords, coords, indexing="ij")  # (size, size)
    grid = torch.stack([gx, gy], dim=-1).expand(N, size, size, 2)  # (N, size, size, 2): (x, y) order
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=True)


class ImageProcessor(nn.Module):
    """uint8 ``[B, V, 3, h, w]`` camera images -> float32 pixels ``[B, V * 6, S, S]`` for the fused towers.

    Two halves: :meth:`uint8_levels` (steps 1-2 of the module docstring: JPEG, resize, crop) runs the JPEG
    codec on the CPU when a resize needs it, moves the uint8 images to the target device and resizes and crops
    there, returning uint8 levels; :meth:`normalize` (step 3) runs on the device of the levels with the
    per-tower means and stds, which are buffers created on ``device`` and moved with the policy's ``.to()``.
    """

    means: torch.Tensor
    stds: torch.Tensor

    def __init__(self, image_size: int, center_crop: bool = False,
                 means: Sequence[Sequence[float]] = (DINO_MEAN, SIGLIP_MEAN),
                 stds: Sequence[Sequence[float]] = (DINO_STD, SIGLIP_STD),
                 crop_area: float = CENTER_CROP_AREA, *, device: torch.device | str | None = None):
        super().__init__()
        if len(means) != TOWERS or len(stds) != TOWERS:
            raise ValueError(f"the fused backbone needs {TOWERS} means/stds (DINOv2, SigLIP), got {len(means)}")
        self.image_size = int(image_size)
        self.center_crop = bool(center_crop)
        self.crop_area = float(crop_area)
        shape = (TOWERS * RGB_CHANNELS, 1, 1)
        self.register_buffer("means", torch.tensor(means, dtype=torch.float32, device=device).reshape(shape),
                             persistent=False)   # (6, 1, 1)
        self.register_buffer("stds", torch.tensor(stds, dtype=torch.float32, device=device).reshape(shape),
                             persistent=False)   # (6, 1, 1)

    def forward(self, images) -> torch.Tensor:
        """Both halves; the pixels are on the device of the buffers."""
        images = _as_uint8_tensor(images)
        return self.normalize(self.uint8_levels(images, self.means.device), images.shape[0])

    def normalize(self, levels: torch.Tensor, batch: int) -> torch.Tensor:
        """uint8 levels ``[B*V, 3, S, S]`` -> normalised float32 pixels ``[B, V * 6, S, S]`` on their device."""
        S = self.image_size
        x = levels.to(torch.float32) / UINT8_MAX  # (B*V, 3, S, S) in [0, 1]
        stacked = x.repeat(1, TOWERS, 1, 1)  # (B*V, 6, S, S): DINOv2 channels then SigLIP channels
        stacked = (stacked - self.means) / self.stds
        return stacked.reshape(batch, -1, S, S)

    def uint8_levels(self, images, device: torch.device | str | None = None) -> torch.Tensor:
        """Steps 1-2 of the module docstring: uint8 ``[B, V, 3, h, w]`` -> uint8 ``[B*V, 3, S, S]`` on ``device``
        (default: where the images are), the image OFT hands to the Prismatic processor. Only the JPEG codec
        runs on the CPU; the resize and crop run on ``device``, so a GPU policy keeps them off its CPU."""
        images = _as_uint8_tensor(images)
        if images.ndim != 5 or images.shape[2] != RGB_CHANNELS:
            raise ValueError(f"images must be [B, V, 3, h, w] uint8, got shape {tuple(images.shape)}")
        B, V, C, h, w = images.shape
        S = self.image_size
        device = images.device if device is None else torch.device(device)
        if (h, w) != (S, S):
            x = oft_resize(images.reshape(B * V, C, h, w), S, device)   # (B*V, 3, S, S) uint8 levels
        else:
            x = images.reshape(B * V, C, h, w).to(device, non_blocking=True).to(torch.float32)  # in [0, 255]
        if self.center_crop:
            x = tf_center_crop_and_resize(x / UINT8_MAX, self.crop_area, S).clamp(0.0, 1.0)
            x = torch.trunc(x * TF_FLOAT_TO_UINT8_SCALE).clamp(0.0, UINT8_MAX)  # (B*V, 3, S, S) uint8 levels
        return x.to(torch.uint8)   # the levels are integers: exact

    def to_config(self) -> dict:
        """Prismatic ``preprocessor_config.json`` fields describing this processor."""
        means = self.means.reshape(TOWERS, RGB_CHANNELS).tolist()
        stds = self.stds.reshape(TOWERS, RGB_CHANNELS).tolist()
        return {"image_processor_type": "PrismaticImageProcessor", "use_fused_vision_backbone": True,
                "image_resize_strategy": "resize-naive",
                "input_sizes": [[RGB_CHANNELS, self.image_size, self.image_size]] * TOWERS,
                "interpolations": ["bicubic"] * TOWERS, "means": means, "stds": stds}


class HashWordTokenizer:
    """Tokenizer for policies without a checkpoint: every word or punctuation mark becomes one id by a
    stable hash (CRC-32) into ``[HASH_ID_LOW, HASH_ID_HIGH)``. It needs no files and is the same in every
    process; a randomly initialised model has no vocabulary to match anyway."""

    PIECES = re.compile(r"\w+|[^\w\s]")

    def __init__(self, low: int = HASH_ID_LOW, high: int = HASH_ID_HIGH):
        self.low, self.high = int(low), int(high)

    def encode(self, text: str) -> list[int]:
        span = self.high - self.low
        return [self.low + zlib.crc32(piece.encode("utf-8")) % span for piece in self.PIECES.findall(text)]


class PromptTokenizer:
    """Instructions -> left-padded prompt ids without BOS (the model places BOS itself).

    ``tokenizer`` is a transformers tokenizer (from the checkpoint) or ``None`` for
    :class:`HashWordTokenizer`. Ids per instruction are cached: an env split repeats a few instructions.
    """

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._words = HashWordTokenizer() if tokenizer is None else None
        self._cache: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def prompt(instruction: str) -> str:
        return PROMPT_TEMPLATE.format(instruction=instruction.lower())

    def prompt_ids(self, instruction: str) -> tuple[int, ...]:
        """Ids of the prompt after BOS, ending with :data:`LLAMA_EMPTY_PIECE_ID`."""
        ids = self._cache.get(instruction)
        if ids is not None:
            return ids
        text = self.prompt(instruction)
        if self._words is not None:
            out = self._words.encode(text)
        else:
            out = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
            bos = self.tokenizer.bos_token_id
            if out and bos is not None and out[0] == bos:
                out = out[1:]
        if not out or out[-1] != LLAMA_EMPTY_PIECE_ID:
            out.append(LLAMA_EMPTY_PIECE_ID)
        ids = tuple(out)
        if len(self._cache) >= PROMPT_CACHE_SIZE:
            self._cache.clear()
        self._cache[instruction] = ids
        return ids

    def __call__(self, instructions: Sequence[str], device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``ids`` int64 ``[B, M]`` (left-padded with :data:`LLAMA_PAD_ID`) and ``mask`` bool
        ``[B, M]`` (True on real tokens), M the longest prompt of the batch."""
        if isinstance(instructions, str):
            raise TypeError("instructions must be a list of strings, one per batch element")
        rows = [self.prompt_ids(str(t)) for t in instructions]
        M = max(len(r) for r in rows)
        ids = torch.full((len(rows), M), LLAMA_PAD_ID, dtype=torch.int64)  # (B, M)
        mask = torch.zeros((len(rows), M), dtype=torch.bool)               # (B, M)
        for i, r in enumerate(rows):
            ids[i, M - len(r):] = torch.tensor(r, dtype=torch.int64)
            mask[i, M - len(r):] = True
        return ids.to(device), mask.to(device)
