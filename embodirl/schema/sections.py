"""The typed sections of ``config/config.yaml``: runner, algorithm, rollout, env_workers, actor, cluster.

Each dataclass declares its keys' types and allowed values (:mod:`embodirl.config_fields`); the values
themselves live in the YAML tree. A section's cross-field rules sit in its ``rules(cfg, ctx)``, next to the
fields they relate; :func:`embodirl.schema.check` runs them in the order the sections are listed here.
The ``algorithm`` section is declared in :mod:`embodirl.algorithms.section`, below this layer, so that the
algorithms run on it; the others' choice lists come from the registries that define the names (learning-rate
schedules, inference engines).
"""

from dataclasses import dataclass
from typing import Any

from embodirl.algorithms.section import AlgorithmSection
from embodirl.config_fields import num, one_of, required, section
from embodirl.errors import ConfigError


def _fail(key: str, message: str):
    raise ConfigError(key, message)


# --- choice lists, read from the modules that define the names ------------------------------------------
#: choices of keys whose code sits above the schema (the actor, the runner): declared here, imported there
LR_SCHEDULES = ("constant", "linear", "cosine")           # actor.optim.lr_schedule (embodirl/actor/optim.py)
EVAL_PROTOCOLS = ("parallel", "oft")                      # runner.eval_protocol (embodirl/runner/evaluation.py)
GUARD_ACTIONS = ("rollback", "stop")                      # runner.guard.action (embodirl/runner/guard.py)
HUNG_ACTIONS = ("restart", "stop")                        # runner.worker_deadline.action (embodirl/workers/deadlines.py)


def _inference_engines():
    from embodirl.registry import ENGINES
    return ENGINES.available()


AUTO_OR_BOOL = ("auto", True, False)
RESUME_MODES = ("auto", "disable")


# --- runner ------------------------------------------------------------------------------------------------
@dataclass
class LoggerSection:
    console: bool = required()
    tensorboard: bool = required()
    wandb: bool = required()
    wandb_mode: str = one_of(("offline", "online", "disabled"))
    project: str = required()


@dataclass
class GuardSection:
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
class WorkerDeadlineSection:
    floor_s: float | None = num(0, lo_open=True, null=True)
    multiple: float = num(1)
    first_call_s: float = num(0, lo_open=True)
    action: str = one_of(HUNG_ACTIONS)


@dataclass
class RunnerSection:
    experiment_name: str = required()
    output_dir: str = required()
    seed: int = num(0)
    max_steps: int = num(1)
    only_eval: bool = required()
    val_check_interval: int = num(0)
    val_before_train: bool = required()
    save_interval: int = num(0)
    keep_last: int | None = num(1, null=True)
    resume_dir: str | None = required()
    resume_mode: str = one_of(RESUME_MODES)
    max_restarts: int = num(0)
    worker_deadline: WorkerDeadlineSection = section(WorkerDeadlineSection)
    logger: LoggerSection = section(LoggerSection)
    progress_bar: bool = required()
    predict_step_time: bool = required()
    torch_threads: Any = num(1, auto=True, integer=True)
    train_video_interval: int = num(0)
    eval_num_videos: int = num(0)
    eval_episodes_per_task: int | None = num(1, null=True)
    eval_greedy: bool = required()
    eval_protocol: str = one_of(EVAL_PROTOCOLS)
    eval_episodes: list[int] | None = required()
    eval_num_envs: int | None = num(1, null=True)
    eval_train_states_per_task: int = num(0)
    guard: GuardSection = section(GuardSection)

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


# --- rollout and env workers -------------------------------------------------------------------------------
@dataclass
class ChannelSection:
    shm: bool = required()
    queue_size: int = num(1)


@dataclass
class RolloutSection:
    backend: str = one_of(_inference_engines)
    num_workers: Any = num(1, auto=True, integer=True)    # auto: one per device of the rollout component on GPUs
    pipeline_stage_num: int = num(1)
    rollout_epoch: int = num(1)
    max_decisions: int | None = num(1, null=True)
    temperature: float | None = num(0, null=True)
    top_k: int | None = num(1, null=True)
    top_p: float | None = num(0, 1, lo_open=True, null=True)
    enable_offload: bool = required()
    merge_lora: Any = one_of(AUTO_OR_BOOL)      # auto: on GPUs through Ray (schema.resolve_fast_inference)
    compile: Any = one_of(AUTO_OR_BOOL)
    channel: ChannelSection = section(ChannelSection)

    @staticmethod
    def rules(cfg, ctx) -> None:
        import math

        from embodirl.models.registry import policy_family

        family = policy_family(cfg.model.name)
        if cfg.rollout.merge_lora:
            lora = getattr(cfg.model, "lora", None)      # the policies with adapters declare a lora section
            if not family.merge or lora is None or not lora.enabled:
                _fail("rollout.merge_lora", f"model {cfg.model.name} has no LoRA adapter to merge; set "
                                            "rollout.merge_lora=false")
            if not ctx.use_ray:
                _fail("rollout.merge_lora", "folds the adapter into an inference worker's own copy of the policy, and "
                                            "without Ray the rollout acts with the actor's module: set "
                                            "cluster.use_ray=true, or rollout.merge_lora=false")

        if cfg.rollout.compile and not family.compile:
            _fail("rollout.compile", f"model {cfg.model.name} is registered without compile (its inference copy cannot "
                                     "be compiled); set rollout.compile=false")
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
class EnvWorkersSection:
    num_workers: Any = num(1, auto=True, integer=True)    # auto: one per device of the env component on GPUs
    enable_offload: bool = required()


# --- actor (the actor) -----------------------------------------------------------------------------------
@dataclass
class OptimSection:
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
class FSDPSection:
    enabled: Any = one_of(AUTO_OR_BOOL)
    param_dtype: str | None = one_of(("float32", "bfloat16", "float16"), null=True)
    reduce_dtype: str | None = one_of(("float32", "bfloat16", "float16"), null=True)
    cpu_offload: bool = required()
    gradient_checkpointing: bool = required()
    full_finetune: bool = required()


@dataclass
class ReplayBufferSection:
    reuse_last_k: int = num(0)
    max_staleness: int = num(0)
    max_bytes: float = num(0, lo_open=True)


@dataclass
class ActorSection:
    global_batch_size: int = num(1)
    micro_batch_size: int = num(1)
    seed: int = num(0)
    cpu_world_size: int = num(1)
    enable_offload: bool = required()
    compile: bool = required()
    ema_decay: float = num(0, 1, hi_open=True)
    optim: OptimSection = section(OptimSection)
    fsdp: FSDPSection = section(FSDPSection)
    replay_buffer: ReplayBufferSection = section(ReplayBufferSection)

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
        if actor.compile and getattr(cfg.model, "gradient_checkpointing", False):   # a key OpenVLA-OFT's model has
            _fail("actor.compile", "compiles the blocks under transformers' own checkpointing wrapper, which "
                                   "model.gradient_checkpointing switches on; checkpoint the same blocks with "
                                   "actor.fsdp.gradient_checkpointing=true instead")
        if not cfg.runner.only_eval:  # the rules the actor checks again with its world size
            actor_rules(actor, cfg.algorithm, dp)


def actor_rules(actor, algorithm, world_size: int) -> None:
    """The actor rules that need only ``actor``, ``algorithm`` (typed sections or DictConfigs) and the actor's world
    size (the actor runs them itself, :meth:`embodirl.actor.settings.ActorSettings.check`)."""
    global_bs = int(actor.global_batch_size)
    if global_bs % world_size:
        _fail("actor.global_batch_size", f"{global_bs} trajectories do not split evenly over {world_size} actor "
                                         "ranks")
    optim = actor.optim
    if optim.lr_schedule != "constant" and optim.lr_decay_steps is None:
        _fail("actor.optim.lr_decay_steps", f"the {optim.lr_schedule} schedule needs a positive number of training "
                                            "steps (default runner.max_steps), got None")
    if actor.fsdp.full_finetune and float(algorithm.kl_beta) > 0:
        _fail("actor.fsdp.full_finetune", "the KL reference is the adapter-disabled base model, which full "
                                          "fine-tuning changes; set algorithm.kl_beta=0")


# --- cluster -----------------------------------------------------------------------------------------------
@dataclass
class ClusterSection:
    use_ray: Any = one_of(AUTO_OR_BOOL)
    num_nodes: int = num(1)
    ray_address: str | None = required()
    num_gpus_per_node: int | None = num(0, null=True)
    component_placement: Any = required()      # RLinf syntax (embodirl.placement)

    @staticmethod
    def rules(cfg, ctx) -> None:
        if cfg.cluster.use_ray is False:
            for key, value in (("env_workers.num_workers", cfg.env_workers.num_workers),
                               ("rollout.num_workers", cfg.rollout.num_workers), ("cluster.num_nodes", cfg.cluster.num_nodes),
                               ("actor.cpu_world_size", cfg.actor.cpu_world_size)):
                if value > 1:
                    _fail("cluster.use_ray", f"false runs every worker in this process, but {key} = "
                                             f"{value} needs Ray; set cluster.use_ray=auto or {key}=1")


#: the sections of config.yaml that this module types, in the order their rules run
SECTIONS = {"runner": RunnerSection, "algorithm": AlgorithmSection, "cluster": ClusterSection,
            "rollout": RolloutSection, "actor": ActorSection, "env_workers": EnvWorkersSection}
