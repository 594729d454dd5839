"""Composing and checking the configuration before anything starts.

:func:`compose` builds the config from ``config/`` with Hydra overrides (the same tree the CLI
uses); :func:`validate` checks the cross-field rules on a composed config and raises
:class:`~embodirl.errors.ConfigError` with one sentence naming the key and the fix. Nothing here
creates files or starts workers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from embodirl.errors import AssetsMissing, ConfigError
from embodirl.paths import config_dir
from embodirl.placement import data_parallel_size, placement_from_config, use_ray
from embodirl.plain import to_plain

GROUPS = ("env", "model", "algorithm")
REWARD_TYPES = ("chunk_level", "action_level")
LOGPROB_TYPES = ("token", "action", "chunk")
LOSS_AGG_FUNCS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_PENALTIES = ("kl", "abs", "mse", "low_var_kl")
KL_CTRL_TYPES = ("fixed", "adaptive")
ROLLOUT_BACKENDS = ("huggingface", "vllm")
RESUME_MODES = ("auto", "disable")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def available_options(group: str, root: Path | None = None) -> list[str]:
    """Option names of a config group (files starting with ``_`` are shared bases, not options)."""
    folder = (root or config_dir()) / group
    return sorted(p.stem for p in folder.glob("*.yaml") if not p.stem.startswith("_"))


def check_group_overrides(overrides: Sequence[str], root: Path | None = None) -> None:
    """Reject ``env=nope`` style choices (also inside sweeps ``env=a,b``) listing the available options."""
    for override in overrides:
        match = re.match(r"^(?:\+|\+\+|~)?(env|model|algorithm)(@[\w.]+)?=(.*)$", override.strip())
        if not match:
            continue
        group, value = match.group(1), match.group(3)
        value = re.sub(r"^(choice|glob)\((.*)\)$", r"\2", value)
        options = available_options(group, root)
        for choice in (v.strip().strip("'\"") for v in value.split(",")):
            if choice and "*" not in choice and choice not in options:
                raise ConfigError(group, f"unknown {group} '{choice}'; available: {', '.join(options)}")


def compose(overrides: Sequence[str] = (), *, config_path: Path | None = None, with_hydra: bool = False) -> DictConfig:
    """Compose ``config.yaml`` with ``overrides`` (Hydra syntax) and return it resolved-able.

    Hydra errors (unknown keys, bad syntax) become a one-sentence :class:`ConfigError`.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    root = Path(config_path) if config_path else config_dir()
    check_group_overrides(overrides, root)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(root), version_base=None):
            cfg = hydra_compose("config", overrides=list(overrides), return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError("", _one_sentence(exc)) from None
    finally:
        GlobalHydra.instance().clear()
    # Resolve the ${hydra:...} interpolations now, while the Hydra config is at hand.
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)
    if not with_hydra:
        cfg = _without_hydra(cfg)
    return cfg


def _without_hydra(cfg: DictConfig) -> DictConfig:
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    out = OmegaConf.create(container)
    OmegaConf.set_struct(out, True)
    return out


def _one_sentence(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text.split(" full_key:")[0].rstrip(".") + "."


def _fail(key: str, message: str):
    raise ConfigError(key, message)


def _choice(cfg: DictConfig, key: str, choices: Sequence[str]) -> str:
    value = OmegaConf.select(cfg, key)
    if value not in choices:
        _fail(key, f"'{value}' is not one of {', '.join(map(str, choices))}")
    return value


def _positive(cfg: DictConfig, key: str, *, allow_zero: bool = False, integer: bool = True) -> float:
    value = OmegaConf.select(cfg, key)
    ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        kind = "integer" if integer else "number"
        _fail(key, f"must be a {'non-negative' if allow_zero else 'positive'} {kind}, got {value!r}")
    return value


def _ids(ids: Sequence[int]) -> str:
    return ",".join(map(str, ids))


def validate(cfg: DictConfig, *, check_envs: bool = True, num_devices: int | None = None,
             accelerator: str | None = None) -> None:
    """Check every cross-field rule; raise :class:`ConfigError` on the first violation.

    ``check_envs`` also runs the simulator adapters' and policy's own checks (task ids, assets, model
    path), which may import the simulator packages.
    """
    from embodirl.algorithms.advantages import ADVANTAGE_ESTIMATORS, CRITIC_ESTIMATORS, GROUPED_ESTIMATORS

    alg, actor, rollout = cfg.algorithm, cfg.actor, cfg.rollout
    # --- single values -----------------------------------------------------------------------------
    adv_type = _choice(cfg, "algorithm.adv_type", sorted(ADVANTAGE_ESTIMATORS))
    _choice(cfg, "algorithm.reward_type", REWARD_TYPES)
    _choice(cfg, "algorithm.logprob_type", LOGPROB_TYPES)
    _choice(cfg, "algorithm.loss_agg_func", LOSS_AGG_FUNCS)
    _choice(cfg, "algorithm.kl_penalty", KL_PENALTIES)
    _choice(cfg, "algorithm.kl_ctrl.type", KL_CTRL_TYPES)
    _choice(cfg, "rollout.backend", ROLLOUT_BACKENDS)
    _choice(cfg, "runner.resume_mode", RESUME_MODES)
    from embodirl.runner.evaluation import (
        check_eval_episodes,
        check_eval_num_envs,
        check_eval_protocol,
    )

    check_eval_protocol(cfg.runner, cfg.env.eval)
    check_eval_episodes(cfg.runner)
    check_eval_num_envs(cfg.runner)
    if cfg.runner.get("torch_threads", "auto") not in (None, "auto"):
        _positive(cfg, "runner.torch_threads")
    from embodirl.runner.checkpoint import eval_model_path, resume_source

    # an explicit runner.resume_dir must hold a complete checkpoint (raises naming it; reads only);
    # evaluation may also name a model checkpoint there (loaded as model.path)
    if eval_model_path(cfg.runner) is None:
        resume_source(cfg.runner.resume_dir, cfg.runner.resume_mode, cfg.runner.output_dir)
    for key in ("algorithm.gamma", "algorithm.gae_lambda"):
        value = OmegaConf.select(cfg, key)
        if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            _fail(key, f"must be in [0, 1], got {value!r}")
    for key in ("algorithm.clip_ratio_low", "algorithm.clip_ratio_high"):
        _positive(cfg, key, integer=False)
    if alg.clip_ratio_c is not None and alg.clip_ratio_c <= 1.0:
        _fail("algorithm.clip_ratio_c", f"the dual-clip constant must be greater than 1 (or null), got {alg.clip_ratio_c}")
    for key in ("actor.optim.lr", "actor.optim.value_lr"):
        _positive(cfg, key, integer=False)
    for key in ("env.train.num_envs", "env.eval.num_envs", "env.train.max_episode_steps",
                "env.eval.max_episode_steps", "actor.micro_batch_size", "actor.global_batch_size",
                "rollout.pipeline_stage_num", "rollout.rollout_epoch", "rollout.num_workers",
                "env_workers.num_workers", "algorithm.group_size", "algorithm.update_epochs",
                "model.action_chunk", "cluster.num_nodes"):
        _positive(cfg, key)
    for env_key in ("env.train", "env.eval"):
        timeout = OmegaConf.select(cfg, f"{env_key}.step_timeout_s")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            _fail(f"{env_key}.step_timeout_s", f"must be null (wait for ever) or a positive number of seconds, "
                                               f"got {timeout!r}")
    if rollout.temperature is not None and rollout.temperature < 0:
        _fail("rollout.temperature", f"must be non-negative, got {rollout.temperature}")
    if rollout.top_p is not None and not 0.0 < rollout.top_p <= 1.0:
        _fail("rollout.top_p", f"must be in (0, 1], got {rollout.top_p}")
    if rollout.top_k is not None and rollout.top_k < 1:
        _fail("rollout.top_k", f"must be at least 1 (or null), got {rollout.top_k}")
    if rollout.backend == "vllm":
        _fail("rollout.backend", "the vllm backend is not available in this version; use rollout.backend=huggingface")
    ray_choice = cfg.cluster.get("use_ray", "auto")
    if not (isinstance(ray_choice, bool) or ray_choice == "auto"):
        _fail("cluster.use_ray", f"{ray_choice!r} is not one of auto, true, false")
    _positive(cfg, "actor.cpu_world_size")
    restarts = cfg.runner.get("max_restarts", 0)
    if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 0:
        _fail("runner.max_restarts", f"must be a non-negative integer, got {restarts!r}")
    if ray_choice is False:
        for key in ("env_workers.num_workers", "rollout.num_workers", "cluster.num_nodes", "actor.cpu_world_size"):
            if int(OmegaConf.select(cfg, key)) > 1:
                _fail("cluster.use_ray", f"false runs every worker in this process, but {key} = "
                                         f"{OmegaConf.select(cfg, key)} needs Ray; set cluster.use_ray=auto or {key}=1")

    # --- placement and data-parallel size --------------------------------------------------------------
    placement = placement_from_config(cfg.cluster, num_devices, accelerator)
    dp = data_parallel_size(cfg, placement)
    if placement.accelerator == "cpu" and dp > len(placement.devices["actor"]):
        _fail("actor.cpu_world_size", f"{dp} learner ranks need {dp} CPU slots but cluster.component_placement gives "
                                      f"actor {len(placement.devices['actor'])} ({_ids(placement.devices['actor'])}); "
                                      f"lower actor.cpu_world_size or give actor more slots")
    if placement.accelerator == "gpu" and int(cfg.actor.get("cpu_world_size", 1) or 1) > 1:
        _fail("actor.cpu_world_size", f"on GPUs the learner has one rank per device placement gives actor "
                                      f"({dp}); leave actor.cpu_world_size=1 and set cluster.component_placement")

    # --- batch arithmetic -------------------------------------------------------------------------------
    micro, global_bs = int(actor.micro_batch_size), int(actor.global_batch_size)
    # each rank takes global/dp rows per optimizer step, in micro-batches of at most micro rows
    if global_bs % dp:
        _fail("actor.global_batch_size", f"{global_bs} trajectories do not split evenly over the data-parallel size "
                                         f"{dp} (learner ranks); make it a multiple of {dp}")
    per_rank = global_bs // dp
    if micro < per_rank and per_rank % micro:
        _fail("actor.global_batch_size", f"the {per_rank} rows each of the {dp} learner rank(s) takes per optimizer "
                                         f"step are not divisible by actor.micro_batch_size = {micro}; make "
                                         f"global_batch_size a multiple of {micro * dp}")
    num_envs = int(cfg.env.train.num_envs)
    rollout_batch = num_envs * int(rollout.rollout_epoch)
    G = int(alg.group_size)
    if num_envs % G:
        _fail("algorithm.group_size", f"env.train.num_envs = {num_envs} is not divisible by algorithm.group_size = {G}; "
                                      f"use a multiple of {G} envs")
    if not cfg.runner.only_eval and rollout_batch % global_bs:
        _fail("actor.global_batch_size", f"the rollout batch env.train.num_envs x rollout.rollout_epoch = {rollout_batch} "
                                         f"trajectories is not divisible by actor.global_batch_size = {global_bs}")
    if adv_type in GROUPED_ESTIMATORS:
        if G < 2:
            _fail("algorithm.group_size", f"adv_type={adv_type} compares trajectories within a group: set group_size >= 2")
        if not cfg.env.train.get("use_fixed_reset_state_ids", False):
            _fail("env.train.use_fixed_reset_state_ids", f"adv_type={adv_type} needs groups that share an init state: "
                                                          "set env.train.use_fixed_reset_state_ids=true")
    if alg.filter_groups.enable:
        lo, hi = float(alg.filter_groups.min_success), float(alg.filter_groups.max_success)
        if G < 2:
            _fail("algorithm.filter_groups.enable", "group filtering keeps groups whose success rate lies strictly "
                                                   f"between {lo} and {hi}, and a group of 1 trajectory scores 0 or 1, so "
                                                   "every row would be dropped; set algorithm.group_size >= 2 or "
                                                   "algorithm.filter_groups.enable=false")
        if not 0.0 <= lo < hi <= 1.0:
            _fail("algorithm.filter_groups.min_success", f"the kept success range ({lo}, {hi}) must satisfy "
                                                        "0 <= min_success < max_success <= 1")
    resample = alg.filter_groups.get("resample", False)
    if not isinstance(resample, bool):
        _fail("algorithm.filter_groups.resample", f"must be true or false, got {resample!r}")
    if resample and not alg.filter_groups.enable:
        _fail("algorithm.filter_groups.resample", "re-sampling collects more rollouts until the step holds its batch "
                                                  "of kept groups, so it needs algorithm.filter_groups.enable=true")
    _positive(cfg, "algorithm.filter_groups.max_resample_rounds", allow_zero=True)
    if adv_type == "remax":
        if cfg.env.train.get("auto_reset", False):
            _fail("env.train.auto_reset", "adv_type=remax compares each row's episode with a greedy one from the "
                                          "same start, so a row must hold one episode: set env.train.auto_reset=false")
        if use_ray(cfg) and not cfg.runner.eval_greedy:
            _fail("runner.eval_greedy", "adv_type=remax runs its baseline rollouts with the rollout workers' "
                                        "evaluation sampling, which must be greedy: set runner.eval_greedy=true")
    stages, workers = int(rollout.pipeline_stage_num), int(cfg.env_workers.num_workers)
    if num_envs % (stages * workers):
        _fail("env.train.num_envs", f"{num_envs} envs cannot be split over env_workers.num_workers x "
                                    f"rollout.pipeline_stage_num = {workers} x {stages}; use a multiple of {workers * stages}")
    if (num_envs // (stages * workers)) % G and G > 1:
        _fail("algorithm.group_size", f"each pipeline stage holds {num_envs // (stages * workers)} envs, which does not "
                                      f"hold whole groups of {G}; change env.train.num_envs or the stage/worker counts")

    if not cfg.runner.only_eval:  # the learner's own rules (schedule, early stopping), before any worker starts
        from embodirl.learner.config import LearnerConfig

        LearnerConfig.from_config({"algorithm": OmegaConf.to_container(alg, resolve=True),
                                   "actor": OmegaConf.to_container(actor, resolve=True)}).check(dp)

    # --- episode length vs chunk ------------------------------------------------------------------------
    H = int(cfg.model.action_chunk)
    for env_key in ("env.train", "env.eval"):
        steps = int(OmegaConf.select(cfg, f"{env_key}.max_episode_steps"))
        if H > steps:
            _fail("model.action_chunk", f"the chunk of {H} actions is longer than {env_key}.max_episode_steps = {steps}")
    explicit = rollout.get("max_decisions")
    if explicit is not None:
        _positive(cfg, "rollout.max_decisions")
        steps = int(cfg.env.train.max_episode_steps)
        if (int(explicit) - 1) * H >= steps:
            _fail("rollout.max_decisions", f"{explicit} decisions x {H} actions exceed env.train.max_episode_steps = {steps}; "
                                           f"at most {math.ceil(steps / H)} decisions fit")
    if alg.reward_type != cfg.env.train.get("reward_type", alg.reward_type):
        _fail("env.train.reward_type", f"'{cfg.env.train.reward_type}' differs from algorithm.reward_type "
                                       f"'{alg.reward_type}'; set both to the same value")
    value_type = cfg.model.get("value_type")
    if adv_type in CRITIC_ESTIMATORS and value_type is None:
        _fail("model.value_type", f"adv_type={adv_type} needs a value head: set model.value_type to chunk_level or "
                                  "action_level")
    if alg.reward_type == "action_level" and value_type == "chunk_level" and adv_type in CRITIC_ESTIMATORS:
        _fail("model.value_type", "action_level rewards with GAE need action_level values; set model.value_type=action_level")

    # --- model path ---------------------------------------------------------------------------------
    path = cfg.model.get("path")
    if path:
        local = Path(str(path)).expanduser()
        if not local.exists() and (str(path).startswith((".", "/", "~")) or not _HUB_ID.match(str(path))):
            _fail("model.path", f"'{path}' does not exist; give a checkpoint directory or a hub id like org/name")

    if check_envs:
        from embodirl.envs.registry import check_env_config
        from embodirl.models.registry import get_policy_builder

        for env_key in ("env.train", "env.eval"):
            try:
                check_env_config(OmegaConf.select(cfg, env_key), env_key)
            except ConfigError as exc:
                if not exc.key.startswith("env."):
                    raise ConfigError(f"{env_key}.{exc.key}" if exc.key else env_key, str(exc).split(": ", 1)[-1]) from None
                raise
            except AssetsMissing:
                raise
        builder = get_policy_builder(cfg.model.name)
        if getattr(builder, "check_run", None) is not None:  # rules between the checkpoint and the run
            builder.check_run(to_plain(cfg), eval_model_path(cfg.runner) or cfg.model.get("path"))
        check = getattr(builder, "check_config", None)
        if check is not None:
            check(OmegaConf.to_container(cfg.model, resolve=True))
