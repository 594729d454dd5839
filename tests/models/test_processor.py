"""OFT image preprocessing and prompt tokenisation."""

import math
import zlib

import numpy as np
import pytest
import torch

from embodirl.models.processor import (
    DINO_MEAN,
    DINO_STD,
    HASH_ID_HIGH,
    HASH_ID_LOW,
    LLAMA_EMPTY_PIECE_ID,
    LLAMA_PAD_ID,
    ImageProcessor,
    PromptTokenizer,
    tf_center_crop_and_resize,
)


def tf_crop_and_resize_loop(img: np.ndarray, box, size: int) -> np.ndarray:
    """TF ``crop_and_resize`` (bilinear) for one HWC float image, written as a plain loop."""
    H, W, _ = img.shape
    y1, x1, y2, x2 = box
    out = np.zeros((size, size, img.shape[2]), dtype=np.float64)
    for i in range(size):
        y = y1 * (H - 1) + i * (y2 - y1) * (H - 1) / (size - 1)
        for j in range(size):
            x = x1 * (W - 1) + j * (x2 - x1) * (W - 1) / (size - 1)
            y0, x0 = int(math.floor(y)), int(math.floor(x))
            yb, xb = min(y0 + 1, H - 1), min(x0 + 1, W - 1)
            dy, dx = y - y0, x - x0
            top = img[y0, x0] * (1 - dx) + img[y0, xb] * dx
            bottom = img[yb, x0] * (1 - dx) + img[yb, xb] * dx
            out[i, j] = top * (1 - dy) + bottom * dy
    return out


def smooth_images(B, V, h, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(B * V, 3, 8, 8, generator=g) * 255
    fine = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
    return fine.round().clamp(0, 255).to(torch.uint8).reshape(B, V, 3, h, w)


def test_layout_and_per_tower_normalisation():
    proc = ImageProcessor(image_size=28, center_crop=False)
    images = torch.zeros(2, 2, 3, 28, 28, dtype=torch.uint8)
    images[:, 0] = 64
    images[:, 1] = 200
    out = proc(images)
    assert out.shape == (2, 12, 28, 28) and out.dtype == torch.float32
    for v, level in enumerate((64, 200)):
        x = level / 255.0
        dino = [(x - m) / s for m, s in zip(DINO_MEAN, DINO_STD)]
        siglip = [(x - 0.5) / 0.5] * 3
        got = out[0, v * 6:(v + 1) * 6, 0, 0].tolist()
        np.testing.assert_allclose(got, dino + siglip, rtol=1e-6)


def test_resize_is_batched_and_quantised():
    """OFT's resize (test_image_pipeline.py holds it to TensorFlow) on a [B, V] batch: uint8 levels, and each
    image processed as if alone."""
    images = smooth_images(2, 2, 64, 64)
    proc = ImageProcessor(image_size=56, center_crop=False, means=((0, 0, 0),) * 2, stds=((1, 1, 1),) * 2)
    ours = proc(images)[:, [0, 1, 2, 6, 7, 8]] * 255.0  # (2, 6, 56, 56): both images' DINOv2 channels
    assert torch.allclose(ours, ours.round(), atol=1e-4)
    alone = proc(images[1:, 1:])[0, :3] * 255.0
    assert torch.equal(alone, ours[1, 3:])


def test_only_the_codec_runs_on_the_cpu():
    """Resize, crop and normalisation run on the processor's device (a GPU policy keeps them off its CPU): built
    on the meta device, every step after the JPEG codec gets meta tensors, and a CPU tensor mixed into them would
    raise. The levels moved before the resize are the same images."""
    images = smooth_images(2, 2, 64, 64)
    proc = ImageProcessor(image_size=56, center_crop=True, device="meta")
    pixels = proc(images)
    assert pixels.is_meta and pixels.shape == (2, 12, 56, 56)
    levels = proc.uint8_levels(images, "meta")
    assert levels.is_meta and levels.dtype == torch.uint8 and levels.shape == (4, 3, 56, 56)
    cpu = ImageProcessor(image_size=56, center_crop=True)
    assert torch.equal(cpu.uint8_levels(images), cpu.uint8_levels(images, "cpu"))


def test_center_crop_matches_tf_crop_and_resize_loop():
    rng = np.random.default_rng(0)
    img = rng.random((20, 20, 3))
    side = math.sqrt(0.9)
    box = ((1 - side) / 2, (1 - side) / 2, (1 + side) / 2, (1 + side) / 2)
    expected = tf_crop_and_resize_loop(img, box, 12)
    ours = tf_center_crop_and_resize(torch.from_numpy(img).permute(2, 0, 1)[None].float(), 0.9, 12)
    np.testing.assert_allclose(ours[0].permute(1, 2, 0).numpy(), expected, atol=1e-5)


def test_center_crop_pipeline_quantises_like_tf():
    images = smooth_images(2, 1, 32, 32, seed=1)
    proc = ImageProcessor(image_size=32, center_crop=True, means=((0, 0, 0),) * 2, stds=((1, 1, 1),) * 2)
    out = proc(images)[:, :3] * 255.0
    crop = tf_center_crop_and_resize(images[:, 0].float() / 255.0, 0.9, 32).clamp(0, 1)
    expected = torch.trunc(crop * 255.5).clamp(0, 255)
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=0)
    assert not torch.equal(out, images[:, 0].float())  # the crop zooms in


def test_image_processor_rejects_bad_inputs():
    proc = ImageProcessor(image_size=28)
    with pytest.raises(TypeError):
        proc(torch.zeros(1, 1, 3, 28, 28))
    with pytest.raises(ValueError):
        proc(torch.zeros(1, 3, 28, 28, dtype=torch.uint8))
    out = proc(np.zeros((1, 1, 3, 30, 30), dtype=np.uint8))  # numpy from the env works too
    assert out.shape == (1, 6, 28, 28)


def test_prompt_tokenizer_words_padding_and_empty_piece():
    tok = PromptTokenizer()
    ids, mask = tok(["Pick up the Bowl", "go"])
    pieces = ["In", ":", "What", "action", "should", "the", "robot", "take", "to", "pick", "up", "the", "bowl", "?",
              "Out", ":"]
    expected = [HASH_ID_LOW + zlib.crc32(p.encode()) % (HASH_ID_HIGH - HASH_ID_LOW) for p in pieces]
    expected.append(LLAMA_EMPTY_PIECE_ID)
    assert ids.shape == mask.shape == (2, len(expected))
    assert ids[0].tolist() == expected and bool(mask[0].all())     # lower-cased instruction, "▁" appended
    assert expected[5] == expected[11] and len(set(expected)) == len(set(pieces)) + 1  # one id per distinct piece
    n_short = len(pieces) - 3 + 1                                   # "go" instead of "pick up the bowl"
    assert mask[1].sum().item() == n_short
    assert bool((ids[1, : len(expected) - n_short] == LLAMA_PAD_ID).all())   # left padding
    assert ids[1, -1].item() == LLAMA_EMPTY_PIECE_ID
    assert all(HASH_ID_LOW <= i < HASH_ID_HIGH for i in expected[:-1])        # never special or action ids
    with pytest.raises(TypeError):
        tok("not a list")


def test_prompt_tokenizer_with_checkpoint_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in "In : What action should the robot take to open drawer ? Out".split():
        vocab.setdefault(word, len(vocab))
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>") \
        .save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    tok = PromptTokenizer(hf)
    ids = tok.prompt_ids("Open drawer")
    words = ["In", ":", "What", "action", "should", "the", "robot", "take", "to", "open", "drawer", "?", "Out", ":"]
    assert list(ids) == [vocab[w] for w in words] + [LLAMA_EMPTY_PIECE_ID]  # BOS stripped, "▁" appended
