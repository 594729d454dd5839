"""The typed sections of ``config/config.yaml``: runner, algorithm, rollout, env_workers, actor, cluster.

Each dataclass declares its keys' types and allowed values (:mod:`embodirl.config_fields`); the values
themselves live in the YAML tree. A section's cross-field rules sit in its ``rules(cfg, ctx)``, next to the
fields they relate; :func:`embodirl.schema.check` runs them in the order the sections are listed here.
Choice lists come from the registries that define the names (advantage estimators, loss aggregations, KL
estimators, learning-rate schedules, rollout backends).
"""

from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from embodirl.config_fields import num, one_of, required, section
from embodirl.errors import ConfigError


def _fail(key: str, message: str):
    raise ConfigError(key, message)


# --- choice lists, read from the modules that define the names ------------------------------------------
def _adv_types():
    from embodirl.algorithms.advantages import ADVANTAGE_ESTIMATORS
    return sorted(ADVANTAGE_ESTIMATORS)


def _known_adv_type(name) -> bool:
    from embodirl.algorithms.advantages import known_estimator
    return known_estimator(name)


def reward_types():
    from embodirl.envs.base import REWARD_TYPES
    return REWARD_TYPES


def _logprob_types():
    from embodirl.algorithms.losses import LOGPROB_TYPES
    return LOGPROB_TYPES


def _aggregations():
    from embodirl.algorithms.aggregation import AGGREGATIONS
    return list(AGGREGATIONS)


def _kl_estimators():
    from embodirl.algorithms.kl import KL_ESTIMATORS
    return list(KL_ESTIMATORS)


def _kl_controllers():
    from embodirl.algorithms.kl import KL_CONTROLLERS
    return KL_CONTROLLERS


#: choices of keys whose code sits above the schema (the actor, the runner): declared here, imported there
LR_SCHEDULES = ("constant", "linear", "cosine")           # actor.optim.lr_schedule (embodirl/actor/optim.py)
EVAL_PROTOCOLS = ("parallel", "oft")                      # runner.eval_protocol (embodirl/runner/evaluation.py)
GUARD_ACTIONS = ("rollback", "stop")                      # runner.guard.action (embodirl/runner/guard.py)


def _rollout_backends():
    from embodirl.registry import BACKENDS
    return BACKENDS.available()


AUTO_OR_BOOL = ("auto", True, False)
RESUME_MODES = ("auto", "disable")


# --- runner ------------------------------------------------------------------------------------------------
@dataclass
class Logger:
    console: bool = required()
    tensorboard: bool = required()
    wandb: bool = required()
    wandb_mode: str = one_of(("offline", "online", "disabled"))
    project: str = required()


@dataclass
class Guard:
    enabled: bool = required()
    success_drop: float | None = num(0, 1, lo_open=True, null=True)
    patience: int = num(1)
    max_kl: float | None = num(0, lo_open=True, null=True)
    min_entropy: float | None = num(null=True)
    nonfinite: bool = required()
    action: str = one_of(GUARD_ACTIONS)
    lr_factor: float = num(0, 1, lo_open=True)
    max_rollbacks: int = num(0)


@dataclass
class Runner:
    experiment_name: str = required()
    output_dir: str = required()
    seed: int = num(0)
    max_steps: int = num(1)
    only_eval: bool = required()
    val_check_interval: int = num(0)
    val_before_train: bool = required()
    save_interval: int = num(0)
    resume_dir: str | None = required()
    resume_mode: str = one_of(RESUME_MODES)
    max_restarts: int = num(0)
    logger: Logger = section(Logger)
    progress_bar: bool = required()
    torch_threads: Any = num(1, auto=True, integer=True)
    train_video_interval: int = num(0)
    eval_num_videos: int = num(0)
    eval_episodes_per_task: int | None = num(1, null=True)
    eval_greedy: bool = required()
    eval_protocol: str = one_of(EVAL_PROTOCOLS)
    eval_episodes: list[int] | None = required()
    eval_num_envs: int | None = num(1, null=True)
    guard: Guard = section(Guard)

    @staticmethod
    def rules(cfg, ctx) -> None:
        """The rules between runner keys and the rest of the config; those that read checkpoints on disk or the
        evaluation protocols' needs are the runner's own (:func:`embodirl.runner.rules.check`)."""
        guard = cfg.runner.guard
        if guard.enabled and guard.success_drop is not None and not cfg.runner.val_check_interval:
            _fail("runner.guard.success_drop", "watches evaluation success, and runner.val_check_interval=0 never "
                                               "evaluates: set runner.val_check_interval, or success_drop=null")
        if guard.enabled and guard.max_kl is not None and not float(cfg.algorithm.kl_beta) > 0:
            _fail("runner.guard.max_kl", "watches the KL to the reference policy, which a run measures only with "
                                         "algorithm.kl_beta > 0; set it, or max_kl=null")


# --- algorithm ---------------------------------------------------------------------------------------------
@dataclass
class KLCtrl:
    type: str = one_of(_kl_controllers)
    target_kl: float | None = num(0, lo_open=True, null=True)     # verl's algorithm.kl_ctrl.target_kl
    horizon: float = num(0, lo_open=True)


@dataclass
class FilterGroups:
    enable: bool = required()
    min_success: float = num(0, 1)
    max_success: float = num(0, 1)
    resample: bool = required()
    max_resample_rounds: int = num(0)


@dataclass
class Algorithm:
    adv_type: str = one_of(_adv_types, known=_known_adv_type)
    group_size: int = num(1)
    reward_type: str = one_of(reward_types)
    logprob_type: str = one_of(_logprob_types)
    gamma: float = num(0, 1)
    gae_lambda: float = num(0, 1)
    normalize_advantages: bool = required()
    norm_adv_by_std_in_grpo: bool = required()
    clip_ratio_low: float = num(0, 1, lo_open=True, hi_open=True)
    clip_ratio_high: float = num(0, lo_open=True)
    clip_ratio_c: float | None = num(1, lo_open=True, null=True)   # dual clip
    value_clip: float | None = num(0, lo_open=True, null=True)
    huber_delta: float | None = num(0, lo_open=True, null=True)
    value_coef: float = num(0)
    entropy_bonus: float = num(0)
    loss_agg_func: str = one_of(_aggregations)
    kl_beta: float = num(0)
    kl_penalty: str = one_of(_kl_estimators)
    use_kl_loss: bool = required()
    kl_ctrl: KLCtrl = section(KLCtrl)
    filter_groups: FilterGroups = section(FilterGroups)
    update_epochs: int = num(1)
    early_stop_kl: float | None = num(0, lo_open=True, null=True)
    recompute_old_logprob: bool = required()

    @staticmethod
    def rules(cfg, ctx) -> None:
        from embodirl.algorithms.advantages import estimator_spec

        alg = cfg.algorithm
        G, adv_type = int(alg.group_size), alg.adv_type
        spec = estimator_spec(adv_type)
        if spec.groups:
            if G < 2:
                _fail("algorithm.group_size", f"adv_type={adv_type} compares trajectories within a group: set "
                                              "group_size >= 2")
            if not cfg.env.train.get("use_fixed_reset_state_ids", False):
                _fail("env.train.use_fixed_reset_state_ids", f"adv_type={adv_type} needs groups that share an init "
                                                              "state: set env.train.use_fixed_reset_state_ids=true")
        fg = alg.filter_groups
        if fg.enable:
            lo, hi = float(fg.min_success), float(fg.max_success)
            if G < 2:
                _fail("algorithm.filter_groups.enable", "group filtering keeps groups whose success rate lies strictly "
                                                       f"between {lo} and {hi}, and a group of 1 trajectory scores 0 or "
                                                       "1, so every row would be dropped; set algorithm.group_size >= 2 "
                                                       "or algorithm.filter_groups.enable=false")
            if not lo < hi:
                _fail("algorithm.filter_groups.min_success", f"the kept success range ({lo}, {hi}) must satisfy "
                                                            "0 <= min_success < max_success <= 1")
        if fg.resample and not fg.enable:
            _fail("algorithm.filter_groups.resample", "re-sampling collects more rollouts until the step holds its "
                                                      "batch of kept groups, so it needs algorithm.filter_groups.enable=true")
        if spec.greedy_baseline:
            if cfg.env.train.get("auto_reset", False):
                _fail("env.train.auto_reset", f"adv_type={adv_type} compares each row's episode with a greedy one from "
                                              "the same start, so a row must hold one episode: set "
                                              "env.train.auto_reset=false")
            if ctx.use_ray and not cfg.runner.eval_greedy:
                _fail("runner.eval_greedy", f"adv_type={adv_type} runs its baseline rollouts with the inference workers' "
                                            "evaluation sampling, which must be greedy: set runner.eval_greedy=true")
        if alg.reward_type != cfg.env.train.get("reward_type", alg.reward_type):
            _fail("env.train.reward_type", f"'{cfg.env.train.reward_type}' differs from algorithm.reward_type "
                                           f"'{alg.reward_type}'; set both to the same value")


# --- rollout and env workers -------------------------------------------------------------------------------
@dataclass
class Channel:
    shm: bool = required()
    queue_size: int = num(1)


@dataclass
class Rollout:
    backend: str = one_of(_rollout_backends)
    num_workers: int = num(1)
    pipeline_stage_num: int = num(1)
    rollout_epoch: int = num(1)
    max_decisions: int | None = num(1, null=True)
    temperature: float | None = num(0, null=True)
    top_k: int | None = num(1, null=True)
    top_p: float | None = num(0, 1, lo_open=True, null=True)
    enable_offload: bool = required()
    merge_lora: bool = required()
    compile: bool = required()
    channel: Channel = section(Channel)

    @staticmethod
    def rules(cfg, ctx) -> None:
        import math

        if cfg.rollout.merge_lora:
            if not (cfg.model.get("lora") or {}).get("enabled", False):
                _fail("rollout.merge_lora", f"model {cfg.model.name} has no LoRA adapter to merge; set "
                                            "rollout.merge_lora=false")
            if not ctx.use_ray:
                _fail("rollout.merge_lora", "folds the adapter into an inference worker's own copy of the policy, and "
                                            "without Ray the rollout acts with the actor's module: set "
                                            "cluster.use_ray=true, or rollout.merge_lora=false")

        if cfg.rollout.compile and not ctx.use_ray:
            _fail("rollout.compile", "compiles an inference worker's own copy of the policy, and without Ray the "
                                     "rollout acts with the actor's module: set cluster.use_ray=true, or "
                                     "rollout.compile=false")

        H, steps = int(cfg.model.action_chunk), int(cfg.env.train.max_episode_steps)
        explicit = cfg.rollout.max_decisions
        if explicit is not None and (int(explicit) - 1) * H >= steps:
            _fail("rollout.max_decisions", f"{explicit} decisions x {H} actions exceed env.train.max_episode_steps = "
                                           f"{steps}; at most {math.ceil(steps / H)} decisions fit")
        num_envs, G = int(cfg.env.train.num_envs), int(cfg.algorithm.group_size)
        stages, workers = int(cfg.rollout.pipeline_stage_num), int(cfg.env_workers.num_workers)
        if num_envs % G:
            _fail("algorithm.group_size", f"env.train.num_envs = {num_envs} is not divisible by algorithm.group_size = "
                                          f"{G}; use a multiple of {G} envs")
        if num_envs % (stages * workers):
            _fail("env.train.num_envs", f"{num_envs} envs cannot be split over env_workers.num_workers x "
                                        f"rollout.pipeline_stage_num = {workers} x {stages}; use a multiple of "
                                        f"{workers * stages}")
        if (num_envs // (stages * workers)) % G and G > 1:
            _fail("algorithm.group_size", f"each pipeline stage holds {num_envs // (stages * workers)} envs, which does "
                                          f"not hold whole groups of {G}; change env.train.num_envs or the stage/worker "
                                          "counts")


@dataclass
class EnvWorkers:
    num_workers: int = num(1)
    enable_offload: bool = required()


# --- actor (the actor) -----------------------------------------------------------------------------------
@dataclass
class Optim:
    lr: float = num(0, lo_open=True)
    value_lr: float = num(0, lo_open=True)
    weight_decay: float = num(0)
    betas: list[float] = required()
    eps: float = num(0, lo_open=True)
    warmup_steps: int = num(0)
    lr_schedule: str = one_of(LR_SCHEDULES)
    lr_decay_steps: int | None = num(1, null=True)
    min_lr_ratio: float = num(0, 1)
    clip_grad: float | None = num(0, lo_open=True, null=True)


@dataclass
class FSDP:
    enabled: Any = one_of(AUTO_OR_BOOL)
    param_dtype: str | None = one_of(("float32", "bfloat16", "float16"), null=True)
    reduce_dtype: str | None = one_of(("float32", "bfloat16", "float16"), null=True)
    cpu_offload: bool = required()
    gradient_checkpointing: bool = required()
    full_finetune: bool = required()


@dataclass
class ReplayBuffer:
    reuse_last_k: int = num(0)
    max_staleness: int = num(0)
    max_bytes: float = num(0, lo_open=True)


@dataclass
class Actor:
    global_batch_size: int = num(1)
    micro_batch_size: int = num(1)
    seed: int = num(0)
    cpu_world_size: int = num(1)
    enable_offload: bool = required()
    optim: Optim = section(Optim)
    fsdp: FSDP = section(FSDP)
    replay_buffer: ReplayBuffer = section(ReplayBuffer)

    @staticmethod
    def rules(cfg, ctx) -> None:
        actor, dp, placement = cfg.actor, ctx.dp, ctx.placement
        if placement.accelerator == "cpu" and dp > len(placement.devices["actor"]):
            _fail("actor.cpu_world_size", f"{dp} actor ranks need {dp} CPU slots but cluster.component_placement "
                                          f"gives actor {len(placement.devices['actor'])} "
                                          f"({','.join(map(str, placement.devices['actor']))}); lower "
                                          "actor.cpu_world_size or give actor more slots")
        if placement.accelerator == "gpu" and int(actor.cpu_world_size) > 1:
            _fail("actor.cpu_world_size", f"on GPUs the actor has one rank per device placement gives actor ({dp}); "
                                          "leave actor.cpu_world_size=1 and set cluster.component_placement")
        # each rank takes global/dp rows per optimizer step, in micro-batches of at most micro rows
        micro, global_bs = int(actor.micro_batch_size), int(actor.global_batch_size)
        if global_bs % dp:
            _fail("actor.global_batch_size", f"{global_bs} trajectories do not split evenly over the data-parallel "
                                             f"size {dp} (actor ranks); make it a multiple of {dp}")
        per_rank = global_bs // dp
        if micro < per_rank and per_rank % micro:
            _fail("actor.global_batch_size", f"the {per_rank} rows each of the {dp} actor rank(s) takes per optimizer "
                                             f"step are not divisible by actor.micro_batch_size = {micro}; make "
                                             f"global_batch_size a multiple of {micro * dp}")
        rollout_batch = int(cfg.env.train.num_envs) * int(cfg.rollout.rollout_epoch)
        if not cfg.runner.only_eval and rollout_batch % global_bs:
            _fail("actor.global_batch_size", f"the rollout batch env.train.num_envs x rollout.rollout_epoch = "
                                             f"{rollout_batch} trajectories is not divisible by actor.global_batch_size "
                                             f"= {global_bs}")
        if not cfg.runner.only_eval:  # the rules the actor checks again with its world size
            actor_rules(actor, cfg.algorithm, dp)


def actor_rules(actor, algorithm, world_size: int) -> None:
    """The actor rules that need only ``actor``, ``algorithm`` and the actor's world size (the actor runs
    them itself, :meth:`embodirl.actor.settings.ActorSettings.check`)."""
    global_bs = int(actor["global_batch_size"])
    if global_bs % world_size:
        _fail("actor.global_batch_size", f"{global_bs} trajectories do not split evenly over {world_size} actor "
                                         "ranks")
    optim = actor["optim"]
    if optim["lr_schedule"] != "constant" and optim["lr_decay_steps"] is None:
        _fail("actor.optim.lr_decay_steps", f"the {optim['lr_schedule']} schedule needs a positive number of training "
                                            "steps (default runner.max_steps), got None")
    if actor["fsdp"]["full_finetune"] and float(algorithm["kl_beta"]) > 0:
        _fail("actor.fsdp.full_finetune", "the KL reference is the adapter-disabled base model, which full "
                                          "fine-tuning changes; set algorithm.kl_beta=0")


# --- cluster -----------------------------------------------------------------------------------------------
@dataclass
class Cluster:
    use_ray: Any = one_of(AUTO_OR_BOOL)
    num_nodes: int = num(1)
    ray_address: str | None = required()
    num_gpus_per_node: int | None = num(0, null=True)
    component_placement: Any = required()      # RLinf syntax (embodirl.placement)

    @staticmethod
    def rules(cfg, ctx) -> None:
        if cfg.cluster.use_ray is False:
            for key in ("env_workers.num_workers", "rollout.num_workers", "cluster.num_nodes", "actor.cpu_world_size"):
                if int(OmegaConf.select(cfg, key)) > 1:
                    _fail("cluster.use_ray", f"false runs every worker in this process, but {key} = "
                                             f"{OmegaConf.select(cfg, key)} needs Ray; set cluster.use_ray=auto or {key}=1")


#: the sections of config.yaml that this module types, in the order their rules run
SECTIONS = {"runner": Runner, "algorithm": Algorithm, "cluster": Cluster, "rollout": Rollout, "actor": Actor,
            "env_workers": EnvWorkers}
