"""The memory a config needs, estimated before anything starts (``embodirl doctor``'s memory check and the
pre-flight of ``train``/``eval``): parameter counts of the policy built on torch's meta device, and peak bytes
per actor rank, inference copy and env worker (:func:`memory_plan`) against what a device has
(:func:`available_memory`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

GIB = 1024**3
#: bytes per trainable parameter on an actor rank: fp32 master copy, fp32 gradient, AdamW's two moments
MASTER_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8
#: activation bytes per token per transformer layer and hidden unit while training. Korthikanti et al. 2022
#: ("Reducing Activation Recomputation in Large Transformer Models", eq. 1 without the attention-score term, as
#: flash/memory-efficient SDPA keeps no scores) count 34 for a 16-bit layer; peft's LoRA adapters run in float32
#: and keep float32 copies of every adapted layer's input, which brings OpenVLA-OFT with LoRA on all linear layers
#: to 80, as the full-size dry run measures (embodirl/tools/dry_run.py, tests/test_dry_run.py: within 15 %)
ACT_BYTES_PER_TOKEN_LAYER = 80
#: with gradient checkpointing each layer keeps only its input (2 bytes per hidden unit) ...
CKPT_BYTES_PER_TOKEN_LAYER = 2
#: ... and backward holds one recomputed layer's activations and gradient temporaries at a time (the dry run: 128)
RECOMPUTED_LAYER_BYTES_PER_TOKEN = 128
#: tokens of the prompt, proprio and action slots besides the image patches (OpenVLA-OFT: ~30 + 1 + 56)
TEXT_AND_ACTION_TOKENS = 96
#: private memory (USS: Private_Clean + Private_Dirty of /proc/<pid>/smaps_rollup) of one simulator process after
#: its first reset, measured on this project's 2-core machine: LIBERO-10 0.9-1.05 GiB, ManiSkill PushCube
#: (state obs, lavapipe) 0.33 GiB; shared libraries come on top once
SIM_PROCESS_BYTES = {"libero": int(1.0 * GIB), "maniskill": int(0.35 * GIB)}
OTHER_SIM_BYTES = int(0.1 * GIB)
#: what a policy is sized for where its config leaves a size to the env (null) and no simulator is started (the
#: dry run, doctor): LIBERO's robot (7-D actions, 8-D proprio) seen by OpenVLA-OFT's two 224 px cameras
UNSET_ACTION_DIM, UNSET_STATE_DIM, UNSET_IMAGE_SIZE, UNSET_CAMERAS = 7, 8, 224, 2


@dataclass
class ModelSize:
    params: int            # all parameters
    trainable: int         # trainable parameters (LoRA + heads, or all with a full fine-tune)
    param_bytes: int       # the parameters in their dtypes
    layers: int            # transformer layers of the language model (0: none)
    hidden: int
    tokens: int            # tokens per decision (image patches + text + action slots)
    #: training activation bytes per token, layer and hidden unit, and per token of the recomputed layer under gradient
    #: checkpointing: the constants above (OpenVLA-OFT), or the policy's own (``activation_profile``)
    act_bytes_per_token_layer: int = ACT_BYTES_PER_TOKEN_LAYER
    recomputed_layer_bytes_per_token: int = RECOMPUTED_LAYER_BYTES_PER_TOKEN


def meta_model(model):
    """The typed ``model`` section as a meta-device build takes it: random weights (no ``path``, nor ``base_path``
    where the policy has one) created on torch's meta device."""
    unset = {f.name: None for f in dataclasses.fields(model) if f.name in ("path", "base_path")}
    return dataclasses.replace(model, device="meta", **unset)


def sizing_spec(model, max_episode_steps: int, instruction: str, *, cameras: list[str], image_size: tuple[int, int],
                name: str = "dry_run"):
    """The env spec a policy of the typed ``model`` section is built for without a simulator: the model's own
    ``action_dim`` and ``proprio_dim`` where its config class declares them, else the ``UNSET_*`` sizes."""
    from embodirl.envs.base import EnvSpec

    return EnvSpec(action_dim=getattr(model, "action_dim", None) or UNSET_ACTION_DIM,
                   max_episode_steps=max_episode_steps, task_descriptions=[instruction], camera_names=list(cameras),
                   image_size=(int(image_size[0]), int(image_size[1])),
                   state_dim=getattr(model, "proprio_dim", None) or UNSET_STATE_DIM, name=name)


def model_size(cfg) -> ModelSize:
    """Parameter counts of ``cfg.model`` built on torch's meta device (no memory, no weights loaded). ``cfg``: the
    typed config (a composed one is converted). The optional size keys (``num_images_in_input``, ``image_size``,
    ``action_dim``, ``proprio_dim``, ``llm``, ``vision.siglip``) are those a policy's config class declares."""
    from embodirl.models.registry import make_policy
    from embodirl.schema import run_config

    cfg = run_config(cfg)
    model = meta_model(cfg.model)
    images = getattr(model, "num_images_in_input", None) or UNSET_CAMERAS
    size = getattr(model, "image_size", None) or UNSET_IMAGE_SIZE
    spec = sizing_spec(model, cfg.env.train.max_episode_steps, "doctor", cameras=[f"camera{i}" for i in range(images)],
                       image_size=(size, size))
    policy = make_policy(model, spec)
    full = cfg.actor.fsdp.full_finetune
    if full:                         # the actor's trainable set (Actor does the same), which a policy's profile reads
        policy.requires_grad_(True)
    params = list(policy.parameters())
    llm = getattr(model, "llm", None)
    patch = getattr(getattr(getattr(model, "vision", None), "siglip", None), "patch_size", 0)
    tokens = images * (size // patch) ** 2 + TEXT_AND_ACTION_TOKENS if patch else 1
    shape = {"layers": llm.num_hidden_layers if llm else 0, "hidden": llm.hidden_size if llm else 0, "tokens": tokens}
    profile = getattr(policy, "activation_profile", None)
    if profile is not None:          # a policy that describes its own activations (π0)
        shape = profile()
    return ModelSize(params=sum(p.numel() for p in params),
                     trainable=sum(p.numel() for p in params if p.requires_grad),
                     param_bytes=sum(p.numel() * p.element_size() for p in params), **shape)


def available_memory(accelerator: str, *, total: bool = False) -> list[int]:
    """Free (``total``: all) bytes per device: each visible GPU, or this machine's RAM (one entry)."""
    if accelerator == "gpu":
        import torch

        return [torch.cuda.mem_get_info(i)[1 if total else 0] for i in range(torch.cuda.device_count())]
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return [info["MemTotal"] if total else info.get("MemAvailable", info.get("MemFree", 0))]


def memory_plan(cfg, size: ModelSize, accelerator: str) -> dict[str, int]:
    """Estimated peak bytes per component instance: ``actor`` (one actor rank: parameters, fp32 master
    weights, gradients and AdamW moments of the trainable ones, sharded over the ranks, and activations of one
    micro-batch; evaluation: the policy's parameters), ``rollout`` (one inference copy, 0 when the actor's
    own policy acts in this process) and ``env`` (one env worker's share of the training and evaluation
    simulator processes on the CPU; 0 on a GPU). ``cfg``: the typed config (a composed one is converted)."""
    from embodirl.placement import data_parallel_size, placement_from_config, use_ray
    from embodirl.rollout.records import decisions_per_episode
    from embodirl.schema import run_config

    cfg = run_config(cfg)
    dp = data_parallel_size(cfg) if accelerator == "cpu" else data_parallel_size(cfg, placement_from_config(cfg.cluster))
    decisions = decisions_per_episode(cfg)
    rows = cfg.actor.micro_batch_size * decisions                    # decisions in one forward/backward
    if cfg.actor.fsdp.gradient_checkpointing or getattr(cfg.model, "gradient_checkpointing", False):
        per_token = size.layers * CKPT_BYTES_PER_TOKEN_LAYER + size.recomputed_layer_bytes_per_token * bool(size.layers)
    else:
        per_token = size.layers * size.act_bytes_per_token_layer
    activations = rows * size.tokens * size.hidden * per_token
    sharded = size.param_bytes + size.trainable * (MASTER_BYTES + GRAD_BYTES + ADAM_BYTES)
    only_eval = cfg.runner.only_eval
    actor = size.param_bytes if only_eval else math.ceil(sharded / dp) + activations   # eval: the policy only
    in_process = not use_ray(cfg)
    workers = cfg.env_workers.num_workers
    envs_per_worker = cfg.env.train.num_envs // workers
    rollout_batch = envs_per_worker // cfg.rollout.pipeline_stage_num
    rollout = 0 if in_process else size.param_bytes + rollout_batch * size.tokens * size.hidden * 4 * 2
    # simulators: training's, and evaluation's, which stay up between evaluations
    evaluates = only_eval or bool(cfg.runner.val_check_interval) or bool(cfg.runner.val_before_train)
    eval_envs = (cfg.runner.eval_num_envs or cfg.env.eval.num_envs) if evaluates else 0
    sims = {"train": 0 if only_eval else cfg.env.train.num_envs, "eval": eval_envs}
    per_sim = {"train": SIM_PROCESS_BYTES.get(cfg.env.train.adapter, OTHER_SIM_BYTES),
               "eval": SIM_PROCESS_BYTES.get(cfg.env.eval.adapter, OTHER_SIM_BYTES)}
    env = sum(sims[k] * per_sim[k] for k in sims) // workers if accelerator == "cpu" else 0
    return {"actor": actor, "rollout": rollout, "env": env}
