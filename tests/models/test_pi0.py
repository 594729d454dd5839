"""π0 on transformers' PI0ForConditionalGeneration (embodirl/models/pi0/): the policy's chain is the library's, its
log-probabilities are the closed-form Gaussians of πRL's Flow-SDE / Flow-Noise as RLinf computes them, its SFT loss is
the library's, its value head is RLinf's critic (the expert's output, detached), and a saved checkpoint acts as the
policy that wrote it. Each test names, in its docstring or beside the assertion, the mistake it catches."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from embodirl import data as D
from embodirl.envs.base import EnvSpec
from embodirl.models.base import SamplingParams
from embodirl.models.pi0 import flow
from embodirl.models.registry import make_policy, model_config

SPEC = EnvSpec(action_dim=7, max_episode_steps=24, task_descriptions=["reach the red square", "push the cube left"],
               camera_names=["main", "wrist"], image_size=(64, 64), state_dim=5, name="spec")


#: the LoRA option (adapters on every linear layer, nothing trained in full): the reference policy is the adapters off
LORA = ("model.train_expert=false", "model.lora.enabled=true")


def _policy(compose_cfg, *overrides, seed=0, spec=SPEC):
    cfg = compose_cfg("model=pi0_tiny", *overrides)
    torch.manual_seed(seed)
    return make_policy(cfg.model, spec), cfg


def _obs(batch=4, seed=1, spec=SPEC):
    g = torch.Generator().manual_seed(seed)
    return {D.IMAGES: torch.randint(0, 256, (batch, len(spec.camera_names), 3, 64, 64), dtype=torch.uint8, generator=g),
            D.STATE: torch.randn(batch, spec.state_dim, generator=g),
            D.TASK_ID: torch.arange(batch) % len(spec.task_descriptions)}


def _noise(policy, batch, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, policy.chunk_size, policy.max_action_dim, generator=g)


def _perturb_adapters(policy, seed=3, scale=0.05, lora_only=False):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if p.requires_grad and (".lora_" in name or not lora_only):
                p.add_(scale * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("method", flow.METHODS)
def test_greedy_actions_are_transformers_sample_actions_bit_for_bit(compose_cfg, method):
    """With RL noise off the chain is ``PI0ForConditionalGeneration.sample_actions``'s for the same starting noise:
    the same Euler steps over the same cached prefix (float32, adapters trained away from zero so they take part)."""
    policy, _ = _policy(compose_cfg, f"model.flow.method={method}")
    _perturb_adapters(policy)
    obs, noise = _obs(), _noise(policy, 4)
    out = policy.act(obs, SamplingParams(greedy=True), noise=noise)
    inputs = policy.prepare_inputs(obs)
    reference = policy.network.sample_actions(inputs["state"], inputs["input_ids"], inputs["pixel_values"],
                                              noise=noise.clone(), attention_mask=inputs["attention_mask"],
                                              pixel_attention_mask=inputs["pixel_attention_mask"],
                                              num_steps=policy.num_steps)
    H, A = policy.action_chunk, policy.action_dim
    expected = reference[:, :H, :A].clamp(-1.0, 1.0)         # identity statistics; the env's bounds are [-1, 1]
    assert torch.equal(out[D.ACTION_CHUNK], expected)
    if method == flow.FLOW_NOISE:                               # the stored chain ends at the library's answer
        assert torch.equal(out[D.ACTION_CHAIN].reshape(4, policy.num_steps + 1, -1)[:, -1], reference.reshape(4, -1))
    # and a sampled decision is not the greedy one
    sampled = policy.act(obs, SamplingParams(), noise=noise)
    assert not torch.equal(sampled[D.ACTION_CHUNK], out[D.ACTION_CHUNK])


def test_a_greedy_decision_starts_from_a_draw_seeded_by_its_observation(compose_cfg):
    """Evaluation's chain starts from a Gaussian draw, as ``sample_actions`` and RLinf's evaluation do (not from
    zero, which no training chain starts from), seeded by the decision's own observation: the same decision whatever
    the global generator's state and the rest of its batch, and another start for another observation."""
    policy, _ = _policy(compose_cfg, "model.flow.method=flow_noise")
    _perturb_adapters(policy)
    obs = _obs()
    torch.manual_seed(11)
    first = policy.act(obs, SamplingParams(greedy=True))
    torch.manual_seed(12)
    again = policy.act(obs, SamplingParams(greedy=True))
    assert torch.equal(first[D.ACTION_CHUNK], again[D.ACTION_CHUNK])
    chain = first[D.ACTION_CHAIN].reshape(4, policy.num_steps + 1, policy.chunk_size, policy.max_action_dim)
    start = chain[:, 0]
    assert abs(start.std().item() - 1.0) < 0.1 and abs(start.mean().item()) < 0.1       # a draw of N(0, I)
    assert not torch.equal(start[0], start[1])                                          # one per observation
    # the rows of a batch in another order and company: each row's decision is its own
    order = torch.tensor([2, 0])
    pair = policy.act({k: v[order] for k, v in obs.items()}, SamplingParams(greedy=True))[D.ACTION_CHUNK]
    torch.testing.assert_close(pair, first[D.ACTION_CHUNK][order], rtol=1e-5, atol=1e-6)
    # the same images with another state: another start
    moved = dict(obs, **{D.STATE: obs[D.STATE] + 1.0})
    other = policy.act(moved, SamplingParams(greedy=True))[D.ACTION_CHAIN].reshape(chain.shape)[:, 0]
    assert not torch.equal(other, start)


def test_flow_sde_logprob_is_the_closed_form_gaussian_of_its_step(compose_cfg):
    """The behaviour log-prob of a Flow-SDE decision is log N(x_{k+1}; mu, s^2) of its drawn step, with mu and s
    written out here from πRL's equations and the velocity read from the library's forward."""
    policy, _ = _policy(compose_cfg, "model.flow.method=flow_sde", "model.flow.noise_level=0.7")
    _perturb_adapters(policy)
    obs = _obs(batch=6)
    torch.manual_seed(5)
    out = policy.act(obs, SamplingParams())
    K, a = policy.num_steps, 0.7
    chain = out[D.ACTION_CHAIN]
    width = policy.chunk_size * policy.max_action_dim
    steps = chain[:, 0].long()
    assert len(set(steps.tolist())) > 1                        # the drawn step differs between decisions
    x = chain[:, 1:1 + width].reshape(6, policy.chunk_size, -1)
    x_next = chain[:, 1 + width:].reshape(6, policy.chunk_size, -1)
    inputs = policy.prepare_inputs(obs)
    expected = []
    for b in range(6):
        k = int(steps[b])
        t, delta = 1.0 - k / K, 1.0 / K
        one = {key: v[b:b + 1] for key, v in inputs.items()}
        v = policy.network(state=one["state"], noise=x[b:b + 1], timestep=torch.tensor([t]),
                           input_ids=one["input_ids"], pixel_values=one["pixel_values"],
                           attention_mask=one["attention_mask"],
                           pixel_attention_mask=one["pixel_attention_mask"]).logits[0].double()
        gap = 1.0 / K if k == 0 else 1.0 - t                   # at t = 1 the next grid time's 1 - t
        sigma = a * math.sqrt(t / gap)
        xb = x[b].double()
        mean = (xb - v * t) * (1 - t + delta) + (xb + v * (1 - t)) * (t - delta - sigma ** 2 * delta / (2 * t))
        std = math.sqrt(delta) * sigma
        logprob = torch.distributions.Normal(mean, std).log_prob(x_next[b].double())
        expected.append(logprob[: policy.action_chunk, : policy.action_dim].reshape(-1))
    assert torch.allclose(out[D.LOGPROB_BEHAVIOR].double(), torch.stack(expected), atol=2e-4, rtol=1e-4)
    # with sigma = 0 a Flow-SDE step is the Euler step
    xs, vs, ts = torch.randn(3, 4), torch.randn(3, 4), torch.tensor([[0.8], [0.5], [0.2]])
    mean, std = flow.sde_transition(xs, vs, ts, 0.1, torch.zeros_like(ts))
    assert torch.allclose(mean, xs - 0.1 * vs, atol=1e-6) and bool((std == 0).all())


@pytest.mark.parametrize("trainable", ["expert", "lora"])
@pytest.mark.parametrize("method", flow.METHODS)
def test_evaluate_scores_what_act_sampled(compose_cfg, method, trainable):
    """The actor's recomputation of a decision's log-prob and value equals the rollout's (the first minibatch's ratio
    is 1), in batches of another composition; it has a gradient; with LoRA the reference (adapters off) differs once
    trained, with the expert trained in full there is none."""
    policy, _ = _policy(compose_cfg, f"model.flow.method={method}", *(LORA if trainable == "lora" else ()))
    obs = _obs(batch=6)
    torch.manual_seed(7)
    out = policy.act(obs, SamplingParams(), return_value=True)
    for rows in (slice(0, 6), slice(1, 4)):
        part = {k: v[rows] for k, v in obs.items()}
        ev = policy.score_actions(part, out[D.ACTION_CHAIN][rows])
        torch.testing.assert_close(ev["logprob"], out[D.LOGPROB_BEHAVIOR][rows], atol=1e-5, rtol=0)
        torch.testing.assert_close(ev[D.VALUE], out[D.VALUE][rows], atol=1e-5, rtol=0)
        assert ev["entropy"].shape == ev["logprob"].shape == (rows.stop - rows.start, 4 * 7)
    ev["logprob"].sum().backward()
    grads = [p.grad for p in policy.parameters() if p.requires_grad and p.grad is not None]
    assert grads and any(bool(g.abs().sum() > 0) for g in grads)
    if trainable == "expert":
        with pytest.raises(NotImplementedError, match="model.train_expert"):
            with policy.reference_mode():
                pass
        return
    _perturb_adapters(policy, lora_only=True)      # the heads train in place: the reference shares them
    with torch.no_grad():
        trained = policy.score_actions(obs, out[D.ACTION_CHAIN])["logprob"]
        with policy.reference_mode():
            reference = policy.score_actions(obs, out[D.ACTION_CHAIN])["logprob"]
    assert not torch.allclose(trained, reference)
    torch.testing.assert_close(reference, out[D.LOGPROB_BEHAVIOR], atol=1e-5, rtol=0)


def test_a_saved_checkpoint_loads_with_from_pretrained_and_acts_the_same(compose_cfg, tmp_path):
    """save_pretrained writes transformers' layout (LoRA folded in) with the statistics and heads; model.path reads it
    back and the policy acts as the one that wrote it (the fold changes rounding only)."""
    from transformers import PI0ForConditionalGeneration

    policy, cfg = _policy(compose_cfg, "model.flow.method=flow_noise")
    _perturb_adapters(policy)
    stats = {"state_mean": [0.1] * 5, "state_std": [2.0] * 5, "actions_mean": [0.05] * 7, "actions_std": [0.5] * 7}
    policy.set_statistics(stats)
    folder = policy.save_pretrained(tmp_path / "pi0", step=3)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    plain = PI0ForConditionalGeneration.from_pretrained(str(folder))
    assert plain.config.chunk_size == policy.chunk_size
    model = model_config(cfg.model)
    loaded = make_policy(dataclasses.replace(model, path=str(folder),
                                             flow=dataclasses.replace(model.flow, method="flow_noise")), SPEC)
    assert loaded.statistics == stats
    obs, noise = _obs(), _noise(policy, 4)
    a = policy.act(obs, SamplingParams(greedy=True), return_value=True, noise=noise)
    b = loaded.act(obs, SamplingParams(greedy=True), return_value=True, noise=noise)
    for key in (D.ACTION_CHUNK, D.VALUE, D.LOGPROB_BEHAVIOR):
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=1e-4)
    # the statistics act: a policy without them answers differently
    fresh, _ = _policy(compose_cfg, "model.flow.method=flow_noise")
    assert not torch.allclose(fresh.act(obs, SamplingParams(greedy=True), noise=noise)[D.ACTION_CHUNK],
                              a[D.ACTION_CHUNK])


def test_bad_pi0_input_is_one_sentence(compose_cfg, tmp_path):
    from embodirl.errors import ConfigError
    from embodirl.models.registry import get_policy_builder

    cfg = compose_cfg("model=pi0_tiny", "model.expert.num_hidden_layers=3")
    with pytest.raises(ConfigError, match="model.expert.num_hidden_layers"):
        get_policy_builder("pi0").check_config(cfg.model)
    at_tmp = dataclasses.replace(model_config(compose_cfg("model=pi0_tiny").model), path=str(tmp_path))
    with pytest.raises(ConfigError, match="model.path"):
        get_policy_builder("pi0").check_config(at_tmp)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="model.path"):
        make_policy(at_tmp, SPEC)
    long = EnvSpec(**{**SPEC.__dict__, "task_descriptions": [" ".join(["word"] * 40)]})
    with pytest.raises(ConfigError, match="model.max_prompt_tokens"):
        _policy(compose_cfg, spec=long)


@pytest.mark.parametrize("trainable", ["expert", "lora"])
@pytest.mark.parametrize("method", flow.METHODS)
def test_gradient_checkpointing_gives_the_same_gradients(compose_cfg, method, trainable):
    """The actor's gradient checkpointing (every transformer block recomputed in backward) on π0, whose VLM layers write
    the cache the expert reads: the recomputation must not write the prefix twice nor see another pass's chunk
    (embodirl/models/pi0/cache.py). Same log-probs, same gradients as without it, with the VLM's adapters training
    and with the VLM frozen."""
    from embodirl.actor import fsdp

    grads = []
    for checkpointing in (False, True):
        policy, _ = _policy(compose_cfg, f"model.flow.method={method}", *(LORA if trainable == "lora" else ()))
        _perturb_adapters(policy)
        if checkpointing:
            assert fsdp.enable_gradient_checkpointing(fsdp.shard_units(policy)) > 0
        obs = _obs(batch=3)
        torch.manual_seed(11)
        chain = policy.act(obs, SamplingParams())[D.ACTION_CHAIN]
        policy.zero_grad()
        out = policy.score_actions(obs, chain)
        (out["logprob"].sum() + out[D.VALUE].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    if trainable == "lora":
        assert any(".lora_" in n and "vlm.language_model" in n for n in grads[0])
    else:
        assert any("model.dit.layers" in n for n in grads[0]) and not any(".vlm." in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


def test_a_merged_copy_acts_as_the_adapted_policy_across_weight_updates(compose_cfg):
    """rollout.merge_lora on π0: an inference copy that folds the adapters into its weights acts as the policy with
    the adapters beside them, and again after a weight update re-merges from the originals."""
    policy, _ = _policy(compose_cfg, "model.flow.method=flow_noise", *LORA)
    copy, _ = _policy(compose_cfg, "model.flow.method=flow_noise", *LORA)
    obs, noise = _obs(), _noise(policy, 4)
    for seed in (3, 4):
        _perturb_adapters(policy, seed=seed)
        copy.load_trainable_state_dict(policy.trainable_state_dict())
        copy.merge_adapters_()
        a = policy.act(obs, SamplingParams(greedy=True), return_value=True, noise=noise)
        b = copy.act(obs, SamplingParams(greedy=True), return_value=True, noise=noise)
        for key in (D.ACTION_CHUNK, D.ACTION_CHAIN, D.VALUE):
            torch.testing.assert_close(b[key], a[key], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(a[D.ACTION_CHAIN], _policy(compose_cfg, "model.flow.method=flow_noise", *LORA)[0].act(
        obs, SamplingParams(greedy=True), noise=noise)[D.ACTION_CHAIN])


def test_the_network_and_flow_keys_shape_what_is_built(compose_cfg):
    """model.flow.noise_std_range / noise_head_hidden_sizes, model.max_state_dim and the expert's key/value heads do
    what the YAML says: the noise head's layers and the standard deviations it produces, the state width, and a
    mismatch with the VLM's cache refused in one sentence."""
    from embodirl.errors import ConfigError
    from embodirl.models.registry import get_policy_builder

    policy, _ = _policy(compose_cfg, "model.flow.method=flow_noise", "model.flow.noise_std_range=[0.2,0.3]",
                        "model.flow.noise_head_hidden_sizes=[16,8]", "model.max_state_dim=12", "model.lora.dropout=0.1",
                        *LORA)
    assert [m.out_features for m in policy.noise_head.mlp if isinstance(m, torch.nn.Linear)] == [16, 8, 8]
    assert policy.state_mean.shape == (12,) and policy.network.config.max_state_dim == 12
    obs = _obs()
    entropy = policy.score_actions(obs, policy.act(obs, SamplingParams())[D.ACTION_CHAIN])["entropy"]
    # the mean over the steps of log std, per element (joint_logprob: the prior's std 1 is one more term)
    log_std = (entropy - 0.5 - 0.5 * math.log(2 * math.pi)) * (policy.num_steps + 1) / policy.num_steps
    std = torch.exp(log_std)
    assert bool((std >= 0.2 - 1e-5).all() and (std <= 0.3 + 1e-5).all())
    lora = next(m for m in policy.modules() if hasattr(m, "lora_dropout"))
    assert lora.lora_dropout["default"].p == 0.1
    cfg = compose_cfg("model=pi0_tiny", "model.expert.num_key_value_heads=2")
    with pytest.raises(ConfigError, match="model.expert.num_key_value_heads"):
        get_policy_builder("pi0").check_config(cfg.model)
    with pytest.raises(ConfigError, match="model.max_state_dim"):
        _policy(compose_cfg, "model.max_state_dim=4")


@pytest.mark.parametrize("target", ["expert", "vlm", "all-linear", "q_proj"])
def test_lora_target_modules_adapt_the_part_they_name(compose_cfg, target):
    """``model.lora.target_modules``: ``expert`` adapts every linear layer of the action expert and the action/time
    projections and nothing of the VLM, ``vlm`` the vision tower and the VLM and nothing of the expert, ``all-linear``
    both, a layer name every layer of that name; only the adapters of those layers (and the heads) train."""
    from peft.tuners.lora import LoraLayer

    policy, _ = _policy(compose_cfg, f"model.lora.target_modules={target}", *LORA)
    base = policy.pi0.base_model.model              # the peft wrapper's network
    linears = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and not isinstance(m, LoraLayer)
               and ".lora_" not in n and ".base_layer" not in n}
    adapted = {n for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    expert_part = {n for n in linears | adapted if n.startswith(("model.dit.", "embed_action_time.", "action_out_proj"))}
    vlm_part = {n for n in linears | adapted if n.startswith("model.vlm.")}
    wanted = {"expert": expert_part, "vlm": vlm_part, "all-linear": expert_part | vlm_part,
              "q_proj": {n for n in linears | adapted if n.endswith(".q_proj")}}[target]
    assert adapted == wanted and wanted
    assert any(n.startswith("model.vlm.vision_tower.") for n in adapted) == (target in ("vlm", "all-linear", "q_proj"))
    trained = {n.split(".lora_")[0].removeprefix("pi0.base_model.model.")
               for n, p in policy.named_parameters() if p.requires_grad and ".lora_" in n}
    assert trained == adapted


# --- RLinf's recipe: what trains, the critic, Flow-Noise --------------------------------------------------------------
def _expert_pass(policy, inputs, x, t):
    """The expert's features ``[B, chunk, W]`` and velocity at chain state ``x`` and times ``t`` ``[B]``, through
    transformers' own forward (``PI0Model.forward`` computes the prefix itself): independent of the policy's caches."""
    net = policy.network
    embeds = net.embed_action_time(inputs["state"], x, t)
    hidden = net.model(action_embeds=embeds, input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"],
                       attention_mask=inputs["attention_mask"],
                       pixel_attention_mask=inputs["pixel_attention_mask"]).last_hidden_state[:, -policy.chunk_size:]
    return hidden, net.action_out_proj(hidden)


def test_the_expert_trains_in_full_and_the_vlm_stays_frozen(compose_cfg):
    """RLinf's ``train_expert_only: True, is_lora: False``: the expert's Gemma layers and final norm, its action, state
    and time projections and the velocity head train (not the expert's token embedding, which π0 never reads), with
    the heads; nothing of PaliGemma (vision tower, projector, Gemma 2B) does. LoRA stays an option, on the VLM only
    while the expert trains in full."""
    from embodirl.errors import ConfigError
    from embodirl.models.registry import get_policy_builder

    policy, _ = _policy(compose_cfg, "model.flow.method=flow_noise", "algorithm=ppo")
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    heads = {n for n in trained if n.startswith(("value_head.", "noise_head."))}
    network = {n.removeprefix("pi0.") for n in trained - heads}
    expert = {n for n, _ in policy.network.named_parameters()
              if n.startswith(("model.dit.", "embed_action_time.", "action_out_proj."))}
    assert network == expert - {"model.dit.embed_tokens.weight"}
    assert heads and not any(".vlm." in n for n in trained)
    adapted, _ = _policy(compose_cfg, "model.lora.enabled=true", "model.lora.target_modules=vlm")
    names = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert any(".lora_" in n and ".vlm." in n for n in names) and any("model.dit.layers" in n and ".lora_" not in n
                                                                      for n in names)
    with pytest.raises(ConfigError, match="model.lora.target_modules.*model.train_expert"):
        _policy(compose_cfg, "model.lora.enabled=true")                      # all-linear: the expert too
    with pytest.raises(ConfigError, match="model.lora.target_modules.*model.train_expert"):   # before workers start
        get_policy_builder("pi0").check_config(compose_cfg("model=pi0_tiny", "model.lora.enabled=true").model)


def test_flow_noise_std_is_squashed_linearly_in_log_variance():
    """RLinf's ExploreNoiseNet.post_process: tanh, then linear onto [log(min^2), log(max^2)]: at raw 0 the std is the
    geometric mean of the range (a squash linear in std gives the arithmetic mean, 0.12)."""
    raw = torch.tensor([-50.0, 0.0, 50.0, math.atanh(0.5)])
    std = flow.log_variance_std(raw, 0.08, 0.16)
    expected = [0.08, math.sqrt(0.08 * 0.16), 0.16, math.exp(0.5 * (math.log(0.08 ** 2) + 0.75 * math.log(4.0)))]
    torch.testing.assert_close(std, torch.tensor(expected), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("joint", [True, False])
def test_flow_noise_logprob_is_the_closed_form_of_rlinfs_chain(compose_cfg, joint):
    """The behaviour log-prob of a Flow-Noise decision, written out here from RLinf's formulas
    (rlinf/models/embodiment/openpi/openpi_action_model.py and modules/explore_noise_net.py @ 558aeb38): every step
    k is N(x_k - v_k / K, s_k^2) with s_k = exp(log_var / 2), log_var = log(0.08^2) + (log(0.16^2) - log(0.08^2)) (tanh(
    raw_k) + 1) / 2 and raw_k the noise head's MLP on the expert's features; with joint_logprob the mean over
    log N(x_0; 0, 1) and the K steps, else over the K steps. Velocity and features from transformers' forward."""
    policy, _ = _policy(compose_cfg, "model.flow.method=flow_noise", f"model.flow.joint_logprob={str(joint).lower()}")
    _perturb_adapters(policy)
    obs = _obs(batch=3)
    torch.manual_seed(5)
    out = policy.act(obs, SamplingParams())
    K = policy.num_steps
    chain = out[D.ACTION_CHAIN].reshape(3, K + 1, policy.chunk_size, policy.max_action_dim).double()
    inputs = policy.prepare_inputs(obs)
    low, high = math.log(0.08 ** 2), math.log(0.16 ** 2)
    total = torch.distributions.Normal(0.0, 1.0).log_prob(chain[:, 0]) if joint else torch.zeros_like(chain[:, 0])
    with torch.no_grad():
        for k in range(K):
            t = torch.full((3,), 1.0 - k / K)
            hidden, v = _expert_pass(policy, inputs, chain[:, k].float(), t)
            raw = policy.noise_head.mlp(hidden).double()
            std = torch.exp(0.5 * (low + (high - low) * (torch.tanh(raw) + 1.0) / 2.0))
            mean = chain[:, k] - v.double() / K
            total = total + torch.distributions.Normal(mean, std).log_prob(chain[:, k + 1])
    expected = (total / (K + 1 if joint else K))[:, : policy.action_chunk, : policy.action_dim].reshape(3, -1)
    torch.testing.assert_close(out[D.LOGPROB_BEHAVIOR].double(), expected, atol=2e-4, rtol=1e-5)
    # the actor re-scores it the same way
    torch.testing.assert_close(policy.score_actions(obs, out[D.ACTION_CHAIN])["logprob"], out[D.LOGPROB_BEHAVIOR],
                               atol=1e-5, rtol=0)


def test_the_value_is_rlinfs_critic_on_the_experts_output_at_the_scored_step(compose_cfg):
    """RLinf's π0 critic (value_after_vlm False): the value head on the expert's output averaged over all chunk
    positions, from the pass the log-probability scores (Flow-SDE: the drawn step, so act and score_actions agree); a ReLU
    MLP whose last layer starts N(0, 0.02) with a zero bias, the hidden layers Kaiming-normal (fan out)."""
    from embodirl.models.pi0.heads import ValueHead

    policy, _ = _policy(compose_cfg, "model.flow.method=flow_sde")
    _perturb_adapters(policy)
    obs = _obs(batch=6)
    torch.manual_seed(9)
    out = policy.act(obs, SamplingParams(), return_value=True)
    width = policy.chunk_size * policy.max_action_dim
    chain = out[D.ACTION_CHAIN]
    steps = chain[:, 0].long()
    assert len(set(steps.tolist())) > 1
    x = chain[:, 1:1 + width].reshape(6, policy.chunk_size, -1)
    inputs = policy.prepare_inputs(obs)
    with torch.no_grad():
        hidden, _ = _expert_pass(policy, inputs, x, 1.0 - steps.float() / policy.num_steps)
        expected = policy.value_head.mlp(hidden.mean(1))[:, 0]
    torch.testing.assert_close(out[D.VALUE], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(policy.score_actions(obs, chain)[D.VALUE], out[D.VALUE], atol=1e-5, rtol=0)
    head = ValueHead(1024, [512, 256, 128], 1)
    linears = [m for m in head.mlp if isinstance(m, torch.nn.Linear)]
    assert [type(m) for m in head.mlp if not isinstance(m, torch.nn.Linear)] == [torch.nn.ReLU] * 3
    assert abs(linears[-1].weight.std().item() - 0.02) < 0.005 and not linears[-1].bias.any()
    assert abs(linears[0].weight.std().item() - math.sqrt(2 / 512)) < 0.005 and not linears[0].bias.any()


@pytest.mark.parametrize("features", ["expert", "vlm_prefix"])
def test_a_detached_value_head_sends_no_gradient_into_the_network(compose_cfg, features):
    """``model.value_head.detach`` (RLinf's detach_critic_input): with every weight trainable (as
    actor.fsdp.full_finetune makes them), the value loss's gradient reaches the value head and nothing of the VLM or
    the expert; without it, it reaches the VLM (the expert reads the VLM's keys and values)."""
    for detach in (True, False):
        policy, _ = _policy(compose_cfg, "model.flow.method=flow_sde", f"model.value_head.features={features}",
                            f"model.value_head.detach={str(detach).lower()}")
        policy.requires_grad_(True)
        obs = _obs(batch=3)
        torch.manual_seed(4)
        chain = policy.act(obs, SamplingParams())[D.ACTION_CHAIN]
        policy.score_actions(obs, chain)[D.VALUE].sum().backward()
        reached = {n for n, p in policy.network.named_parameters() if p.grad is not None and bool(p.grad.abs().sum())}
        assert all(p.grad is not None and bool(p.grad.abs().sum()) for p in policy.value_head.parameters())
        if detach:
            assert not reached, sorted(reached)[:5]
        else:
            assert any(".vlm.language_model." in n for n in reached)
            assert any("model.dit." in n for n in reached) == (features == "expert")


def test_the_sft_loss_is_transformers_forward_loss(compose_cfg):
    """``supervised`` is ``PI0ForConditionalGeneration.forward(..., actions=...)``'s flow-matching loss: the same time
    (Beta(1.5, 1) scaled into [0.001, 1]) and noise draws from the same generator state, the same interpolation and
    target ``noise - actions``; its squared error summed over the real ``[H', A]`` part of the padded chunk."""
    import torch.nn.functional as F

    policy, _ = _policy(compose_cfg)
    _perturb_adapters(policy)
    obs = _obs(batch=3)
    actions = torch.randn(3, 6, 7, generator=torch.Generator().manual_seed(8))      # H' = 6 of 8, A = 7 of 8
    torch.manual_seed(21)
    ours = policy.supervised(obs, actions)
    inputs = policy.prepare_inputs(obs)
    net = policy.network
    net.config.loss_reduction = "none"
    torch.manual_seed(21)
    reference = net(state=inputs["state"], input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"],
                    attention_mask=inputs["attention_mask"], pixel_attention_mask=inputs["pixel_attention_mask"],
                    actions=F.pad(actions, (0, 1, 0, 2))).loss                          # (3, 8, 8) squared errors
    torch.testing.assert_close(ours["ce_sum"], reference[:, :6, :7].sum(), atol=1e-5, rtol=1e-5)
    assert float(ours["labels"]) == 3 * 6 * 7
    ours["ce_sum"].backward()
    assert any(p.grad is not None and bool(p.grad.abs().sum()) for p in policy.parameters())


@pytest.mark.parametrize("copy", ["merged", pytest.param("compiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("method", flow.METHODS)
def test_merged_and_compiled_copies_sample_and_score_as_the_plain_policy(compose_cfg, copy, method):
    """rollout.merge_lora and rollout.compile on π0 (CPU half of issue 57 item 8): from the same starting noise and
    generator state, an inference copy with its adapters folded in, or with its transformer blocks compiled (inductor),
    samples the same chain, actions, log-probs and values as the plain policy. Not bit for bit: folding computes
    (W + s B A) x instead of W x + s B (A x), and inductor fuses and reorders the float32 work; each rounds at ~1e-7
    relative per operation, which ~10 layers and 4 steps grow to ~1e-6 (measured: <= 5e-7 on actions and values,
    <= 1e-6 on log-probs). The log-prob divides the chain's error by the step's std (~0.1), hence its looser bound;
    folding the adapters in while leaving them on moves them by 1e-2 or more. A merged copy also re-scores the chain
    as the plain policy does (the actor's side of the ratio).

    Compiled, every block runs compiled: the blocks share one forward, so dynamo's compiled variants of it are one per
    Gemma layer (each indexes the cache with its own layer_idx) and more per batch size; under dynamo's default limit
    of 8 per code object all but 8 of the full model's 36 Gemma layers ran uncompiled. Here the limit starts at 2,
    below this tiny model's variants, and compile_blocks_ must raise it so that dynamo refuses no frame. 10-60 s."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    policy, _ = _policy(compose_cfg, f"model.flow.method={method}", "algorithm=ppo", *LORA)
    other, _ = _policy(compose_cfg, f"model.flow.method={method}", "algorithm=ppo", *LORA)
    _perturb_adapters(policy)
    other.load_trainable_state_dict(policy.trainable_state_dict())
    obs, noise = _obs(), _noise(policy, 4)
    outputs = []
    with torch._dynamo.config.patch(recompile_limit=2, accumulated_recompile_limit=2):
        if copy == "merged":
            other.merge_adapters_()
        else:
            torch._dynamo.reset()
            counters.clear()
            assert other.compile_blocks_() == 6
        for p in (policy, other):
            torch.manual_seed(13)
            outputs.append(p.act(obs, SamplingParams(), return_value=True, noise=noise))
    plain, copied = outputs
    for key, tol in ((D.ACTION_CHUNK, 1e-5), (D.ACTION_CHAIN, 1e-5), (D.VALUE, 1e-5), (D.LOGPROB_BEHAVIOR, 1e-4)):
        torch.testing.assert_close(copied[key], plain[key], atol=tol, rtol=0, msg=key)
    if copy == "merged":
        ev = [p.score_actions(obs, plain[D.ACTION_CHAIN])["logprob"].detach() for p in (policy, other)]
        torch.testing.assert_close(ev[1], ev[0], atol=1e-4, rtol=0)
    else:
        assert counters["frames"]["ok"] > 2 and counters["frames"]["total"] == counters["frames"]["ok"]
