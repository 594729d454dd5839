"""π0 from a LeRobot-layout folder (embodirl/models/pi0/lerobot.py): a small random π0 written with the file names, key
names and JSON structure LeRobot's ``PI0Policy.save_pretrained`` and processor pipelines write loads through
``model.path``, acts as the network it holds bit for bit with the statistics of its normaliser applied, and a bad file
is one sentence naming it, also through the CLI.

The folder is written here from LeRobot's code (huggingface/lerobot @ 7427f31801f944f5ec9ce53cda02862ce7d1638b, as in
v0.4.0), not from embodirl's reader: ``src/lerobot/policies/pi0/modeling_pi0.py`` for the module tree behind the weight
names, ``configuration_pi0.py`` + ``src/lerobot/configs/policies.py`` for config.json, ``processor_pi0.py``,
``src/lerobot/processor/pipeline.py`` and ``normalize_processor.py`` for the two pipelines and their state files. The
one departure: LeRobot's PI0Config accepts only the gemma_2b / gemma_300m variants, so this CPU-size network names
variants of its own, which take the ``model`` option's sizes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from embodirl import data as D
from embodirl.envs.base import EnvSpec
from embodirl.errors import ConfigError
from embodirl.models.base import SamplingParams
from embodirl.models.pi0.checkpoint import check_checkpoint
from embodirl.models.registry import make_policy
from tests import cli_runs
from tests.models import test_pi0 as pi0_tests  # the π0 tests' policy, observation and noise helpers

SPEC = EnvSpec(action_dim=7, max_episode_steps=24, task_descriptions=["reach the red square", "push the cube left"],
               camera_names=["main"], image_size=(64, 64), state_dim=5, name="spec")
#: LeRobot's PolicyProcessorPipeline names (POLICY_PREPROCESSOR_DEFAULT_NAME / POLICY_POSTPROCESSOR_DEFAULT_NAME) and
#: the files its _save_pretrained derives from them: "<name>_step_<index>_<registry_name>.safetensors"
NORMALIZER_FILE = "policy_preprocessor_step_5_normalizer_processor.safetensors"
UNNORMALIZER_FILE = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
#: PI0Pytorch's attribute names under PI0Policy.model (modeling_pi0.py)
PALIGEMMA, EXPERT = "model.paligemma_with_expert.paligemma.", "model.paligemma_with_expert.gemma_expert."


def lerobot_key(name: str) -> str | None:
    """transformers' ``PI0ForConditionalGeneration`` parameter name -> the name LeRobot's PI0Policy saves it under
    (None: LeRobot saves no such tensor). LeRobot's tree: ``paligemma`` is a PaliGemmaForConditionalGeneration
    (``model.vision_tower.vision_model``, ``model.multi_modal_projector``, ``model.language_model``, ``lm_head`` tied to
    the token embedding, which safetensors' duplicate removal stores once, as ``lm_head``); ``gemma_expert`` is a
    GemmaForCausalLM whose ``model.embed_tokens`` is set to None, so only its ``lm_head`` holds that matrix; the
    projections sit on PI0Pytorch itself."""
    renames = [("model.vlm.language_model.embed_tokens.", PALIGEMMA + "lm_head."),
               ("model.vlm.vision_tower.", PALIGEMMA + "model.vision_tower.vision_model."),
               ("model.vlm.", PALIGEMMA + "model."),
               ("model.dit.embed_tokens.", EXPERT + "lm_head."),
               ("model.dit.", EXPERT + "model."),
               ("embed_action_time.", "model."),
               ("action_out_proj.", "model.action_out_proj.")]
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old):]
    raise AssertionError(f"no LeRobot name for {name}")


def _features(state_dim: int, action_dim: int, image: int) -> tuple[dict, dict]:
    """``input_features`` / ``output_features`` as draccus writes PolicyFeature (type as FeatureType's value)."""
    inputs = {"observation.images.main": {"type": "VISUAL", "shape": [3, image, image]},
              "observation.state": {"type": "STATE", "shape": [state_dim]}}
    return inputs, {"action": {"type": "ACTION", "shape": [action_dim]}}


def lerobot_config(policy, *, state_dim: int, action_dim: int) -> dict:
    """config.json: PreTrainedConfig's fields, then PI0Config's (v0.4.0), with their values for this network."""
    inputs, outputs = _features(state_dim, action_dim, policy.image_size)
    cfg = policy.network.config
    return {"type": "pi0", "n_obs_steps": 1, "input_features": inputs, "output_features": outputs, "device": "cpu",
            "use_amp": False, "push_to_hub": False, "repo_id": None, "private": None, "tags": None, "license": None,
            "pretrained_path": None,
            "paligemma_variant": "tiny_vlm", "action_expert_variant": "tiny_expert", "dtype": "float32",
            "chunk_size": cfg.chunk_size, "n_action_steps": policy.action_chunk, "max_state_dim": cfg.max_state_dim,
            "max_action_dim": cfg.max_action_dim, "num_inference_steps": policy.num_steps,
            "time_sampling_beta_alpha": 1.5, "time_sampling_beta_beta": 1.0, "time_sampling_scale": 0.999,
            "time_sampling_offset": 0.001, "min_period": 0.004, "max_period": 4.0,
            "image_resolution": [policy.image_size, policy.image_size], "empty_cameras": 0,
            "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
            "gradient_checkpointing": False, "compile_model": False, "compile_mode": "max-autotune",
            "optimizer_lr": 2.5e-05, "optimizer_betas": [0.9, 0.95], "optimizer_eps": 1e-08,
            "optimizer_weight_decay": 0.01, "optimizer_grad_clip_norm": 1.0, "scheduler_warmup_steps": 1000,
            "scheduler_decay_steps": 30000, "scheduler_decay_lr": 2.5e-06, "tokenizer_max_length": 48}


def dataset_stats(state_dim: int, action_dim: int, seed: int = 4) -> dict[str, torch.Tensor]:
    """A LeRobot dataset's statistics, flattened as the normaliser's state_dict flattens them ("<feature>.<stat>")."""
    g = torch.Generator().manual_seed(seed)
    stats = {}
    for key, width in (("observation.state", state_dim), ("action", action_dim)):
        stats.update({f"{key}.mean": 0.3 * torch.randn(width, generator=g),
                      f"{key}.std": 0.5 + torch.rand(width, generator=g),
                      f"{key}.min": -torch.ones(width), f"{key}.max": torch.ones(width),
                      f"{key}.count": torch.tensor([1000])})
    stats.update({"observation.images.main.mean": torch.full((3, 1, 1), 0.5),
                  "observation.images.main.std": torch.full((3, 1, 1), 0.25)})
    return stats


def _normalizer_config(features: dict) -> dict:
    return {"eps": 1e-08, "features": features,
            "norm_map": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}}


def write_lerobot_folder(policy, folder, *, state_dim: int, action_dim: int, stats: dict | None = None):
    """The folder LeRobot's PI0Policy.save_pretrained + make_pi0_pre_post_processors' pipelines write."""
    folder.mkdir(parents=True)
    weights = {lerobot_key(k): v.contiguous() for k, v in policy.merged_network_state().items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = lerobot_config(policy, state_dim=state_dim, action_dim=action_dim)
    (folder / "config.json").write_text(json.dumps(config, indent=4))
    stats = dataset_stats(state_dim, action_dim) if stats is None else stats
    inputs, outputs = config["input_features"], config["output_features"]
    preprocessor = {"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": "pi0_new_line_processor", "config": {}},
        {"registry_name": "tokenizer_processor", "config": {
            "max_length": 48, "task_key": "task", "padding_side": "right", "padding": "max_length",
            "truncation": True, "tokenizer_name": "google/paligemma-3b-pt-224"}},
        {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}},
        {"registry_name": "normalizer_processor", "config": _normalizer_config({**inputs, **outputs}),
         "state_file": NORMALIZER_FILE}]}
    postprocessor = {"name": "policy_postprocessor", "steps": [
        {"registry_name": "unnormalizer_processor", "config": _normalizer_config(outputs),
         "state_file": UNNORMALIZER_FILE},
        {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}]}
    (folder / "policy_preprocessor.json").write_text(json.dumps(preprocessor, indent=2))
    (folder / "policy_postprocessor.json").write_text(json.dumps(postprocessor, indent=2))
    save_file(stats, str(folder / NORMALIZER_FILE))
    save_file({k: v for k, v in stats.items() if k.startswith("action.")}, str(folder / UNNORMALIZER_FILE))
    return folder


def _expected_statistics(stats: dict) -> dict:
    return {"state_mean": stats["observation.state.mean"].tolist(), "state_std": stats["observation.state.std"].tolist(),
            "actions_mean": stats["action.mean"].tolist(), "actions_std": stats["action.std"].tolist()}


def _policy(compose_cfg, *overrides, spec=SPEC):
    return pi0_tests._policy(compose_cfg, *overrides, spec=spec)


def _obs(batch=4, seed=1, spec=SPEC):
    return pi0_tests._obs(batch, seed, spec=spec)


_noise = pi0_tests._noise


def _load(compose_cfg, folder, *overrides, spec=SPEC):
    """``model=pi0_tiny model.path=<folder>`` built for ``spec``."""
    return make_policy(compose_cfg("model=pi0_tiny", f"model.path={folder}", *overrides).model, spec)


@pytest.fixture
def written(compose_cfg, tmp_path):
    """``(policy, cfg, folder, stats)``: a random pi0_tiny and the LeRobot folder of it."""
    policy, cfg = _policy(compose_cfg)
    stats = dataset_stats(SPEC.state_dim, SPEC.action_dim)
    folder = write_lerobot_folder(policy, tmp_path / "pi0_lerobot", state_dim=SPEC.state_dim,
                                  action_dim=SPEC.action_dim, stats=stats)
    return policy, cfg, folder, stats


def test_the_folder_has_lerobots_names(written):
    """What the reader is handed is LeRobot's layout, not transformers': prefixed by PI0Policy's ``model``, the VLM and
    the expert under ``paligemma_with_expert``, each matrix once."""
    _, _, folder, _ = written
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert all(k.startswith("model.") for k in keys)
    assert not any(k.startswith(("model.vlm.", "model.dit.", "embed_action_time.")) for k in keys)
    for key in ("model.state_proj.weight", "model.action_in_proj.weight", "model.action_time_mlp_in.weight",
                "model.action_time_mlp_out.bias", "model.action_out_proj.weight", PALIGEMMA + "lm_head.weight",
                EXPERT + "lm_head.weight", PALIGEMMA + "model.multi_modal_projector.linear.weight",
                PALIGEMMA + "model.vision_tower.vision_model.embeddings.patch_embedding.weight",
                PALIGEMMA + "model.vision_tower.vision_model.encoder.layers.0.self_attn.out_proj.weight",
                PALIGEMMA + "model.language_model.layers.1.mlp.gate_proj.weight",
                EXPERT + "model.layers.0.self_attn.q_proj.weight", EXPERT + "model.norm.weight"):
        assert key in keys, key
    assert PALIGEMMA + "model.language_model.embed_tokens.weight" not in keys
    assert EXPERT + "model.embed_tokens.weight" not in keys


@pytest.mark.parametrize("method", ["flow_sde", "flow_noise"])
def test_a_lerobot_folder_acts_as_the_network_it_holds_bit_for_bit(compose_cfg, written, method):
    """model.path = the LeRobot folder: the network configures itself from config.json, its weights arrive through
    transformers' renaming, the statistics are the normaliser's (state) and the unnormaliser's (actions), and greedy
    decisions equal those of the policy that wrote it, given those statistics, bit for bit for the same noise."""
    policy, _, folder, stats = written
    loaded = _load(compose_cfg, folder, f"model.flow.method={method}")
    assert loaded.statistics == _expected_statistics(stats)
    net = loaded.network.config
    assert (net.chunk_size, net.max_action_dim, net.max_state_dim, net.num_inference_steps) == (8, 8, 32, 4)
    reference, _ = _policy(compose_cfg, f"model.flow.method={method}")          # the same seed: the same network
    reference.set_statistics(_expected_statistics(stats))
    loaded_state = loaded.merged_network_state()
    for name, tensor in reference.merged_network_state().items():
        assert torch.equal(tensor, loaded_state[name]), name
    obs, noise = _obs(), _noise(policy, 4)
    a = reference.act(obs, SamplingParams(greedy=True), noise=noise)
    b = loaded.act(obs, SamplingParams(greedy=True), noise=noise)
    assert torch.equal(a[D.ACTION_CHUNK], b[D.ACTION_CHUNK])
    assert torch.equal(a[D.ACTION_CHAIN], b[D.ACTION_CHAIN])
    # the statistics act: without them (the writer as it was) the answer differs
    plain = policy.act(obs, SamplingParams(greedy=True), noise=noise)
    assert not torch.allclose(plain[D.ACTION_CHUNK], b[D.ACTION_CHUNK])


def test_doctor_describes_the_folder_and_missing_statistics_are_identity(compose_cfg, written, caplog):
    _, _, folder, _ = written
    line = check_checkpoint(folder)
    assert line.startswith("pi0_lerobot: LeRobot π0 (tiny_vlm + tiny_expert), 1 weight file(s), chunk 8 x 8"), line
    assert f"state ({NORMALIZER_FILE})" in line and f"actions ({UNNORMALIZER_FILE})" in line, line
    # no postprocessor: the actions' statistics come from the normaliser
    (folder / "policy_postprocessor.json").unlink()
    assert f"actions ({NORMALIZER_FILE})" in check_checkpoint(folder)
    # no pipelines at all: identity, said in the log
    (folder / "policy_preprocessor.json").unlink()
    with caplog.at_level(logging.INFO, logger="embodirl.models.pi0.lerobot"):
        loaded = _load(compose_cfg, folder)
    assert loaded.statistics is None
    assert "statistics: none: identity" in check_checkpoint(folder)
    assert sum("not standardised (identity)" in r.getMessage() for r in caplog.records) >= 2


def test_lerobots_variants_are_the_network_transformers_documents_for_pi0_base(compose_cfg, written):
    """A config.json of LeRobot's defaults (gemma_2b VLM, gemma_300m expert, 224 px) describes transformers' default
    PI0Config, the sizes its docs give for lerobot/pi0_base (no weights are built here)."""
    from transformers import PI0Config

    from embodirl.config_fields import instance
    from embodirl.models.pi0 import lerobot
    from embodirl.models.pi0.schema import Pi0ModelConfig

    _, cfg, folder, _ = written
    data = {**json.loads((folder / "config.json").read_text()), "paligemma_variant": "gemma_2b",
            "action_expert_variant": "gemma_300m", "chunk_size": 50, "max_state_dim": 32, "max_action_dim": 32,
            "num_inference_steps": 10, "image_resolution": [224, 224]}
    checkpoint = lerobot.LeRobotCheckpoint(folder, lerobot._check_config(data, folder / "config.json"), weights=[])
    model = instance(Pi0ModelConfig, cfg.model, "model")
    built, documented = lerobot.network_config(checkpoint, model), PI0Config()
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    parts = {"text_config": (*sizes, "num_key_value_heads", "head_dim", "vocab_size"),
             "vision_config": (*sizes, "patch_size", "image_size")}
    for part, keys in parts.items():
        mine, theirs = getattr(built.vlm_config, part), getattr(documented.vlm_config, part)
        for key in keys:
            assert getattr(mine, key) == getattr(theirs, key), (part, key)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size"):
        assert getattr(built.dit_config, key) == getattr(documented.dit_config, key), key
    for key in ("chunk_size", "max_state_dim", "max_action_dim", "num_inference_steps", "min_period", "max_period",
                "time_sampling_scale", "time_sampling_offset"):
        assert getattr(built, key) == getattr(documented, key), key
    assert built.vlm_config.projection_dim == documented.vlm_config.projection_dim
    assert built.vlm_config.image_token_id == documented.vlm_config.image_token_id


def _edit_json(name, change):
    def edit(folder):
        data = json.loads((folder / name).read_text())
        change(data)
        (folder / name).write_text(json.dumps(data))
    return edit


def _write(name, content: bytes):
    return lambda folder: (folder / name).write_bytes(content)


def _stats_of_width(width):
    def edit(folder):
        stats = dataset_stats(width, 7)
        save_file(stats, str(folder / NORMALIZER_FILE))
    return edit


BAD = {
    "config_not_json": (_write("config.json", b"{not json"), "config.json", "is not JSON"),
    "pi05": (_edit_json("config.json", lambda d: d.update(type="pi05")), "config.json", "LeRobot 'pi05' policy"),
    "before_v04": (_edit_json("config.json", lambda d: d.pop("paligemma_variant")), "config.json",
                   "has no paligemma_variant"),
    "chunk_not_int": (_edit_json("config.json", lambda d: d.update(chunk_size="fifty")), "config.json",
                      "chunk_size = 'fifty'"),
    "not_square": (_edit_json("config.json", lambda d: d.update(image_resolution=[56, 42])), "config.json",
                   "image_resolution"),
    "relative_actions": (_edit_json("config.json", lambda d: d.update(use_relative_actions=True)), "config.json",
                         "use_relative_actions"),
    "weights_garbage": (_write("model.safetensors", b"\xff" * 64), "model.safetensors", "is not a safetensors file"),
    "preprocessor_not_json": (_write("policy_preprocessor.json", b"[1, 2"), "policy_preprocessor.json",
                              "is not JSON"),
    "preprocessor_no_steps": (_write("policy_preprocessor.json", b'{"name": "policy_preprocessor"}'),
                              "policy_preprocessor.json", "no list of steps"),
    "normalizer_garbage": (_write(NORMALIZER_FILE, b"\x00" * 40), NORMALIZER_FILE, "is not a safetensors file"),
    "normalizer_gone": (lambda folder: (folder / NORMALIZER_FILE).unlink(), "policy_preprocessor.json",
                        "names the statistics file"),
    "min_max": (_edit_json("policy_preprocessor.json",
                           lambda d: d["steps"][5]["config"]["norm_map"].update(STATE="MIN_MAX")),
                "policy_preprocessor.json", "STATE with MIN_MAX"),
    "state_too_wide": (_stats_of_width(40), NORMALIZER_FILE, "at most 32"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_file_is_one_sentence_naming_it(compose_cfg, written, case):
    """Before anything is built (check_checkpoint, which doctor and the CLI's pre-start check call) and when the
    policy is built, a bad file is one ConfigError sentence that names it."""
    _, _, folder, _ = written
    change, file, fragment = BAD[case]
    change(folder)
    for attempt in (lambda: check_checkpoint(folder), lambda: _load(compose_cfg, folder)):
        with pytest.raises(ConfigError) as info:
            attempt()
        message = str(info.value)
        assert message.startswith("model.path: ") and "\n" not in message, message
        assert file in message and fragment in message, message


def test_weights_that_do_not_fit_the_config_are_one_sentence(compose_cfg, written):
    """A config.json whose widths disagree with the weights, or a model option whose sizes the weights do not have,
    is one sentence naming the weights (transformers alone would re-initialise them and go on)."""
    _, _, folder, _ = written
    _edit_json("config.json", lambda d: d.update(max_action_dim=16))(folder)
    with pytest.raises(ConfigError, match=r"model.safetensors.*max_action_dim") as info:
        _load(compose_cfg, folder)
    assert "\n" not in str(info.value)
    _edit_json("config.json", lambda d: d.update(max_action_dim=8))(folder)
    with pytest.raises(ConfigError, match=r"weights do not fit .* of another shape .*config.json's paligemma_variant "
                                          r"'tiny_vlm' and action_expert_variant 'tiny_expert' LeRobot does not define"
                       ) as info:
        _load(compose_cfg, folder, "model.language.intermediate_size=256")
    assert "\n" not in str(info.value)


def _cli(args, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return cli_runs.run(args, cwd, env=env, timeout=300)


EVAL = ["env=toy_reach", "model=pi0_tiny", "env.eval.num_envs=2", "env.eval.num_tasks=2",
        "env.eval.max_episode_steps=8", "env.eval.reward_mode=dense", "runner.eval_episodes_per_task=1",
        "runner.progress_bar=false", "runner.logger.tensorboard=false", "cluster.use_ray=false"]


def _cli_folder(compose_cfg, tmp_path):
    """A random pi0_tiny for toy_reach (one camera, no state; the statistics' state part is then unused) in LeRobot's
    layout, with a LeRobot dataset's statistics."""
    spec = EnvSpec(action_dim=7, max_episode_steps=8, task_descriptions=["reach"], camera_names=["main"],
                   image_size=(64, 64), state_dim=0, name="toy")
    policy, _ = _policy(compose_cfg, spec=spec)
    stats = dataset_stats(4, 7)
    return policy, stats, write_lerobot_folder(policy, tmp_path / "lerobot", state_dim=4, action_dim=7, stats=stats)


def _eval(folder, work, name) -> dict:
    proc = _cli(["eval", *EVAL, f"model.path={folder}", f"runner.experiment_name={name}"], work)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((work / "outputs" / name / "eval_info.json").read_text())["overall"]


def test_eval_and_doctor_take_a_lerobot_folder(compose_cfg, tmp_path):
    """The user's path: ``embodirl doctor``'s checkpoint row describes the folder (and names a bad normaliser file);
    ``embodirl eval model.path=<LeRobot folder>`` runs through the CLI."""
    from embodirl.tools.doctor import check_checkpoint as doctor_row

    _, _, folder = _cli_folder(compose_cfg, tmp_path)
    row = doctor_row(compose_cfg("model=pi0_tiny", "env=toy_reach", f"model.path={folder}"))
    assert row.ok and "LeRobot π0" in row.detail and "chunk 8 x 8" in row.detail and NORMALIZER_FILE in row.detail, row
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / NORMALIZER_FILE).write_bytes(b"\x00" * 40)
    row = doctor_row(compose_cfg("model=pi0_tiny", "env=toy_reach", f"model.path={bad}"))
    assert not row.ok and NORMALIZER_FILE in row.detail, row
    work = tmp_path / "work"
    work.mkdir()
    overall = _eval(folder, work, "lerobot")
    assert overall["n_episodes"] == 2 and overall["avg_length"] == 8.0


@pytest.mark.slow
def test_eval_of_a_lerobot_folder_returns_what_the_transformers_layout_returns(compose_cfg, tmp_path):
    """``embodirl eval`` of the LeRobot folder and of the same network and statistics in transformers' layout
    (``save_pretrained``) return the same dense rewards; a bad normaliser file exits 2 with one sentence naming it
    before anything starts."""
    policy, stats, folder = _cli_folder(compose_cfg, tmp_path)
    policy.set_statistics(_expected_statistics(stats))
    hf_folder = policy.save_pretrained(tmp_path / "transformers")
    work = tmp_path / "work"
    work.mkdir()
    lerobot_overall, hf_overall = _eval(folder, work, "lerobot"), _eval(hf_folder, work, "transformers")
    assert lerobot_overall["avg_return"] != 0.0
    for key in ("n_episodes", "n_successes", "avg_return", "avg_max_reward", "avg_length"):
        assert lerobot_overall[key] == hf_overall[key], (key, lerobot_overall, hf_overall)
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / NORMALIZER_FILE).write_bytes(b"\x00" * 40)
    proc = _cli(["eval", *EVAL, f"model.path={bad}", "runner.experiment_name=bad"], work)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("embodirl: model.path:") and NORMALIZER_FILE in lines[0], lines[0]
    assert not (work / "outputs" / "bad").exists()
