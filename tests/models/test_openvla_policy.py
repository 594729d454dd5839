"""The OpenVLA-OFT Policy: act/score_actions consistency, LoRA and the reference policy, env-spec resolution."""

import pytest
import torch

from embodirl import data as D
from embodirl.envs.base import EnvSpec
from embodirl.errors import ConfigError
from embodirl.models.base import SamplingParams
from embodirl.models.openvla_oft import OpenVLAOFTPolicy
from embodirl.models.openvla_oft.resolve import load_preset
from embodirl.models.registry import get_policy_builder, make_policy

SPEC = EnvSpec(action_dim=7, max_episode_steps=100, task_descriptions=["t"], camera_names=["agentview", "wrist"],
               image_size=(64, 64), state_dim=8, name="libero_10")


def tiny(**overrides):
    raw = load_preset("openvla_oft_tiny")
    raw.update(overrides)
    return raw


def make(seed=0, spec=SPEC, **overrides) -> OpenVLAOFTPolicy:
    torch.manual_seed(seed)
    return make_policy(tiny(**overrides), spec)


def observation(batch=3, cameras=2, seed=0, state_dim=8):
    g = torch.Generator().manual_seed(seed)
    obs = {"images": torch.randint(0, 256, (batch, cameras, 3, 64, 64), dtype=torch.uint8, generator=g),
           "instruction": ["put the bowl on the plate", "open the drawer", "turn on the stove"][:batch]}
    if state_dim:
        obs["state"] = torch.randn(batch, state_dim, generator=g)
    return obs


def perturb_adapters(policy, scale=0.5):
    with torch.no_grad():
        for _name, param in policy.named_parameters():
            if param.requires_grad:
                param.add_(scale * torch.randn_like(param))


@pytest.fixture(scope="module")
def policy():
    return make()


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20),
                                    SamplingParams(temperature=1.6, top_p=0.8), SamplingParams(greedy=True)])
def test_recomputed_logprobs_equal_sampling_logprobs(policy, params):
    obs = observation()
    out = policy.act(obs, params, return_value=True)
    assert out[D.ACTION_CHUNK].shape == (3, 8, 7) and out[D.ACTION_CHUNK].dtype == torch.float32
    assert out[D.ACTION_TOKENS].shape == (3, 56) and out[D.ACTION_TOKENS].dtype == torch.int64
    assert out[D.LOGPROB_BEHAVIOR].shape == (3, 56) and out[D.VALUE].shape == (3,)
    temperature = 1.0 if params.greedy else params.temperature
    ev = policy.score_actions(obs, out[D.ACTION_TOKENS], temperature=temperature)
    torch.testing.assert_close(ev["logprob"], out[D.LOGPROB_BEHAVIOR], atol=1e-6, rtol=0)
    torch.testing.assert_close(ev[D.VALUE], out[D.VALUE], atol=1e-6, rtol=0)
    assert ev["entropy"].shape == (3, 56) and bool((ev["entropy"] >= 0).all())
    assert ev["logprob"].requires_grad and ev[D.VALUE].requires_grad


def test_greedy_chunk_is_the_decoded_tokens(policy):
    obs = observation()
    a = policy.act(obs, SamplingParams(greedy=True))
    b = policy.act(obs, SamplingParams(greedy=True))
    assert torch.equal(a[D.ACTION_TOKENS], b[D.ACTION_TOKENS])
    decoded = policy.action_tokenizer.decode(a[D.ACTION_TOKENS]).reshape(3, 8, 7)
    assert torch.equal(a[D.ACTION_CHUNK], policy.action_normalizer.unnormalize(decoded))


def test_greedy_decoding_over_the_action_bins_is_their_argmax(policy):
    """``model.greedy_decoding=action_bins``: the mode of the distribution RL samples and trains, the argmax of
    the action-bin logits alone (RLinf's predict_action_batch masks the other ids to -inf)."""
    obs = observation()
    out = make(greedy_decoding="action_bins").act(obs, SamplingParams(greedy=True))   # same weights (seed 0)
    with torch.no_grad():
        logits = policy.core(**policy.prepare_inputs(obs)).action_logits               # (B, L, bins)
    tokens = policy.action_tokenizer.index_to_ids(logits.argmax(-1))
    assert torch.equal(out[D.ACTION_TOKENS], tokens)
    ofts = policy.act(obs, SamplingParams(greedy=True))
    assert not torch.equal(ofts[D.ACTION_TOKENS], tokens)     # a random model: non-action ids win the full argmax


def test_greedy_decoding_is_ofts_argmax_over_the_whole_vocabulary(policy):
    """The default (``model.greedy_decoding=vocabulary``), openvla-oft's predict_action: argmax over all 32064
    logits, bin = clip(32000 - id - 1, 0, 254), the bin centre of numpy's linspace edges - written out here with
    numpy. A random model's winners are mostly non-action ids, which that formula sends to the end bins (an
    argmax over the action ids alone would not)."""
    import numpy as np

    obs = observation()
    out = policy.act(obs, SamplingParams(greedy=True))
    with torch.no_grad():
        hidden = policy.core(**policy.prepare_inputs(obs)).action_hidden               # (B, L, D)
        ids = policy.core.language_model.lm_head(hidden).argmax(-1).numpy()           # (B, L) any vocab id
    bins = np.linspace(-1, 1, 256)
    centers = (bins[:-1] + bins[1:]) / 2.0
    expected = centers[np.clip(32000 - ids - 1, 0, centers.shape[0] - 1)].reshape(3, 8, 7)
    assert ((ids < 31744) | (ids >= 32000)).any()                                    # the case that differs
    unnormalized = policy.action_normalizer.unnormalize(torch.from_numpy(expected).float())
    assert torch.equal(out[D.ACTION_CHUNK], unnormalized)
    assert bool(policy.action_tokenizer.is_action_id(out[D.ACTION_TOKENS]).all())


def test_gradients_reach_only_the_trainable_tensors():
    policy = make(seed=1)
    obs = observation()
    tokens = policy.act(obs, SamplingParams())[D.ACTION_TOKENS]
    perturb_adapters(policy, 0.1)  # LoRA B starts at zero; give A a gradient path
    ev = policy.score_actions(obs, tokens)
    (ev["logprob"].sum() + ev[D.VALUE].sum()).backward()
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or ".modules_to_save." in n or ".value_head." in n for n in trainable)
    assert any("value_head" in n for n in trainable) and any("proprio_projector" in n for n in trainable)
    assert {n for n, p in policy.named_parameters() if p.grad is not None} <= trainable
    lora_on_path = [p for n, p in policy.named_parameters() if "language_model" in n and "lora_A" in n]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_on_path)


def test_lora_on_off_and_reference_policy():
    obs = observation()
    tokens = make(seed=2).act(obs, SamplingParams())[D.ACTION_TOKENS]
    plain = make(seed=2, lora={**tiny()["lora"], "enabled": False})   # same base weights, no adapters
    with pytest.raises(NotImplementedError):
        with plain.reference_mode():
            pass
    policy = make(seed=2)
    reference = plain.score_actions(obs, tokens)["logprob"]
    # adapters start at zero: the fresh policy is the loaded model
    torch.testing.assert_close(policy.score_actions(obs, tokens)["logprob"], reference, atol=1e-5, rtol=0)
    perturb_adapters(policy)  # LoRA weights and the trainable copies of the value head / proprio projector
    adapted = policy.score_actions(obs, tokens)
    assert (adapted["logprob"] - reference).abs().max() > 1e-3
    with policy.reference_mode():
        in_reference = policy.score_actions(obs, tokens)
    torch.testing.assert_close(in_reference["logprob"], reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(policy.score_actions(obs, tokens)["logprob"], adapted["logprob"])  # back on


def test_trainable_state_round_trip_between_workers():
    actor, rollout = make(seed=3), make(seed=3)
    perturb_adapters(actor)
    state = actor.trainable_state_dict()
    assert all(t.device.type == "cpu" for t in state.values())
    rollout.load_trainable_state_dict(state)
    obs = observation()
    a = actor.act(obs, SamplingParams(greedy=True), return_value=True)
    b = rollout.act(obs, SamplingParams(greedy=True), return_value=True)
    assert torch.equal(a[D.ACTION_TOKENS], b[D.ACTION_TOKENS]) and torch.equal(a[D.VALUE], b[D.VALUE])


def test_env_spec_fills_nulls_for_a_single_camera_stateless_env():
    toy = EnvSpec(action_dim=4, max_episode_steps=24, task_descriptions=["reach red"], camera_names=["main"],
                  image_size=(64, 64), state_dim=0, name="toy_reach")
    policy = make(seed=4, spec=toy, value_type="action_level")
    assert (policy.cfg.num_images_in_input, policy.cfg.use_proprio, policy.action_dim) == (1, False, 4)
    assert policy.tokens_per_decision == 8 * 4 and policy.value_type == "action_level"
    out = policy.act(observation(batch=2, cameras=1, state_dim=0), SamplingParams(), return_value=True)
    assert out[D.ACTION_CHUNK].shape == (2, 8, 4) and out[D.VALUE].shape == (2, 8)


def test_config_errors_name_the_key():
    one_camera = EnvSpec(action_dim=7, max_episode_steps=10, task_descriptions=["t"], camera_names=["main"],
                         state_dim=8, name="x")
    with pytest.raises(ConfigError, match="model.num_images_in_input"):
        make_policy({**load_preset("openvla_oft"), "num_images_in_input": 2}, one_camera)
    with pytest.raises(ConfigError, match="model.action_dim"):
        make_policy(tiny(action_dim=6), SPEC)
    with pytest.raises(ConfigError, match="model.proprio_dim"):
        make_policy(tiny(proprio_dim=9, use_proprio=True), SPEC)
    check = get_policy_builder("openvla_oft").check_config
    check(load_preset("openvla_oft"))
    for bad, key in ((dict(value_type="per_token"), "model.value_type"),
                     (dict(attn_implementation="flash"), "model.attn_implementation"),
                     (dict(image_size=50), "model.image_size"),
                     (dict(vision={**tiny()["vision"], "dino": {**tiny()["vision"]["dino"], "hidden_size": 33}}),
                      "model.vision.dino.hidden_size")):
        with pytest.raises(ConfigError, match=key):
            check(tiny(**bad))
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        make_policy(tiny(lora={**tiny()["lora"], "target_modules": ["no_such_layer"]}), SPEC)


def test_lora_target_names_select_layers():
    policy = make(seed=5, lora={**tiny()["lora"], "target_modules": ["q_proj", "v_proj"]})
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.named_parameters() if ".lora_A." in n}
    assert adapted and all(n.split(".")[-1] in ("q_proj", "v_proj") for n in adapted)
    assert any("language_model" in n for n in adapted) and any("vision.dino" in n for n in adapted)


def test_task_ids_stand_for_instructions():
    tasks = ["put the bowl on the plate", "open the drawer", "turn on the stove"]
    spec = EnvSpec(action_dim=7, max_episode_steps=100, task_descriptions=tasks, camera_names=["agentview", "wrist"],
                   state_dim=8, name="libero_10")
    policy = make(seed=6, spec=spec)
    obs = observation()
    tokens = policy.act(obs, SamplingParams())[D.ACTION_TOKENS]
    by_id = {k: v for k, v in obs.items() if k != "instruction"} | {D.TASK_ID: torch.tensor([0, 1, 2])}
    torch.testing.assert_close(policy.score_actions(by_id, tokens)["logprob"], policy.score_actions(obs, tokens)["logprob"])


def test_observation_errors():
    policy = make(seed=6)
    obs = observation()
    del obs["instruction"]
    with pytest.raises(ValueError, match="instruction"):
        policy.act(obs, SamplingParams())
    obs = observation()
    del obs["state"]
    with pytest.raises(KeyError, match="state"):
        policy.act(obs, SamplingParams())
    with pytest.raises(ValueError, match="outside the action vocabulary"):
        policy.score_actions(observation(), torch.zeros(3, 56, dtype=torch.int64))


def test_gradient_checkpointing_gives_the_same_gradients():
    obs = observation(batch=2)
    grads = []
    for checkpointing in (False, True):
        policy = make(seed=7, gradient_checkpointing=checkpointing).train()
        perturb_adapters(policy, 0.1)
        tokens = policy.act(obs, SamplingParams(greedy=True))[D.ACTION_TOKENS]
        ev = policy.score_actions(obs, tokens)
        (ev["logprob"].sum() + ev[D.VALUE].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4)


def test_bfloat16_model_with_float32_trainable_tensors():
    """The actor keeps trainable tensors (LoRA, heads) in float32 next to a bfloat16 model."""
    policy = make(seed=8, dtype="bfloat16")
    assert policy.core.language_model.model.embed_tokens.weight.dtype == torch.bfloat16
    for param in policy.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    obs = observation(batch=2)
    out = policy.act(obs, SamplingParams(), return_value=True)
    assert out[D.ACTION_CHUNK].dtype == out[D.VALUE].dtype == torch.float32
    ev = policy.score_actions(obs, out[D.ACTION_TOKENS])
    (ev["logprob"].sum() + ev[D.VALUE].sum()).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32
               for n, p in policy.named_parameters() if p.requires_grad and "value_head" in n)
    with policy.reference_mode():
        policy.act(obs, SamplingParams(greedy=True))


def test_all_linear_in_a_list_adds_the_lm_head():
    """``[all-linear, lm_head]``: the forward-path layers of ``all-linear`` plus an adapter on the LM head,
    whose action rows then train (the tiny preset learns from scratch only with it)."""
    def adapted(policy):
        return {n.split(".lora_A", 1)[0] for n, _ in policy.named_parameters() if ".lora_A." in n}

    plain = make(seed=6)
    both = make(seed=6, lora={**tiny()["lora"], "target_modules": ["all-linear", "lm_head"]})
    head = {n for n in adapted(both) if n.endswith("lm_head")}
    assert len(head) == 1 and adapted(both) == adapted(plain) | head
    assert not any(n.endswith("lm_head") for n in adapted(plain))
    # the head's adapter changes the action logits and receives their gradient
    obs = observation()
    tokens = both.act(obs, SamplingParams())[D.ACTION_TOKENS]
    before = both.score_actions(obs, tokens, return_value=False)["logprob"]
    lora_B = next(p for n, p in both.named_parameters() if "lm_head.lora_B" in n)
    before.sum().backward()
    assert lora_B.grad is not None and lora_B.grad.abs().sum() > 0
    with torch.no_grad():
        lora_B.add_(0.5 * torch.randn_like(lora_B))
        after = both.score_actions(obs, tokens, return_value=False)["logprob"]
    assert (after - before.detach()).abs().max() > 1e-3


def test_adapted_lm_head_computes_only_the_action_rows():
    """With a LoRA adapter on the LM head, the action logits are computed from the action ids' rows
    (base and adapter) only; they equal the whole head's logits at those ids, adapter on and off."""
    policy = make(seed=7, lora={**tiny()["lora"], "target_modules": ["all-linear", "lm_head"]})
    core = next(m for m in policy.modules() if hasattr(m, "action_logits"))
    head = core.language_model.lm_head
    tok = core.action_tokenizer
    lora_B = next(p for n, p in policy.named_parameters() if "lm_head.lora_B" in n)
    with torch.no_grad():
        lora_B.add_(torch.randn_like(lora_B))
    hidden = torch.randn(3, 5, head.in_features, dtype=head.weight.dtype)

    def whole():
        return head(hidden)[..., tok.first_id:tok.end_id].float()

    calls = []
    hook = head.register_forward_hook(lambda *args: calls.append(1))
    with torch.no_grad():
        torch.testing.assert_close(core.action_logits(hidden), whole())
        assert len(calls) == 1  # only whole() ran the head
        with policy.reference_mode():
            torch.testing.assert_close(core.action_logits(hidden), whole())
            rows = head.base_layer.weight[tok.first_id:tok.end_id]
            torch.testing.assert_close(core.action_logits(hidden), torch.nn.functional.linear(hidden, rows).float())
    hook.remove()
