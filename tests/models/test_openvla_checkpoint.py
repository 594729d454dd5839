"""Checkpoint I/O: the public OpenVLA-OFT layout in, our checkpoints out and back bit for bit, errors as sentences.

The public checkpoint here is written by the test itself from a model built directly, with the original
Prismatic/timm parameter names spelled out below (independently of the loader's mapping table).
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from embodirl.envs.base import EnvSpec
from embodirl.errors import ConfigError
from embodirl.models.base import SamplingParams
from embodirl.models.openvla_oft import build_policy
from embodirl.models.openvla_oft.hf_checkpoint import CheckpointError, CheckpointFileMissing
from embodirl.models.openvla_oft.modeling import build_model
from embodirl.models.openvla_oft.resolve import build_config, load_preset
from embodirl.models.processor import ImageProcessor

SPEC = EnvSpec(action_dim=7, max_episode_steps=100, task_descriptions=["t"], camera_names=["agentview", "wrist"],
               image_size=(64, 64), state_dim=8, name="libero_10")
STATS = {"libero_10_no_noops": {
    "action": {"q01": [-0.9, -0.8, -0.9, -0.1, -0.2, -0.3, -1.0], "q99": [0.9, 0.8, 0.9, 0.1, 0.2, 0.3, 1.0],
               "mask": [True] * 6 + [False]},
    "proprio": {"q01": [-0.5] * 8, "q99": [0.5] * 8, "mask": [True] * 8}, "num_transitions": 10},
    "libero_90_no_noops": {"action": {"q01": [-1.0] * 7, "q99": [1.0] * 7},
                           "proprio": {"q01": [-1.0] * 8, "q99": [1.0] * 8}}}
INSTRUCTIONS = ["put the bowl on the plate", "open the drawer"]


def tiny(**overrides):
    raw = load_preset("openvla_oft_tiny")
    raw.update(overrides)
    return raw


# --- the public layout, spelled out ------------------------------------------------------------------
def prismatic_state(model) -> dict[str, torch.Tensor]:
    """Our freshly built (unwrapped) model under the public Prismatic/timm names."""
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {}
    dino, siglip = "vision_backbone.featurizer.", "vision_backbone.fused_featurizer."
    e = "vision.dino.embeddings."
    out[dino + "cls_token"] = sd[e + "cls_token"]
    out[dino + "reg_token"] = sd[e + "register_tokens"]
    out[dino + "pos_embed"] = sd[e + "position_embeddings"][:, 1:]
    out[siglip + "pos_embed"] = sd["vision.siglip.embeddings.position_embedding.weight"][None]
    for wb in ("weight", "bias"):
        out[f"{dino}patch_embed.proj.{wb}"] = sd[f"{e}patch_embeddings.projection.{wb}"]
        out[f"{dino}norm.{wb}"] = sd[f"vision.dino.layernorm.{wb}"]
        out[f"{siglip}patch_embed.proj.{wb}"] = sd[f"vision.siglip.embeddings.patch_embedding.{wb}"]
        out[f"{siglip}norm.{wb}"] = sd[f"vision.siglip.post_layernorm.{wb}"]
        h = "vision.siglip.head."
        out[f"{siglip}attn_pool.q.{wb}"], out[f"{siglip}attn_pool.kv.{wb}"] = torch.split(
            sd[f"{h}attention.in_proj_{wb}"], [48, 96])
        for timm_name, ours in (("proj", "attention.out_proj"), ("norm", "layernorm"), ("mlp.fc1", "mlp.fc1"),
                                ("mlp.fc2", "mlp.fc2")):
            out[f"{siglip}attn_pool.{timm_name}.{wb}"] = sd[f"{h}{ours}.{wb}"]
    out[siglip + "attn_pool.latent"] = sd["vision.siglip.head.probe"]
    for tower, ours_prefix, names, n in (
            (dino, "vision.dino.encoder.layer", ("norm1", "norm2", "attention", "o_proj"), 3),
            (siglip, "vision.siglip.encoder.layers", ("layer_norm1", "layer_norm2", "self_attn", "out_proj"), 3)):
        norm1, norm2, attn, out_proj = names
        for i in range(n):
            o, t = f"{ours_prefix}.{i}.", f"{tower}blocks.{i}."
            for wb in ("weight", "bias"):
                out[f"{t}norm1.{wb}"] = sd[f"{o}{norm1}.{wb}"]
                out[f"{t}norm2.{wb}"] = sd[f"{o}{norm2}.{wb}"]
                out[f"{t}attn.qkv.{wb}"] = torch.cat([sd[f"{o}{attn}.{x}_proj.{wb}"] for x in "qkv"])
                out[f"{t}attn.proj.{wb}"] = sd[f"{o}{attn}.{out_proj}.{wb}"]
                out[f"{t}mlp.fc1.{wb}"] = sd[f"{o}mlp.fc1.{wb}"]
                out[f"{t}mlp.fc2.{wb}"] = sd[f"{o}mlp.fc2.{wb}"]
            if tower == dino:
                out[f"{t}ls1.scale_factor"] = sd[f"{o}layer_scale1.lambda1"]
                out[f"{t}ls2.scale_factor"] = sd[f"{o}layer_scale2.lambda1"]
    for name, tensor in sd.items():
        if name.startswith(("projector.", "language_model.")):
            out[name] = tensor
    return out


def write_shards(state, directory, extra=None):
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, keys in halves.items():
        shard = {k: state[k].contiguous() for k in keys}
        if extra and fname.startswith("model-00001"):
            shard.update(extra)
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in "In : What action should the robot take to put the bowl on plate open drawer ? Out".split():
        vocab.setdefault(word, len(vocab))
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>") \
        .save_pretrained(directory)


def write_public_checkpoint(directory, model, *, weights=True, extra=None):
    directory.mkdir(parents=True)
    if weights:
        write_shards(prismatic_state(model), directory, extra)
        (directory / "config.json").write_text(json.dumps({
            "architectures": ["OpenVLAForActionPrediction"], "model_type": "openvla",
            "vision_backbone_id": "dinosiglip-vit-so-224px", "llm_backbone_id": "llama2-7b-pure",
            "use_fused_vision_backbone": True, "image_sizes": [56, 56], "n_action_bins": 256,
            "timm_model_ids": ["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"],
            "pad_token_id": 32000, "pad_to_multiple_of": 64, "norm_stats": STATS,
            "text_config": {"model_type": "llama", "pad_token_id": 32000, "vocab_size": 32064}}))
        write_tokenizer(directory)
    (directory / "dataset_statistics.json").write_text(json.dumps(STATS))
    proprio = {f"module.{k}": v.clone() for k, v in model.proprio_projector.state_dict().items()}  # DDP names
    torch.save(proprio, directory / "proprio_projector--100_checkpoint.pt")
    return directory


def write_public_adapter(directory, modules: dict, base: str, r: int, alpha: float):
    directory.mkdir(parents=True)
    tensors = {}
    for name, (A, B) in modules.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = A.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = B.contiguous()
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "base_model_name_or_path": base,
        "target_modules": sorted(modules), "init_lora_weights": "gaussian"}))


def direct_model(seed=0, **overrides):
    cfg = build_config(tiny(**overrides), SPEC)
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    with torch.no_grad():  # make LayerScale and the proprio projector matter
        for name, p in model.named_parameters():
            if "layer_scale" in name:
                p.normal_(0.0, 0.5)
    return model


def model_inputs(cfg):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2, 2, 3, 56, 56), dtype=torch.uint8, generator=g)
    return ImageProcessor(cfg.model.image_size)(images), torch.rand(2, 8, generator=g) * 2 - 1


def observation():
    g = torch.Generator().manual_seed(1)
    return {"images": torch.randint(0, 256, (2, 2, 3, 64, 64), dtype=torch.uint8, generator=g),
            "state": torch.randn(2, 8, generator=g) * 0.3, "instruction": INSTRUCTIONS}


@pytest.fixture(scope="module")
def public(tmp_path_factory):
    """(direct model, public checkpoint dir)."""
    model = direct_model()
    root = tmp_path_factory.mktemp("public")
    path = write_public_checkpoint(root / "ckpt", model)
    # OFT saves the adapter it merged next to the merged weights: loading must not apply it again
    cfg = model.cfg
    write_public_adapter(path / "lora_adapter", {"projector.fc1": (torch.randn(4, cfg.vision_dim),
                                                                   torch.randn(4 * cfg.vision_dim, 4))},
                         base="openvla/openvla-7b", r=4, alpha=8)
    return model, path


def copy_of(path, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(path, target)
    return target


# --- tests -------------------------------------------------------------------------------------------
def test_public_layout_loads_with_exact_logits(public):
    model, path = public
    policy = build_policy(tiny(path=str(path)), SPEC)
    pixels, proprio = model_inputs(model.cfg)
    ids, mask = policy.prompts(INSTRUCTIONS)
    assert policy.prompts.tokenizer is not None and ids[0, -1].item() == 29871  # the checkpoint's tokenizer
    normalized = policy.proprio_normalizer.normalize(proprio)
    with torch.no_grad():
        expected = model(pixels, ids, mask, normalized)
        got = policy.core(pixels, ids, mask, normalized)
    assert torch.equal(got.action_logits, expected.action_logits)
    assert torch.equal(got.prompt_hidden, expected.prompt_hidden)
    assert policy.unnorm_key == "libero_10_no_noops"
    assert torch.equal(policy.action_normalizer.high, torch.tensor(STATS["libero_10_no_noops"]["action"]["q99"]))
    assert policy.action_normalizer.mask.tolist() == [True] * 6 + [False]


def perturb(policy, scale=0.3):
    with torch.no_grad():
        for _, p in policy.named_parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn_like(p))


def test_our_checkpoint_round_trips_bit_for_bit(public, tmp_path):
    _, path = public
    torch.manual_seed(1)
    policy = build_policy(tiny(path=str(path)), SPEC)
    perturb(policy)  # distinct q/k/v adapters, trained value head and proprio copies
    out = policy.save_pretrained(tmp_path / "ours", step=7, max_shard_bytes=8_000_000)
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "dataset_statistics.json", "lora_adapter", "value_head--7_checkpoint.pt",
            "proprio_projector--7_checkpoint.pt", "reference_proprio--7_checkpoint.pt", "tokenizer.json",
            "model.safetensors.index.json", "preprocessor_config.json"} <= files
    assert len([f for f in files if f.startswith("model-")]) > 1
    adapter = load_file(str(out / "lora_adapter" / "adapter_model.safetensors"))
    qkv = "base_model.model.vision_backbone.featurizer.blocks.0.attn.qkv"
    assert adapter[qkv + ".lora_A.weight"].shape[0] == 3 * 8  # q/k/v adapters fused exactly: rank 3r
    adapter_cfg = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["rank_pattern"]["vision_backbone.featurizer.blocks.0.attn.qkv"] == 24
    assert "base_model.model.language_model.model.layers.0.self_attn.q_proj.lora_B.weight" in adapter
    assert json.loads((out / "config.json").read_text())["embodirl"]["adapter"] == "lora_adapter"

    again = build_policy(tiny(path=str(out)), SPEC)
    before, after = policy.state_dict(), again.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    obs = observation()
    a, b = (p.act(obs, SamplingParams(greedy=True), return_value=True) for p in (policy, again))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with policy.reference_mode(), again.reference_mode():
        ra, rb = (p.act(obs, SamplingParams(greedy=True), return_value=True) for p in (policy, again))
    assert all(torch.equal(ra[k], rb[k]) for k in ra)


def test_shared_qkv_adapter_is_written_at_rank_r(tmp_path):
    torch.manual_seed(2)
    policy = build_policy(tiny(), SPEC)
    perturb(policy)
    attn = policy.core.vision.siglip.encoder.layers[1].self_attn
    with torch.no_grad():
        for proj in (attn.k_proj, attn.v_proj):
            proj.lora_A["default"].weight.copy_(attn.q_proj.lora_A["default"].weight)
    out = policy.save_pretrained(tmp_path / "ck")
    adapter = load_file(str(out / "lora_adapter" / "adapter_model.safetensors"))
    assert adapter["base_model.model.vision_backbone.fused_featurizer.blocks.1.attn.qkv.lora_A.weight"].shape[0] == 8
    assert json.loads((out / "config.json").read_text())["embodirl"]["tokenizer"] == "hash_words"
    again = build_policy(tiny(path=str(out)), SPEC)
    assert again.prompts.tokenizer is None and again.statistics is None
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in policy.state_dict().items())


def test_lora_disabled_merges_our_adapter(public, tmp_path):
    _, path = public
    torch.manual_seed(3)
    policy = build_policy(tiny(path=str(path)), SPEC)
    perturb(policy, 0.05)
    out = policy.save_pretrained(tmp_path / "ck")
    merged = build_policy(tiny(path=str(out), lora={**tiny()["lora"], "enabled": False}), SPEC)
    obs = observation()
    tokens = policy.act(obs, SamplingParams())["action_tokens"]
    torch.testing.assert_close(merged.score_actions(obs, tokens)["logprob"], policy.score_actions(obs, tokens)["logprob"],
                               atol=1e-4, rtol=1e-4)


def test_unmerged_public_run_merges_its_adapter_into_the_base(public, tmp_path):
    model, base = public
    cfg = model.cfg
    r, alpha = 4, 8.0
    g = torch.Generator().manual_seed(5)
    qkv_A, qkv_B = torch.randn(r, 32, generator=g), torch.randn(96, r, generator=g) * 0.1
    q_A, q_B = torch.randn(r, 128, generator=g), torch.randn(128, r, generator=g) * 0.1
    run = tmp_path / "run"
    write_public_checkpoint(run, model, weights=False)  # statistics + proprio only, as OFT's LoRA-only runs
    write_public_adapter(run / "lora_adapter", {
        "vision_backbone.featurizer.blocks.1.attn.qkv": (qkv_A, qkv_B),
        "language_model.model.layers.0.self_attn.q_proj": (q_A, q_B)}, base=str(base), r=r, alpha=alpha)
    policy = build_policy(tiny(path=str(run)), SPEC)
    expected = direct_model()  # the same base, merged by hand
    scale = alpha / r
    with torch.no_grad():
        attn = expected.vision.dino.encoder.layer[1].attention
        for part, proj in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):
            proj.weight += scale * qkv_B[part * 32:(part + 1) * 32] @ qkv_A
        expected.language_model.model.layers[0].self_attn.q_proj.weight += scale * q_B @ q_A
    pixels, proprio = model_inputs(cfg)
    ids, mask = policy.prompts(INSTRUCTIONS)
    with torch.no_grad():
        got = policy.core(pixels, ids, mask, proprio).action_logits
        want = expected(pixels, ids, mask, proprio).action_logits
        unmerged = model(pixels, ids, mask, proprio).action_logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - unmerged).abs().max() > 1e-3


def one_sentence(exc) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_missing_files_are_named(public, tmp_path):
    _, path = public
    broken = copy_of(path, tmp_path, "no_config")
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointFileMissing) as exc:
        build_policy(tiny(path=str(broken)), SPEC)
    assert "config.json" in one_sentence(exc)
    broken = copy_of(path, tmp_path, "no_proprio")
    (broken / "proprio_projector--100_checkpoint.pt").unlink()
    with pytest.raises(ConfigError) as exc:  # asked for explicitly: the checkpoint was trained without it
        build_policy(tiny(path=str(broken), use_proprio=True), SPEC)
    assert exc.value.key == "model.use_proprio" and "proprio_projector--<step>_checkpoint.pt" in one_sentence(exc)
    broken = copy_of(path, tmp_path, "no_shard")
    (broken / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointFileMissing) as exc:
        build_policy(tiny(path=str(broken)), SPEC)
    assert "model-00002-of-00002.safetensors" in one_sentence(exc)
    with pytest.raises(CheckpointFileMissing) as exc:
        build_policy(tiny(path=str(tmp_path / "nowhere")), SPEC)
    assert "does not exist" in one_sentence(exc)
    with pytest.raises(CheckpointFileMissing) as exc:
        build_policy(tiny(path="no-such-owner-x/no-such-model-y"), SPEC)
    assert "neither a local directory nor downloadable" in one_sentence(exc)


def test_shape_mismatch_names_parameter_and_file(public):
    _, path = public
    bigger = tiny(path=str(path))
    bigger["vision"] = {**bigger["vision"], "dino": {**bigger["vision"]["dino"], "hidden_size": 64}}
    with pytest.raises(CheckpointError) as exc:
        build_policy(bigger, SPEC)
    message = one_sentence(exc)
    assert "'vision_backbone.featurizer.cls_token'" in message and "model-0000" in message
    assert "(1, 1, 32)" in message and "(1, 1, 64)" in message


def test_unexpected_and_missing_parameters(public, tmp_path):
    model, _ = public
    extra = write_public_checkpoint(tmp_path / "extra", model, extra={"vision_backbone.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError) as exc:
        build_policy(tiny(path=str(extra)), SPEC)
    message = one_sentence(exc)
    assert "model-00001-of-00002.safetensors" in message and "vision_backbone.extra.weight" in message
    state = prismatic_state(model)
    state["vision_backbone.featurizer.blocks.0.ls1.gamma"] = state.pop("vision_backbone.featurizer.blocks.0.ls1.scale_factor")
    missing = dict(state)
    del missing["language_model.model.layers.1.mlp.up_proj.weight"]
    for name, tensors in (("gamma", state), ("missing", missing)):
        d = copy_of(extra, tmp_path, name)
        for f in d.glob("model*"):
            f.unlink()
        write_shards(tensors, d)
        if name == "gamma":  # timm's LayerScale spelling is accepted
            build_policy(tiny(path=str(d)), SPEC)
        else:
            with pytest.raises(CheckpointError) as exc:
                build_policy(tiny(path=str(d)), SPEC)
            assert "'language_model.model.layers.1.mlp.up_proj.weight'" in one_sentence(exc)


def test_statistics_key_and_component_errors(public, tmp_path):
    _, path = public
    with pytest.raises(ConfigError, match="available: libero_10_no_noops, libero_90_no_noops"):
        build_policy(tiny(path=str(path), unnorm_key="libero_goal"), SPEC)
    assert build_policy(tiny(path=str(path), unnorm_key="libero_90"), SPEC).unnorm_key == "libero_90_no_noops"
    doubled = copy_of(path, tmp_path, "doubled")
    shutil.copy(doubled / "proprio_projector--100_checkpoint.pt", doubled / "proprio_projector--200_checkpoint.pt")
    with pytest.raises(CheckpointError) as exc:
        build_policy(tiny(path=str(doubled)), SPEC)
    assert "several proprio_projector" in one_sentence(exc)
    wrong_bins = copy_of(path, tmp_path, "bins")
    config = json.loads((wrong_bins / "config.json").read_text())
    (wrong_bins / "config.json").write_text(json.dumps({**config, "n_action_bins": 128}))
    with pytest.raises(CheckpointError, match="n_action_bins=128"):
        build_policy(tiny(path=str(wrong_bins)), SPEC)


def oft_action_head_file(directory, llm_dim: int, action_dim: int, seed: int = 7) -> dict[str, torch.Tensor]:
    """An L1 regression head saved as OFT's fine-tuning script does (``action_head--<step>_checkpoint.pt``,
    DDP ``module.`` names of its MLP-ResNet with two residual blocks), spelled out by hand; returns the
    tensors without the prefix."""
    g = torch.Generator().manual_seed(seed)
    wide = llm_dim * action_dim
    shapes = {"model.layer_norm1.weight": (wide,), "model.layer_norm1.bias": (wide,),
              "model.fc1.weight": (llm_dim, wide), "model.fc1.bias": (llm_dim,),
              "model.layer_norm2.weight": (llm_dim,), "model.layer_norm2.bias": (llm_dim,),
              "model.fc2.weight": (action_dim, llm_dim), "model.fc2.bias": (action_dim,)}
    for block in range(2):
        for part, shape in (("0.weight", (llm_dim,)), ("0.bias", (llm_dim,)), ("1.weight", (llm_dim, llm_dim)),
                            ("1.bias", (llm_dim,))):
            shapes[f"model.mlp_resnet_blocks.{block}.ffn.{part}"] = shape
    state = {name: torch.randn(shape, generator=g) * 0.2 for name, shape in shapes.items()}
    torch.save({f"module.{k}": v for k, v in state.items()}, directory / "action_head--100_checkpoint.pt")
    return state


def test_public_l1_checkpoint_acts_through_its_action_head(public, tmp_path):
    """OFT's own LIBERO checkpoints regress actions: their action_head file loads by OFT's names and the
    greedy chunk is that head's output, un-normalised with the checkpoint's q01/q99 statistics."""
    model, path = public
    l1 = copy_of(path, tmp_path, "l1")
    head = oft_action_head_file(l1, model.cfg.llm_dim, 7)
    policy = build_policy(tiny(path=str(l1), use_l1_regression=True), SPEC)
    loaded = policy.core.action_head.state_dict()
    assert loaded.keys() == head.keys() and all(torch.equal(loaded[k], head[k]) for k in head)

    obs = observation()
    chunk = policy.act(obs, SamplingParams(greedy=True))["action_chunk"]                   # (B, H, A)
    with torch.no_grad():
        hidden = policy.core(**policy.prepare_inputs(obs)).action_hidden                  # (B, H*A, D)
        x = hidden.reshape(2, 8, -1)                                                      # (B, H, A*D)
        ln = torch.nn.functional.layer_norm
        x = torch.relu(torch.nn.functional.linear(ln(x, x.shape[-1:], head["model.layer_norm1.weight"],
                                                     head["model.layer_norm1.bias"]),
                                                  head["model.fc1.weight"], head["model.fc1.bias"]))
        for block in range(2):
            p = f"model.mlp_resnet_blocks.{block}.ffn."
            y = ln(x, x.shape[-1:], head[p + "0.weight"], head[p + "0.bias"])
            x = x + torch.relu(torch.nn.functional.linear(y, head[p + "1.weight"], head[p + "1.bias"]))
        x = ln(x, x.shape[-1:], head["model.layer_norm2.weight"], head["model.layer_norm2.bias"])
        normalized = torch.nn.functional.linear(x, head["model.fc2.weight"], head["model.fc2.bias"])  # (B, H, A)
    stats = STATS["libero_10_no_noops"]["action"]
    low, high = torch.tensor(stats["q01"]), torch.tensor(stats["q99"])
    expected = torch.where(torch.tensor(stats["mask"]), 0.5 * (normalized + 1) * (high - low) + low, normalized)
    torch.testing.assert_close(chunk, expected, atol=1e-5, rtol=1e-5)

    missing = copy_of(path, tmp_path, "no_head")
    with pytest.raises(ConfigError) as exc:
        build_policy(tiny(path=str(missing), use_l1_regression=True), SPEC)
    assert exc.value.key == "model.use_l1_regression" and "action_head--<step>_checkpoint.pt" in one_sentence(exc)


def test_fully_fine_tuned_towers_are_written_with_the_same_outputs(public, tmp_path):
    """A full fine-tune also trains DINOv2's CLS position slot, which the public (timm) layout lacks: writing
    folds it into cls_token, and the reloaded policy acts and scores exactly as the trained one."""
    _, path = public
    torch.manual_seed(2)
    policy = build_policy(tiny(path=str(path)), SPEC)
    with torch.no_grad():
        for _, p in policy.named_parameters():   # every weight moved, as actor.fsdp.full_finetune=true moves them
            p.add_(0.05 * torch.randn_like(p))
    slot = policy.core.vision.dino.embeddings.position_embeddings[:, 0]
    assert torch.count_nonzero(slot) > 0
    out = policy.save_pretrained(tmp_path / "full", step=3)
    again = build_policy(tiny(path=str(out)), SPEC)
    assert torch.count_nonzero(again.core.vision.dino.embeddings.position_embeddings[:, 0]) == 0
    obs = observation()
    a, b = (p.act(obs, SamplingParams(greedy=True), return_value=True) for p in (policy, again))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- the export is atomic ---------------------------------------------------------------------------------------------
EXPORT_LOOP = """
import sys
from embodirl.envs.base import EnvSpec
from embodirl.models.openvla_oft import build_policy
from embodirl.models.openvla_oft.resolve import load_preset
spec = EnvSpec(action_dim=7, max_episode_steps=100, task_descriptions=["t"], camera_names=["agentview", "wrist"],
               image_size=(64, 64), state_dim=8, name="libero_10")
policy = build_policy(load_preset("openvla_oft_tiny"), spec)
print("built", flush=True)
step = 0
while True:                                   # exports into the same folder, one after the other
    step += 1
    policy.save_pretrained(sys.argv[1], step=step)
"""


def test_an_export_killed_mid_write_leaves_the_folder_whole_and_no_temporary(tmp_path):
    """SIGKILL while `save_pretrained` writes over an earlier export: the earlier export is there, whole, and the next
    export into the same folder leaves no temporary folder. The export used to write into a randomly named hidden
    folder that nothing removed (7B large), and deleted the old folder before renaming the new one in."""
    import os
    import signal
    import subprocess
    import sys
    import time

    target = tmp_path / "model"
    proc = subprocess.Popen([sys.executable, "-c", EXPORT_LOOP, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "built"
        deadline = time.monotonic() + 120
        while not (target.is_dir() and [n for n in os.listdir(tmp_path) if n.startswith(".")]):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.001)                     # an export over an earlier one is being written: kill it now
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    left = sorted(n for n in os.listdir(tmp_path) if n != "model")
    assert left, "the kill should have found the export at work"
    torch.manual_seed(4)
    policy = build_policy(tiny(), SPEC)
    policy.save_pretrained(target, step=7)                                   # the next export into that folder
    assert os.listdir(tmp_path) == ["model"], os.listdir(tmp_path)
    assert json.loads((target / "config.json").read_text())["embodirl"]["step"] == 7
    again = build_policy(tiny(path=str(target)), SPEC)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in policy.state_dict().items())
