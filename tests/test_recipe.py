"""The GPU recipe: `embodirl train env=libero_10 model=openvla_oft model.path=...` composes the published
LIBERO-10 GRPO settings (config/model/openvla_oft.yaml), passes validation and is self-consistent, while the
tiny preset and the default state policy keep config.yaml's algorithm and run sizes."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from embodirl.actor.settings import ActorSettings
from embodirl.config import compose, validate
from embodirl.errors import ConfigError
from embodirl.models.openvla_oft.resolve import build_config, load_preset
from embodirl.models.registry import get_policy_builder
from embodirl.placement import data_parallel_size
from embodirl.rollout.records import decisions_per_episode
from tests import cli_runs

#: every leaf the recipe sets outside `model` (on top of config.yaml and algorithm/ppo.yaml)
RECIPE = {
    "algorithm.adv_type": "grpo",
    "algorithm.group_size": 8,
    "algorithm.update_epochs": 1,
    "algorithm.clip_ratio_high": 0.28,
    "algorithm.normalize_advantages": False,
    "algorithm.logprob_type": "token",
    "algorithm.filter_groups.enable": True,
    "algorithm.filter_groups.min_success": 0.1,
    "algorithm.filter_groups.max_success": 0.9,
    "algorithm.loss_agg_func": "seq-mean-token-mean",
    "algorithm.clip_ratio_c": None,
    "env.train.num_envs": 64,
    "env.train.max_episode_steps": 512,
    "env.train.use_fixed_reset_state_ids": True,
    "rollout.temperature": 1.6,
    "rollout.rollout_epoch": 16,
    "actor.global_batch_size": 256,
    "actor.micro_batch_size": 1,
    "actor.optim.lr": 1.0e-4,
    "actor.optim.weight_decay": 0.01,
    "actor.fsdp.gradient_checkpointing": True,
    "runner.max_steps": 1000,
    "actor.optim.lr_decay_steps": 1000,  # follows runner.max_steps (used only by a decaying lr_schedule)
    "runner.save_interval": 25,
    "runner.val_before_train": True,
    "runner.val_check_interval": 25,
}
#: recipe values that equal config.yaml's defaults, stated in the recipe for its sources
RESTATED = {
    "algorithm.clip_ratio_low": 0.2,
    "algorithm.kl_beta": 0.0,
    "algorithm.entropy_bonus": 0.0,
    "actor.optim.eps": 1.0e-8,
    "actor.optim.clip_grad": 1.0,
}


def leaves(cfg, prefix: str = "") -> dict:
    """Flat ``{dotted key: value}`` of a composed config."""
    out = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(leaves(value, name + "."))
        else:
            out[name] = value
    return out


def non_model_leaves(cfg) -> dict:
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("model")
    plain["runner"].pop("experiment_name")
    plain["runner"].pop("output_dir")
    return leaves(plain)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoint")
    return compose(["env=libero_10", "model=openvla_oft", f"model.path={path}"]), path


def test_recipe_values(recipe):
    cfg, path = recipe
    flat = non_model_leaves(cfg)
    for key, value in {**RECIPE, **RESTATED}.items():
        assert flat[key] == value and type(flat[key]) is type(value), (key, flat[key])
    m = cfg.model
    assert m.path == str(path) and m.name == "openvla_oft"
    assert (m.action_chunk, m.action_dim, m.num_bins) == (8, 7, 256)
    # left to the checkpoint (autoconfig.py): a token checkpoint without heads -> agentview only, no proprio
    assert m.num_images_in_input is None and m.use_proprio is None and m.use_l1_regression is None
    assert m.center_crop is True and m.dtype == "bfloat16" and m.llm.hidden_size == 4096
    assert m.lora.enabled is True and m.lora.rank == 32 and m.lora.alpha == 32     # RLinf: alpha = rank
    assert list(m.lora.target_modules) == ["all-linear", "lm_head"]                  # RLinf adapts the LM head
    assert cfg.env.train.suite == cfg.env.eval.suite == "libero_10"
    assert cfg.env.train.max_episode_steps == 512 and decisions_per_episode(cfg) == 64   # RLinf, SimpleVLA-RL
    assert cfg.env.eval.max_episode_steps == 520                                          # OFT's protocol
    # GRPO: no critic, no reference forward
    actor = ActorSettings.from_config({"algorithm": cfg.algorithm, "actor": cfg.actor})
    assert not actor.algorithm.uses_critic and not actor.algorithm.kl_active


def test_recipe_sets_exactly_its_keys_outside_model():
    """Against the tiny preset (same network, no recipe) the composed configs differ only in the recipe's keys."""
    recipe_cfg = non_model_leaves(compose(["env=libero_10", "model=openvla_oft"]))
    tiny_cfg = non_model_leaves(compose(["env=libero_10", "model=openvla_oft_tiny"]))
    changed = {k for k in recipe_cfg if recipe_cfg[k] != tiny_cfg.get(k)}
    assert changed == set(RECIPE), sorted(changed ^ set(RECIPE))
    assert set(recipe_cfg) == set(tiny_cfg)


@pytest.mark.parametrize("accelerator, devices", [("gpu", 8), ("gpu", 4), ("gpu", 1), ("cpu", 2)])
def test_recipe_validates_and_its_batches_divide(recipe, accelerator, devices):
    cfg, _ = recipe
    validate(cfg, check_envs=False, num_devices=devices, accelerator=accelerator)
    from embodirl.placement import parse_placement

    placement = parse_placement(OmegaConf.to_container(cfg.cluster.component_placement), devices, accelerator)
    dp = data_parallel_size(cfg, placement)
    G, envs = cfg.algorithm.group_size, cfg.env.train.num_envs
    rollout_batch = envs * cfg.rollout.rollout_epoch
    global_bs, micro = cfg.actor.global_batch_size, cfg.actor.micro_batch_size
    assert envs % G == 0 and global_bs % G == 0          # whole groups per env batch and per optimizer step
    assert global_bs % (micro * dp) == 0                 # micro-batches fill every rank's share
    assert rollout_batch % global_bs == 0 and rollout_batch // global_bs == 4   # RLinf: 4 optimizer steps a step
    # RLinf counts its global batch in chunk-level samples: 16384 = 256 trajectories x 64 decisions
    assert global_bs * math.ceil(512 / cfg.model.action_chunk) == 16384


def test_recipe_model_checks_and_matches_load_preset(recipe):
    cfg, _ = recipe
    model = OmegaConf.to_container(cfg.model, resolve=True)
    get_policy_builder("openvla_oft").check_config(model)
    oft = build_config(model)
    assert oft.tokens_per_decision == 56 and oft.num_images_in_input == 1 and not oft.use_proprio
    # scripts and tests that read the preset without Hydra see the same network
    preset = load_preset("openvla_oft")
    assert preset == {**model, "path": None}


def test_command_line_beats_the_recipe():
    cfg = compose(["env=libero_10", "model=openvla_oft", "algorithm=ppo", "actor.optim.lr=2e-5",
                   "rollout.temperature=1.0", "algorithm.filter_groups.enable=false"])
    assert cfg.algorithm.adv_type == "gae" and cfg.algorithm.group_size == 1
    assert cfg.actor.optim.lr == 2e-5 and cfg.rollout.temperature == 1.0


def test_eval_composes_and_validates(recipe):
    cfg, path = recipe
    cfg = compose(["env=libero_10", "model=openvla_oft", f"model.path={path}", "runner.only_eval=true"])
    validate(cfg, check_envs=False, num_devices=1, accelerator="gpu")


def test_tiny_and_default_models_keep_config_defaults():
    base = non_model_leaves(compose(["env=libero_10"]))              # model=state_mlp, algorithm=ppo
    assert non_model_leaves(compose(["env=libero_10", "model=openvla_oft_tiny"])) == base
    assert base["algorithm.adv_type"] == "gae" and base["rollout.temperature"] == 1.0
    tiny = compose(["env=toy_reach", "model=openvla_oft_tiny", "algorithm=grpo"])
    assert tiny.model.llm.hidden_size == 128 and tiny.model.num_images_in_input is None
    assert tiny.algorithm.group_size == 8 and tiny.actor.optim.lr == 3.0e-4


def test_missing_checkpoint_is_one_sentence_naming_model_path(tmp_path):
    cfg = compose(["env=libero_10", "model=openvla_oft", f"model.path={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError) as info:
        validate(cfg, check_envs=False, num_devices=1, accelerator="gpu")
    assert info.value.key == "model.path" and "does not exist" in str(info.value)
    # through the real command: exit status 2, one line, nothing written
    work = tmp_path / "work"
    work.mkdir()
    proc = cli_runs.run(["eval", "env=libero_10", "model=openvla_oft", f"model.path={tmp_path / 'nowhere'}"], work,
                        timeout=180)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.path" in lines[0] and "does not exist" in lines[0], proc.stderr
    assert list(work.iterdir()) == []
