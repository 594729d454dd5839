"""π0's inputs as openpi makes them (Physical-Intelligence/openpi @ 15a9616a), checked against values derived here from
openpi's algorithms (openpi and JAX cannot be installed here; its code was read, not run):

* images: ``openpi.transforms.ResizeImages`` -> ``openpi_client.image_tools.resize_with_pad`` (PIL bilinear, which
  widens its kernel by the scale when shrinking; ``src/openpi/shared/image_tools.py``'s JAX ``resize_with_pad`` with
  ``jax.image.resize(method="linear")`` is the same map), padding with black (0) centred with the odd pixel after,
  then ``Observation.from_dict``'s ``x / 255 * 2 - 1`` (``src/openpi/models/model.py``);
* prompts: ``openpi.models.tokenizer.PaligemmaTokenizer.tokenize`` - ``strip()``, ``_`` and newlines as spaces, BOS,
  the cleaned text, then ``"\\n"`` encoded on its own;
* precision: ``openpi.models_pytorch.gemma_pytorch.PaliGemmaWithExpertModel.to_bfloat16_for_selected_params`` keeps
  SigLIP's patch and position embeddings and every RMSNorm weight in float32;

and a checkpoint with PaliGemma's vocabulary but no tokenizer is refused in one sentence."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image

from embodirl import data as D
from embodirl.envs.base import EnvSpec
from embodirl.errors import ConfigError
from embodirl.models.base import SamplingParams
from embodirl.models.pi0.checkpoint import check_checkpoint
from embodirl.models.pi0.openpi import clean_prompt, resize_with_pad
from embodirl.models.registry import make_policy, model_config
from tests.models import test_pi0 as pi0_tests

WIDE = EnvSpec(action_dim=7, max_episode_steps=24, task_descriptions=["  pick_up the black_bowl\n", "pick up the bowl"],
               camera_names=["main", "wrist"], image_size=(40, 72), state_dim=5, name="wide")


# --- the reference: the resize written from the algorithm (jax.image.scale_and_translate's linear kernel) ----------
def _weights(size_in: int, size_out: int) -> np.ndarray:
    """``[size_out, size_in]`` weights of a linear (triangle) kernel resampling with half-pixel centres: output ``i``
    samples the input at ``(i + 0.5) s - 0.5`` (``s = size_in / size_out``); when shrinking (``s > 1``) the triangle
    is ``s`` pixels wide instead of one, so every input pixel counts (antialiasing); each row normalised to sum 1."""
    scale = size_in / size_out
    width = max(scale, 1.0)
    centres = (np.arange(size_out) + 0.5) * scale - 0.5
    w = np.maximum(0.0, 1.0 - np.abs(centres[:, None] - np.arange(size_in)[None, :]) / width)
    return w / w.sum(axis=1, keepdims=True)


def reference_resize_with_pad(image: np.ndarray, size: int) -> np.ndarray:
    """uint8 ``[3, h, w]`` -> float64 ``[3, size, size]`` in [-1, 1], as openpi: resize with the aspect kept, round to
    uint8, pad with 0 (``pad_h0, rest = divmod(size - h', 2)``: the odd pixel after), ``x / 255 * 2 - 1``."""
    _, h, w = image.shape
    ratio = max(w / size, h / size)
    rh, rw = int(h / ratio), int(w / ratio)
    resized = np.einsum("ih,chw,jw->cij", _weights(h, rh), image.astype(np.float64), _weights(w, rw))
    resized = np.clip(np.round(resized), 0, 255)
    out = np.zeros((3, size, size))
    top, left = (size - rh) // 2, (size - rw) // 2
    out[:, top:top + rh, left:left + rw] = resized
    return out / 255.0 * 2.0 - 1.0


def _pil_resize_with_pad(image: np.ndarray, size: int) -> np.ndarray:
    """openpi_client's path (PIL.Image.resize BILINEAR, pasted on black), on an HWC uint8 copy -> [3, size, size]."""
    h, w = image.shape[1:]
    ratio = max(w / size, h / size)
    rh, rw = int(h / ratio), int(w / ratio)
    resized = Image.fromarray(np.ascontiguousarray(image.transpose(1, 2, 0))).resize((rw, rh), Image.BILINEAR)
    canvas = Image.new("RGB", (size, size), 0)
    canvas.paste(resized, (int((size - rw) / 2), int((size - rh) / 2)))
    return np.asarray(canvas).transpose(2, 0, 1).astype(np.float64)


def test_resize_with_pad_hand_checked_case():
    """A 2 x 4 image into 2 x 2: ratio 2, so 1 x 2 pixels, padded with one black row below. Each output pixel is a
    triangle-weighted mean over a 2-wide kernel (scale 2): the left one weighs columns 0, 1, 2 by 0.75, 0.75, 0.25,
    (0.75 * 10 + 0.75 * 80 + 0.25 * 150) / 1.75 = 60; the right one columns 1, 2, 3 by 0.25, 0.75, 0.75,
    (0.25 * 80 + 0.75 * 150 + 0.75 * 220) / 1.75 = 170. (Plain bilinear would give 45 and 185, bicubic others.)"""
    row = torch.tensor([10.0, 80.0, 150.0, 220.0])
    image = row.expand(1, 3, 2, 4).clone()
    out = resize_with_pad(image, 2)
    expected = torch.tensor([[60.0, 170.0], [0.0, 0.0]]).expand(1, 3, 2, 2)
    assert torch.equal(out, expected)
    hand = np.array([[60.0, 170.0], [0.0, 0.0]]) / 255.0 * 2.0 - 1.0
    np.testing.assert_allclose(reference_resize_with_pad(image[0].numpy().astype(np.uint8), 2), np.stack([hand] * 3),
                               rtol=0, atol=1e-12)
    # an odd margin: 3 x 6 into 4 x 4 -> 2 x 4, one row above and one below; 1 x 6 into 4 x 4 -> 0 rows is openpi's
    # int() too, so take 2 x 7 -> 1 x 4 with one row above, two below
    out = resize_with_pad(torch.full((1, 3, 2, 7), 100.0), 4)
    assert out[0, 0, :, 0].tolist() == [0.0, 100.0, 0.0, 0.0]


@pytest.mark.parametrize("shape", [(40, 72), (72, 40), (100, 100), (30, 50), (256, 256)])
def test_resize_with_pad_matches_openpis_algorithm_on_camera_images(shape):
    """Random uint8 images, shrunk and enlarged, wide, tall and square, into 56 x 56: the same uint8 levels as the
    reference above (float32 against float64: a value on a .5 boundary may round the other way) and within one level
    of PIL's bilinear (openpi_client's exact call, which rounds between its two passes)."""
    h, w = shape
    g = torch.Generator().manual_seed(h * 1000 + w)
    image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
    ours = resize_with_pad(image[None].float(), 56)[0].numpy().astype(np.float64)
    reference = (reference_resize_with_pad(image.numpy(), 56) + 1.0) / 2.0 * 255.0
    assert np.abs(ours - np.round(reference)).max() <= 1.0
    assert (ours == np.round(reference)).mean() > 0.995
    pil = _pil_resize_with_pad(image.numpy(), 56)
    assert np.abs(ours - pil).max() <= 1.0 and (ours == pil).mean() > 0.8


def test_the_policy_feeds_the_network_openpis_pixels(compose_cfg):
    """``prepare_inputs``: the cameras' 40 x 72 uint8 images reach SigLIP as openpi's resize-with-pad to 56 x 56 scaled
    to [-1, 1], in float32 (the patch embedding's own dtype), not stretched."""
    policy, _ = pi0_tests._policy(compose_cfg, spec=WIDE)
    obs = pi0_tests._obs(batch=2, spec=WIDE)
    obs[D.IMAGES] = torch.randint(0, 256, (2, 2, 3, 40, 72), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    pixels = policy.prepare_inputs(obs)["pixel_values"]
    assert pixels.dtype == torch.float32 and pixels.shape == (2, 2, 3, 56, 56)
    for b in range(2):
        for v in range(2):
            expected = reference_resize_with_pad(obs[D.IMAGES][b, v].numpy(), 56)
            assert np.abs(pixels[b, v].double().numpy() - expected).max() <= 2.0 / 255 + 1e-6
    assert bool((pixels[:, :, :, :8] == -1.0).all()) and bool((pixels[:, :, :, -8:] == -1.0).all())   # black bands


def test_prompts_are_cleaned_as_openpi_cleans_them():
    assert clean_prompt("  pick_up the black_bowl\n") == "pick up the black bowl"
    assert clean_prompt("put both the alphabet soup and the tomato sauce in the basket") == \
        "put both the alphabet soup and the tomato sauce in the basket"
    # strip() first, then the replacements (openpi's order): a trailing underscore leaves a trailing space
    assert clean_prompt("open the top\ndrawer_") == "open the top drawer "


def _word_tokenizer(folder):
    """A transformers tokenizer over a few words with Gemma's BOS (2) and newline (108) ids, written into ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "\n": 108, "pick": 300, "up": 301, "the": 302,
             "black": 303, "bowl": 304}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.save_pretrained(str(folder))


def test_token_ids_are_openpis_for_a_checkpoint_with_a_tokenizer(compose_cfg, tmp_path):
    """A checkpoint folder with tokenizer files reads its prompts through them, as openpi's PaligemmaTokenizer
    builds them: BOS, the cleaned instruction's ids, then "\\n" encoded on its own, right-padded; the image tokens go
    before them. '  pick_up the black_bowl\\n' -> 2, 300 (pick), 301 (up), 302 (the), 303 (black), 304 (bowl), 108;
    uncleaned, 'pick_up' and 'black_bowl' would be unknown words (3)."""
    policy, cfg = pi0_tests._policy(compose_cfg, spec=WIDE)
    folder = policy.save_pretrained(tmp_path / "ckpt")
    _word_tokenizer(folder)
    loaded = make_policy(dataclasses.replace(model_config(cfg.model), path=str(folder)), WIDE)
    assert loaded.tokenizer is not None
    assert loaded.prompt_ids(WIDE.task_descriptions[0]) == (2, 300, 301, 302, 303, 304, 108)
    assert loaded.prompt_ids(WIDE.task_descriptions[1]) == (2, 300, 301, 302, 304, 108)
    inputs = loaded.prepare_inputs(pi0_tests._obs(batch=2, spec=WIDE))
    images = 2 * 16                                               # two cameras of (56 / 14)^2 patches
    row = inputs["input_ids"][0].tolist()
    assert row[:images] == [loaded.image_token_id] * images
    assert row[images:] == [2, 300, 301, 302, 303, 304, 108] + [0] * (loaded.prompt_length - images - 7)
    assert inputs["attention_mask"][0].sum() == images + 7


def test_the_parameters_openpi_keeps_in_float32_stay_float32(compose_cfg, tmp_path):
    """A bfloat16 π0 keeps in float32 exactly SigLIP's patch embedding (weight, bias) and position embedding and every
    Gemma RMSNorm weight (VLM and expert, each layer's two and the final one), and a checkpoint's float32 values of
    them load as stored (not rounded through bfloat16); everything else is bfloat16 and the policy acts."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    policy, cfg = pi0_tests._policy(compose_cfg)
    with torch.no_grad():
        for p in policy.network.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    folder = policy.save_pretrained(tmp_path / "fp32")
    net = policy.network
    norms = {f"{n}.weight" for n, m in net.named_modules() if isinstance(m, GemmaRMSNorm)}
    embeddings = {f"model.vlm.vision_tower.embeddings.{k}" for k in
                  ("patch_embedding.weight", "patch_embedding.bias", "position_embedding.weight")}
    kept = norms | embeddings
    assert len(norms) == 2 * 2 * 2 + 2                      # 2 layers x 2 norms x (VLM, expert) + 2 final norms
    stored = dict(net.named_parameters())
    for built in (pi0_tests._policy(compose_cfg, "model.dtype=bfloat16")[0],
                  make_policy(dataclasses.replace(model_config(cfg.model), dtype="bfloat16", path=str(folder)),
                              pi0_tests.SPEC)):
        dtypes = {n: p.dtype for n, p in built.network.named_parameters()}
        assert {n for n, d in dtypes.items() if d == torch.float32} == kept
        assert all(d == torch.bfloat16 for n, d in dtypes.items() if n not in kept)
        out = built.act(pi0_tests._obs(), SamplingParams(greedy=True))
        assert all(bool(torch.isfinite(v).all()) for v in out.values())
    loaded = dict(built.network.named_parameters())
    for name in kept:
        assert torch.equal(loaded[name], stored[name]), name
    some_bf16 = "model.dit.layers.0.self_attn.q_proj.weight"
    assert torch.equal(loaded[some_bf16], stored[some_bf16].to(torch.bfloat16))


def test_a_paligemma_vocabulary_checkpoint_without_its_tokenizer_is_one_sentence(compose_cfg, tmp_path):
    """Both layouts: a π0 with PaliGemma's 257152-token vocabulary and no tokenizer files is refused before anything
    is built, naming the folder and the files to add; with a tokenizer file it passes; a small vocabulary (pi0_tiny's
    exports) keeps the hashing tokenizer."""
    from tests.models.test_pi0_lerobot import write_lerobot_folder

    policy, _ = pi0_tests._policy(compose_cfg)
    folder = policy.save_pretrained(tmp_path / "hf")
    assert "π0" in check_checkpoint(folder)                                 # vocabulary 1024: no tokenizer needed
    config = json.loads((folder / "config.json").read_text())
    config["vlm_config"]["text_config"]["vocab_size"] = 257152
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        check_checkpoint(folder)
    message = str(err.value)
    assert message.startswith("model.path:") and str(folder) in message and "257152" in message
    assert "tokenizer.json or tokenizer.model" in message and "google/paligemma-3b-pt-224" in message
    assert message.count(". ") == 0 and "\n" not in message                 # one sentence
    (folder / "tokenizer.model").write_bytes(b"")
    check_checkpoint(folder)

    lerobot = write_lerobot_folder(policy, tmp_path / "lerobot", state_dim=5, action_dim=7)
    assert "LeRobot π0" in check_checkpoint(lerobot)                        # variants of its own: the model's sizes
    config = json.loads((lerobot / "config.json").read_text())
    config.update(paligemma_variant="gemma_2b", action_expert_variant="gemma_300m")
    (lerobot / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"lerobot holds a π0 with PaliGemma's 257152-token vocabulary but no "
                                          r"tokenizer: copy the tokenizer files of google/paligemma-3b-pt-224"):
        check_checkpoint(lerobot)
