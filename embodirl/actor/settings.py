"""The actor's view of the configuration: the typed ``algorithm`` and ``actor`` sections, converted once.

Defaults live in ``config/config.yaml`` only, types, ranges and choices in the schema's dataclasses; the actor
holds those dataclasses themselves (:class:`~embodirl.algorithms.section.AlgorithmSection`,
:class:`~embodirl.schema.sections.ActorSection`), so no field is declared twice. A plain node (what a Ray worker
receives) is checked against the schema first (a missing, mistyped or out-of-range key is a
:class:`~embodirl.errors.ConfigError` naming it), and the actor's rules run again with the actor's world size
(:func:`embodirl.schema.sections.actor_rules`).

Batch units: ``actor.global_batch_size`` is the number of trajectories (rows of N) per optimizer
step, summed over all data-parallel ranks; ``actor.micro_batch_size`` is the number of trajectories
one rank puts through one forward/backward. Each rank therefore takes ``global_batch_size /
world_size`` rows of its shard per optimizer step, in ``ceil(that / micro_batch_size)`` micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from embodirl.algorithms.section import AlgorithmSection
from embodirl.errors import ConfigError
from embodirl.schema import to_object
from embodirl.schema.sections import ActorSection, actor_rules


class HasActorSections(Protocol):
    """Anything with the two sections as attributes: the typed run config, or :class:`ActorSettings` itself."""

    @property
    def algorithm(self) -> object: ...

    @property
    def actor(self) -> object: ...


@dataclass(frozen=True)
class ActorSettings:
    """The two sections the actor reads, as the schema's own typed objects (nothing re-declared, no defaults)."""

    algorithm: AlgorithmSection
    actor: ActorSection

    @classmethod
    def from_config(cls, cfg: Mapping | HasActorSections) -> ActorSettings:
        """``cfg`` holds ``algorithm`` and ``actor`` (typed objects, DictConfigs or plain dicts, as a Ray worker
        receives them); plain nodes are checked against the schema and converted once."""
        sections = {}
        for name, schema in (("algorithm", AlgorithmSection), ("actor", ActorSection)):
            node = cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)
            if node is None:
                raise ConfigError(name, "is missing from the configuration (see config/config.yaml)")
            sections[name] = to_object(schema, node, name)
        if sections["algorithm"].recompute_old_logprob == "auto":
            # sections handed over alone, not decided by schema.resolve_fast_inference: no merged or compiled
            # inference copy was placed for them, so the rollout's log-probs are the actor's own numerics
            sections["algorithm"] = replace(sections["algorithm"], recompute_old_logprob=False)
        out = cls(**sections)
        out.check()
        return out

    def check(self, world_size: int = 1) -> None:
        """The actor's rules with this actor's world size (one sentence each)."""
        actor_rules(self.actor, self.algorithm, world_size)
