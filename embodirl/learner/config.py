"""The learner's view of the configuration: the ``algorithm`` and ``actor`` nodes, read once.

Defaults live in ``config/config.yaml`` only; this module reads the keys (a missing one is a
:class:`~embodirl.errors.ConfigError` naming it) and checks what only the learner can check (the
data-parallel size is known here).

Batch units: ``actor.global_batch_size`` is the number of trajectories (rows of N) per optimizer
step, summed over all data-parallel ranks; ``actor.micro_batch_size`` is the number of trajectories
one rank puts through one forward/backward. Each rank therefore takes ``global_batch_size /
world_size`` rows of its shard per optimizer step, in ``ceil(that / micro_batch_size)`` micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from embodirl.algorithms.advantages import CRITIC_ESTIMATORS
from embodirl.algorithms.losses import LossParams
from embodirl.errors import ConfigError
from embodirl.learner.optim import LR_SCHEDULES
from embodirl.plain import to_plain as plain


def _get(node: Mapping, path: str, root: str):
    value: Any = node
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise ConfigError(f"{root}.{path}", "is missing from the configuration (see config/config.yaml)")
        value = value[part]
    return value


@dataclass(frozen=True)
class LearnerConfig:
    """Everything the learner reads, parsed from ``cfg.algorithm`` and ``cfg.actor``."""

    algorithm: dict
    loss: LossParams
    update_epochs: int
    early_stop_kl: float | None
    micro_batch_size: int
    global_batch_size: int
    optim: dict
    fsdp_enabled: str | bool        # "auto", True or False
    param_dtype: str | None
    reduce_dtype: str | None
    cpu_offload: bool
    gradient_checkpointing: bool
    full_finetune: bool
    replay: dict
    seed: int

    @property
    def uses_critic(self) -> bool:
        return str(self.algorithm["adv_type"]) in CRITIC_ESTIMATORS

    @classmethod
    def from_config(cls, cfg: Mapping) -> LearnerConfig:
        cfg = plain(cfg)
        alg = _get(cfg, "algorithm", "")
        actor = _get(cfg, "actor", "")
        for key in ("adv_type", "group_size", "reward_type", "logprob_type", "gamma", "gae_lambda",
                    "normalize_advantages", "norm_adv_by_std_in_grpo", "clip_ratio_low", "clip_ratio_high",
                    "clip_ratio_c", "value_clip", "huber_delta", "loss_agg_func", "entropy_bonus", "value_coef",
                    "kl_beta", "kl_penalty", "use_kl_loss", "kl_ctrl.type", "kl_ctrl.target_kl", "kl_ctrl.horizon",
                    "filter_groups.enable", "filter_groups.min_success", "filter_groups.max_success",
                    "update_epochs", "early_stop_kl"):
            _get(alg, key, "algorithm")
        for key in ("lr", "value_lr", "weight_decay", "betas", "eps", "warmup_steps", "clip_grad", "lr_schedule",
                    "min_lr_ratio"):
            _get(actor, f"optim.{key}", "actor")
        try:
            loss = LossParams.from_config(alg)
        except ValueError as exc:
            raise ConfigError("algorithm.logprob_type", str(exc)) from None
        enabled = _get(actor, "fsdp.enabled", "actor")
        if enabled not in ("auto", True, False):
            raise ConfigError("actor.fsdp.enabled", f"must be auto, true or false, got {enabled!r}")
        out = cls(
            algorithm=alg, loss=loss, update_epochs=int(alg["update_epochs"]),
            early_stop_kl=None if alg["early_stop_kl"] is None else float(alg["early_stop_kl"]),
            micro_batch_size=int(_get(actor, "micro_batch_size", "actor")),
            global_batch_size=int(_get(actor, "global_batch_size", "actor")),
            optim=dict(actor["optim"]), fsdp_enabled=enabled,
            param_dtype=_get(actor, "fsdp.param_dtype", "actor"), reduce_dtype=_get(actor, "fsdp.reduce_dtype", "actor"),
            cpu_offload=bool(_get(actor, "fsdp.cpu_offload", "actor")),
            gradient_checkpointing=bool(_get(actor, "fsdp.gradient_checkpointing", "actor")),
            full_finetune=bool(_get(actor, "fsdp.full_finetune", "actor")),
            replay={k: _get(actor, f"replay_buffer.{k}", "actor") for k in ("reuse_last_k", "max_staleness",
                                                                             "max_bytes")},
            seed=int(_get(actor, "seed", "actor")),
        )
        out.check()
        return out

    def check(self, world_size: int = 1) -> None:
        """Cross-field rules the learner relies on (one sentence each)."""
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise ConfigError("actor.micro_batch_size", "batch sizes must be positive")
        if self.global_batch_size % world_size:
            raise ConfigError("actor.global_batch_size", f"{self.global_batch_size} trajectories do not split evenly "
                                                         f"over {world_size} learner ranks")
        if self.update_epochs < 1:
            raise ConfigError("algorithm.update_epochs", "must be at least 1")
        if self.early_stop_kl is not None and self.early_stop_kl <= 0:
            raise ConfigError("algorithm.early_stop_kl", f"must be positive or null (no early stopping), "
                                                         f"got {self.early_stop_kl}")
        schedule = str(self.optim["lr_schedule"])
        if schedule not in LR_SCHEDULES:
            raise ConfigError("actor.optim.lr_schedule", f"unknown schedule {schedule!r}; choose one of "
                                                         f"{', '.join(LR_SCHEDULES)}")
        if schedule != "constant":
            steps = self.optim.get("lr_decay_steps")
            if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
                raise ConfigError("actor.optim.lr_decay_steps", f"the {schedule} schedule needs a positive number of "
                                                                f"training steps (default runner.max_steps), got {steps!r}")
        if not 0.0 <= float(self.optim["min_lr_ratio"]) <= 1.0:
            raise ConfigError("actor.optim.min_lr_ratio", f"must lie in [0, 1], got {self.optim['min_lr_ratio']}")
        if self.full_finetune and self.kl_active:
            raise ConfigError("actor.fsdp.full_finetune", "the KL reference is the adapter-disabled base model, which "
                                                          "full fine-tuning changes; set algorithm.kl_beta=0")

    @property
    def kl_active(self) -> bool:
        return float(self.algorithm["kl_beta"]) > 0
