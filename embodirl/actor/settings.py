"""The actor's view of the configuration: the ``algorithm`` and ``actor`` nodes, read once.

Defaults live in ``config/config.yaml`` only, types, ranges and choices in :mod:`embodirl.schema`; this module
reads the two sections through the schema (a missing, mistyped or out-of-range key is a
:class:`~embodirl.errors.ConfigError` naming it) and runs the actor's rules again with the actor's
world size (:func:`embodirl.schema.sections.actor_rules`).

Batch units: ``actor.global_batch_size`` is the number of trajectories (rows of N) per optimizer
step, summed over all data-parallel ranks; ``actor.micro_batch_size`` is the number of trajectories
one rank puts through one forward/backward. Each rank therefore takes ``global_batch_size /
world_size`` rows of its shard per optimizer step, in ``ceil(that / micro_batch_size)`` micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from embodirl.algorithms.advantages import uses_critic
from embodirl.algorithms.losses import LossParams
from embodirl.config_fields import check_fields
from embodirl.errors import ConfigError
from embodirl.plain import to_plain as plain
from embodirl.schema import typed
from embodirl.schema.sections import Actor, Algorithm, actor_rules


@dataclass(frozen=True)
class ActorSettings:
    """Everything the actor reads, parsed from ``cfg.algorithm`` and ``cfg.actor``."""

    algorithm: dict
    loss: LossParams
    update_epochs: int
    early_stop_kl: float | None
    recompute_old_logprob: bool
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
        return uses_critic(self.algorithm["adv_type"])

    @classmethod
    def from_config(cls, cfg: Mapping) -> ActorSettings:
        cfg = plain(cfg)
        for section in ("algorithm", "actor"):
            if section not in cfg:
                raise ConfigError(section, "is missing from the configuration (see config/config.yaml)")
        alg = plain(typed(Algorithm, cfg["algorithm"], "algorithm"))
        actor = plain(typed(Actor, cfg["actor"], "actor"))
        check_fields(Algorithm, alg, "algorithm")
        check_fields(Actor, actor, "actor")
        try:
            loss = LossParams.from_config(alg)
        except ValueError as exc:
            raise ConfigError("algorithm.logprob_type", str(exc)) from None
        fsdp = actor["fsdp"]
        out = cls(
            algorithm=alg, loss=loss, update_epochs=int(alg["update_epochs"]),
            recompute_old_logprob=bool(alg["recompute_old_logprob"]),
            early_stop_kl=None if alg["early_stop_kl"] is None else float(alg["early_stop_kl"]),
            micro_batch_size=int(actor["micro_batch_size"]), global_batch_size=int(actor["global_batch_size"]),
            optim=dict(actor["optim"]), fsdp_enabled=fsdp["enabled"], param_dtype=fsdp["param_dtype"],
            reduce_dtype=fsdp["reduce_dtype"], cpu_offload=bool(fsdp["cpu_offload"]),
            gradient_checkpointing=bool(fsdp["gradient_checkpointing"]), full_finetune=bool(fsdp["full_finetune"]),
            replay=dict(actor["replay_buffer"]), seed=int(actor["seed"]),
        )
        out.check()
        return out

    def check(self, world_size: int = 1) -> None:
        """The actor's rules with this actor's world size (one sentence each)."""
        actor_rules({"global_batch_size": self.global_batch_size, "optim": self.optim,
                       "fsdp": {"full_finetune": self.full_finetune}}, self.algorithm, world_size)

    @property
    def kl_active(self) -> bool:
        return float(self.algorithm["kl_beta"]) > 0
