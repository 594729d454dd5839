"""The OFT network: bidirectional parallel decoding, padding, read positions, heads, sampling, full-size build."""

import pytest
import torch

from embodirl.envs.base import EnvSpec
from embodirl.models.base import SamplingParams
from embodirl.models.openvla_oft import build_policy
from embodirl.models.openvla_oft.modeling import NUM_SUFFIX_TOKENS, build_model
from embodirl.models.openvla_oft.resolve import build_config, load_preset
from embodirl.models.openvla_oft.sampling import log_prob_and_entropy, sample, truncate
from embodirl.models.processor import LLAMA_STOP_ID, ImageProcessor, PromptTokenizer

SPEC = EnvSpec(action_dim=7, max_episode_steps=100, task_descriptions=["t"], camera_names=["agentview", "wrist"],
               image_size=(64, 64), state_dim=8, name="libero_10")
INSTRUCTIONS = ["put the bowl on the plate", "open the top drawer and put the bowl inside", "stop"]


def tiny(**overrides):
    raw = load_preset("openvla_oft_tiny")
    raw.update(overrides)
    return raw


@pytest.fixture(scope="module")
def model_and_inputs():
    cfg = build_config(tiny(), SPEC)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    images = torch.randint(0, 256, (3, 2, 3, 64, 64), dtype=torch.uint8)
    pixels = ImageProcessor(cfg.model.image_size)(images)
    ids, mask = PromptTokenizer()(INSTRUCTIONS)
    proprio = torch.randn(3, 8).clamp(-1, 1)
    return model, (pixels, ids, mask, proprio)


def test_sequence_layout_and_read_positions(model_and_inputs):
    model, inputs = model_and_inputs
    cfg = model.cfg
    L = cfg.tokens_per_decision
    with torch.no_grad():
        seq = model.build_sequence(*inputs)
        hidden = model.decoder_hidden(seq)
        out = model(*inputs)
    T = seq.embeds.shape[1]
    assert T == model.num_prefix_tokens + inputs[1].shape[1] + L + NUM_SUFFIX_TOKENS
    first_slot = T - NUM_SUFFIX_TOKENS - L
    assert torch.count_nonzero(seq.embeds[:, first_slot:first_slot + L]).item() == 0       # empty action slots
    stop = model.language_model.get_input_embeddings().weight[LLAMA_STOP_ID]
    assert torch.equal(seq.embeds[:, -1], stop.expand(3, -1))                             # </s> after the slots
    # padded sample: positions skip the pads, so its slots sit at the same positions as in the longest prompt
    assert torch.equal(seq.position_ids[2, first_slot:], seq.position_ids[2, first_slot] + torch.arange(L + 1))
    assert seq.position_ids[2, first_slot] < seq.position_ids[1, first_slot]
    # token k is read one position early: the prompt's last token "▁" gives the first action's logits
    torch.testing.assert_close(out.action_logits, model.action_logits(hidden[:, first_slot - 1:first_slot - 1 + L]))
    torch.testing.assert_close(out.prompt_hidden, hidden[:, first_slot - 1])
    full = model.language_model.lm_head(hidden[:, first_slot - 1:first_slot - 1 + L]).float()
    tok = model.action_tokenizer
    torch.testing.assert_close(out.action_logits, full[..., tok.first_id:tok.end_id])  # only the action rows


def test_attention_is_bidirectional_only_through_the_padding_mask(model_and_inputs):
    model, inputs = model_and_inputs
    L = model.cfg.tokens_per_decision
    with torch.no_grad():
        seq = model.build_sequence(*inputs)
        T = seq.embeds.shape[1]
        first_slot = T - NUM_SUFFIX_TOKENS - L
        early, late = first_slot + 2, first_slot + L - 1
        base = model.decoder_hidden(seq)

        def perturbed(position, batch=slice(None)):
            embeds = seq.embeds.clone()
            embeds[batch, position] += torch.randn_like(embeds[batch, position])
            return type(seq)(embeds, seq.mask, seq.position_ids)

        # a later action slot changes earlier slots and the prompt (bidirectional)
        changed = model.decoder_hidden(perturbed(late))
        assert (changed[:, early] - base[:, early]).abs().max() > 1e-3
        assert (changed[:, first_slot - 1] - base[:, first_slot - 1]).abs().max() > 1e-3
        # a pad position (sample 2 has the shortest prompt) changes nothing that is read
        pad = int((~seq.mask[2]).nonzero()[0])
        padded = model.decoder_hidden(perturbed(pad, batch=2))
        keep = seq.mask[2]
        torch.testing.assert_close(padded[2][keep], base[2][keep], atol=1e-6, rtol=0)
        # under a causal mask (the autoregressive baseline) the same change leaves earlier slots alone
        causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & seq.mask[:, None, None, :]
        causal_base = model.decoder_hidden(seq, attention_mask=causal)
        causal_changed = model.decoder_hidden(perturbed(late), attention_mask=causal)
        torch.testing.assert_close(causal_changed[:, :late], causal_base[:, :late], atol=0, rtol=0)
        assert (causal_base[:, early] - base[:, early]).abs().max() > 1e-3  # and the two masks differ


def test_padded_batch_equals_single_samples(model_and_inputs):
    model, (pixels, ids, mask, proprio) = model_and_inputs
    with torch.no_grad():
        batch = model(pixels, ids, mask, proprio)
        for i, text in enumerate(INSTRUCTIONS):
            one_ids, one_mask = PromptTokenizer()([text])
            single = model(pixels[i:i + 1], one_ids, one_mask, proprio[i:i + 1])
            torch.testing.assert_close(single.action_logits, batch.action_logits[i:i + 1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(single.prompt_hidden, batch.prompt_hidden[i:i + 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value_type, shape", [("chunk_level", (3,)), ("action_level", (3, 8))])
def test_value_head_shapes(value_type, shape):
    cfg = build_config(tiny(value_type=value_type), SPEC)
    torch.manual_seed(1)
    model = build_model(cfg)
    images = torch.randint(0, 256, (3, 2, 3, 56, 56), dtype=torch.uint8)
    ids, mask = PromptTokenizer()(INSTRUCTIONS)
    out = model(ImageProcessor(56)(images), ids, mask, torch.zeros(3, 8))
    values = model.values(out.prompt_hidden)
    assert values.shape == shape and values.dtype == torch.float32
    values.sum().backward()
    assert model.value_head.mlp[0].weight.grad is not None


def test_l1_regression_head():
    torch.manual_seed(2)
    policy = build_policy(tiny(use_l1_regression=True), SPEC)
    obs = {"images": torch.randint(0, 256, (2, 2, 3, 64, 64), dtype=torch.uint8), "state": torch.zeros(2, 8),
           "instruction": INSTRUCTIONS[:2]}
    out = policy.act(obs, SamplingParams(greedy=True))
    assert out["action_chunk"].shape == (2, 8, 7)
    with torch.no_grad():
        inputs = policy.prepare_inputs(obs)
        regressed = policy.core.regress_actions(policy.core(**inputs).action_hidden)
    torch.testing.assert_close(out["action_chunk"], regressed)  # identity statistics: chunk = head output
    assert torch.equal(out["action_tokens"], policy.action_tokenizer.encode(regressed.reshape(2, -1)))


def test_sampling_never_leaves_the_action_ids():
    torch.manual_seed(3)
    policy = build_policy(tiny(), SPEC)
    obs = {"images": torch.randint(0, 256, (4, 2, 3, 64, 64), dtype=torch.uint8), "state": torch.zeros(4, 8),
           "instruction": ["a", "b", "c", "d"]}
    core = policy.core
    with torch.no_grad():
        out = core(**policy.prepare_inputs(obs))
        # make an ordinary text token the most likely id of the full vocabulary at every read position
        direction = out.action_hidden.reshape(-1, out.action_hidden.shape[-1]).mean(0)
        core.language_model.lm_head.weight[100] = 1e3 * direction / direction.norm()
        full = core.language_model.lm_head(out.action_hidden)
        assert bool((full.argmax(-1) == 100).all())
    for params in (SamplingParams(greedy=True), SamplingParams(temperature=5.0),
                   SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=2.0, top_p=0.5)):
        tokens = policy.act(obs, params)["action_tokens"]
        assert bool(policy.action_tokenizer.is_action_id(tokens).all())


def test_sampling_functions():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]]).expand(20000, -1)
    index, logprob = sample(logits, SamplingParams(temperature=1.0), generator=g)
    freq = torch.bincount(index, minlength=4).float() / index.numel()
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.015, rtol=0)
    torch.testing.assert_close(logprob, logits.log_softmax(-1).gather(-1, index[:, None])[:, 0])
    # top-k / top-p narrow the draw; the log-prob stays that of the tempered, untruncated distribution
    index, logprob = sample(logits, SamplingParams(temperature=0.5, top_k=2), generator=g)
    assert set(index.tolist()) == {0, 1}
    torch.testing.assert_close(logprob, (logits / 0.5).log_softmax(-1).gather(-1, index[:, None])[:, 0])
    index, _ = sample(logits, SamplingParams(top_p=0.6), generator=g)  # p = .61, .22, ... -> only id 0
    assert set(index.tolist()) == {0}
    greedy, _ = sample(torch.randn(5, 7, 256), SamplingParams(greedy=True))
    assert greedy.shape == (5, 7)
    lp, ent = log_prob_and_entropy(logits[:1], torch.tensor([0]), 1.0)
    p = logits[0].softmax(-1)
    torch.testing.assert_close(ent, -(p * p.log()).sum()[None])


def test_top_p_against_a_loop():
    torch.manual_seed(4)
    logits = torch.randn(50, 16)
    for top_p in (0.1, 0.5, 0.9):
        kept = torch.isfinite(truncate(logits, None, top_p))
        for row, mask in zip(logits, kept):
            probs, order = row.softmax(-1).sort(descending=True)
            expected, mass = torch.zeros(16, dtype=torch.bool), 0.0
            for p, i in zip(probs.tolist(), order.tolist()):
                if mass >= top_p:
                    break
                expected[i], mass = True, mass + p
            assert torch.equal(mask, expected)


def test_full_size_preset_builds_on_meta_without_memory():
    policy = build_policy(load_preset("openvla_oft"), SPEC, device="meta")
    params = list(policy.named_parameters())
    assert all(p.is_meta for _, p in params)
    base = sum(p.numel() for n, p in params if ".lora_" not in n and ".modules_to_save." not in n)
    assert 7.45e9 < base < 7.65e9  # OpenVLA-7B (7.54e9) + proprio projector and value head
    llm = sum(p.numel() for n, p in policy.core.language_model.named_parameters() if ".lora_" not in n)
    assert llm == 6_738_415_616 + 2 * 64 * 4096  # Llama-2-7B with the vocabulary padded to 32064
    assert policy.cfg.tokens_per_decision == 56 and policy.cfg.attn_implementation in ("sdpa", "flash_attention_2")
    lora = sum(p.numel() for n, p in params if ".lora_" in n)
    assert lora > 0 and policy.cfg.model.lora.rank == 32
