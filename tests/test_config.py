"""Composition and the cross-field rules: every malformed config gets one sentence naming its key."""

import pytest
from omegaconf import OmegaConf

from embodirl.config import available_options, compose, validate
from embodirl.errors import ConfigError
from embodirl.rollout.records import decisions_per_episode
from tests import cli_runs


def _check(cfg):
    validate(cfg, check_envs=False, num_devices=2, accelerator="cpu")


def test_default_config_is_valid(compose_cfg):
    cfg = compose_cfg()
    _check(cfg)
    assert cfg.env.train.adapter == cfg.env.eval.adapter


def test_env_choice_fills_train_and_eval(compose_cfg):
    cfg = compose_cfg("env=libero_10", "model=openvla_oft")
    for node in (cfg.env.train, cfg.env.eval):
        assert node.suite == "libero_10" and node.num_settle_steps == 10
    # the RL recipe trains 512-step episodes; evaluation keeps the OFT protocol's 520
    assert cfg.env.train.max_episode_steps == 512 and cfg.env.eval.max_episode_steps == 520
    assert cfg.model.llm.hidden_size == 4096 and cfg.model.lora.rank == 32
    assert decisions_per_episode(cfg) == 64  # 512 / 8


def test_eval_env_can_differ(compose_cfg):
    cfg = compose_cfg("env=libero_10", "env@env.eval=libero_goal")
    assert cfg.env.train.suite == "libero_10" and cfg.env.eval.suite == "libero_goal"


def test_tiny_preset_inherits_full_preset(compose_cfg):
    cfg = compose_cfg("model=openvla_oft_tiny")
    assert cfg.model.name == "openvla_oft" and cfg.model.action_chunk == 8
    assert cfg.model.llm.hidden_size < 4096 and cfg.model.llm.vocab_size == 32064


def test_tiny_and_full_models_never_share_an_output_folder(compose_cfg):
    """The folder is named by the options chosen, not by model.name (both presets build ``openvla_oft``), so an
    evaluation of the tiny model never leaves a checkpoint folder a full-size run would resume from."""
    tiny = compose_cfg("env=libero_10", "model=openvla_oft_tiny")
    full = compose_cfg("env=libero_10", "model=openvla_oft")
    assert tiny.model.name == full.model.name == "openvla_oft"
    assert tiny.runner.output_dir == "outputs/libero_10_openvla_oft_tiny"
    assert full.runner.output_dir == "outputs/libero_10_openvla_oft"
    assert compose_cfg().runner.output_dir == "outputs/maniskill_pushcube_state_mlp"


@pytest.mark.parametrize("model", ["openvla_oft_tiny", "openvla_oft"])
def test_eval_of_the_tiny_model_prints_its_own_output_folder(model, tmp_path):
    """`embodirl eval env=libero_10 model=openvla_oft_tiny`, as a new user tries it (here with --cfg job): its own
    folder, apart from the training runs of that env and model (outputs/libero_10_<model>)."""

    proc = cli_runs.run(["eval", "env=libero_10", f"model={model}", "--cfg", "job", "--resolve"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert cfg.runner.output_dir == f"outputs/eval/libero_10_{model}" and cfg.runner.only_eval is True
    assert list(tmp_path.iterdir()) == []


def test_options_hide_shared_bases():
    envs = available_options("env")
    assert "libero_10" in envs and "maniskill_pickcube" in envs
    assert not any(name.startswith("_") for name in envs)


@pytest.mark.parametrize("overrides, key, fragment", [
    (["actor.global_batch_size=8", "actor.micro_batch_size=3"], "actor.global_batch_size", "not divisible"),
    (["env.train.num_envs=6", "algorithm=grpo", "env.train.use_fixed_reset_state_ids=true"],
     "algorithm.group_size", "not divisible by algorithm.group_size"),
    (["algorithm=grpo", "env.train.num_envs=8"], "env.train.use_fixed_reset_state_ids", "share an init state"),
    (["algorithm.adv_type=grpo", "algorithm.group_size=1", "env.train.use_fixed_reset_state_ids=true"],
     "algorithm.group_size", "group_size >= 2"),
    (["rollout.max_decisions=100"], "rollout.max_decisions", "exceed env.train.max_episode_steps"),
    (["model.action_chunk=64"], "model.action_chunk", "longer than"),
    (["cluster.component_placement='actor,rollout,env: 0-5'"], "cluster.component_placement", "names device 2"),
    (["cluster.component_placement='env: 1-0; actor,rollout: all'"], "cluster.component_placement", "ends before"),
    (["cluster.component_placement='actor,rollout: all'"], "cluster.component_placement", "no devices"),
    (["algorithm.adv_type=ppo2"], "algorithm.adv_type", "not one of gae, grpo"),
    (["algorithm.loss_agg_func=mean"], "algorithm.loss_agg_func", "not one of"),
    (["algorithm.kl_penalty=js"], "algorithm.kl_penalty", "not one of"),
    (["algorithm.gamma=1.5"], "algorithm.gamma", "must be in [0, 1]"),
    (["actor.optim.lr=0"], "actor.optim.lr", "positive"),
    (["algorithm.clip_ratio_c=0.5"], "algorithm.clip_ratio_c", "greater than 1"),
    (["rollout.pipeline_stage_num=3"], "env.train.num_envs", "cannot be split"),
    (["rollout.top_p=0"], "rollout.top_p", "(0, 1]"),
    (["model.path=/nonexistent/ckpt"], "model.path", "does not exist"),
    (["rollout.backend=vllm"], "rollout.backend", "'vllm' is not one of huggingface"),
    (["algorithm.reward_type=action_level"], "env.train.reward_type", "differs"),
    (["env.train.num_envs=0"], "env.train.num_envs", "positive integer"),
    (["actor.cpu_world_size=2", "actor.global_batch_size=9", "actor.micro_batch_size=1"],
     "actor.global_batch_size", "do not split evenly over the data-parallel size 2"),
    (["actor.cpu_world_size=3"], "actor.cpu_world_size", "3 actor ranks need 3 CPU slots"),
    (["actor.cpu_world_size=2", "cluster.use_ray=false"], "cluster.use_ray", "actor.cpu_world_size = 2 needs Ray"),
    (["runner.max_restarts=-1"], "runner.max_restarts", "non-negative integer"),
    (["runner.torch_threads=0"], "runner.torch_threads", "positive integer"),
    (["algorithm.filter_groups.enable=true"], "algorithm.filter_groups.enable", "every row would be dropped"),
    (["algorithm=grpo", "env.train.use_fixed_reset_state_ids=true", "algorithm.filter_groups.enable=true",
      "algorithm.filter_groups.min_success=0.9", "algorithm.filter_groups.max_success=0.1"],
     "algorithm.filter_groups.min_success", "0 <= min_success < max_success <= 1"),
    (["actor.optim.lr_schedule=step"], "actor.optim.lr_schedule", "'step' is not one of constant, linear, cosine"),
    (["actor.optim.lr_schedule=linear", "actor.optim.lr_decay_steps=null"],
     "actor.optim.lr_decay_steps", "positive number of training steps"),
    (["algorithm.early_stop_kl=-1"], "algorithm.early_stop_kl", "must be a positive number or null"),
    # the default job's recipe trains and evaluates in joint control; changing only training's would crash
    # the first evaluation on the action size
    (["env.train.control_mode=pd_ee_delta_pos"], "env.eval.control_mode",
     "is pd_joint_delta_pos but env.train.control_mode is pd_ee_delta_pos"),
    (["rollout.merge_lora=true"], "rollout.merge_lora", "has no LoRA adapter to merge"),
    (["env=toy_reach", "model=openvla_oft_tiny", "rollout.merge_lora=true", "cluster.use_ray=false"],
     "rollout.merge_lora", "the rollout acts with the actor's module"),
    (["rollout.compile=true", "cluster.use_ray=false"], "rollout.compile", "the rollout acts with the actor's module"),
    (["runner.guard.enabled=true", "runner.val_check_interval=0"], "runner.guard.success_drop", "never evaluates"),
    (["runner.guard.enabled=true", "runner.guard.max_kl=0.1"], "runner.guard.max_kl", "algorithm.kl_beta > 0"),
    (["runner.guard.lr_factor=0"], "runner.guard.lr_factor", "in (0, 1]"),
])
def test_malformed_configs_rejected_with_one_sentence(compose_cfg, overrides, key, fragment):
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError) as info:
        _check(cfg)
    message = str(info.value)
    assert info.value.key.startswith(key), message
    assert message.startswith(key) and fragment in message, message
    assert "\n" not in message and message.count(". ") == 0, message


@pytest.mark.parametrize("override, fragment", [
    ("env=nope", "unknown env 'nope'; available: "),
    ("model=gpt", "unknown model 'gpt'; available: "),
    ("env=libero_10,nope", "unknown env 'nope'"),
    ("actor.optim.nonexistent=1", "actor.optim.nonexistent: unknown key"),
])
def test_unknown_choices_and_keys(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        compose([override])


def test_hub_id_model_path_is_not_checked_locally(compose_cfg):
    _check(compose_cfg("model=openvla_oft_tiny", "model.path=moojink/openvla-7b-oft-finetuned-libero-10",
                       "env=toy_reach"))


@pytest.mark.parametrize("option", available_options("env"))
def test_every_env_option_composes_into_train_and_eval(option):
    # Each option file starts with "# @package env.train"; without it the keys land in `env` itself.
    cfg = compose([f"env={option}"])
    train, evaluation = (OmegaConf.to_container(cfg.env[k]) for k in ("train", "eval"))
    # a recipe (config/recipe/<env>_<model>.yaml) may size the evaluation batch differently
    train.pop("num_envs"), evaluation.pop("num_envs")
    assert cfg.env.train.adapter and train == evaluation, option
    assert set(cfg.env.keys()) == {"train", "eval"}, option
