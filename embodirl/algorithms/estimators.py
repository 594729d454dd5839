"""The registry of advantage estimators (``algorithm.adv_type``), kept apart from the estimators themselves.

A leaf: the ``algorithm`` section (:mod:`embodirl.algorithms.section`) lists the names from here, and the estimators
(:mod:`embodirl.algorithms.advantages`) take that section as their parameters. The built-in estimators register when
their module is imported, which the registry does on first use. An estimator outside embodirl registers under its
module's dotted name (``@register_advantage(__name__, ...)`` in ``my_pkg/my_estimator.py``; ``algorithm.adv_type=
my_pkg.my_estimator``), and is imported the same way.

What a run must provide for an estimator (a critic, groups, a greedy baseline rollout) is declared where it
registers: the schema, the worker groups, the actor and the runner read these flags, never lists of names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from embodirl.registry import LazyRegistry

ESTIMATORS = LazyRegistry("advantage estimator", "algorithm.adv_type",
                          dict.fromkeys(("gae", "grpo", "rloo", "reinforce_plus_plus", "remax"),
                                        "embodirl.algorithms.advantages"))


@dataclass(frozen=True)
class EstimatorSpec:
    """An estimator ``fn(inputs, algorithm) -> (advantage, returns)`` and what a run must provide for it."""

    fn: Callable
    critic: bool = False            # reads the critic's ``value`` (a value head, PPO-style)
    groups: bool = False            # compares trajectories of a group sharing an init state (group_size >= 2)
    greedy_baseline: bool = False   # needs a greedy rollout from each trajectory's start (``extras.reward_baseline``)


def register_advantage(name: str, *, critic: bool = False, groups: bool = False, greedy_baseline: bool = False):
    """Decorator: ``@register_advantage("name", critic=..., groups=..., greedy_baseline=...)`` on an estimator
    ``fn(inputs: AdvantageInputs, algorithm: AlgorithmSection) -> (advantage, returns)``; ``algorithm.adv_type=name`` then
    selects it."""
    def wrap(fn: Callable) -> Callable:
        ESTIMATORS.register(name)(EstimatorSpec(fn, critic=critic, groups=groups, greedy_baseline=greedy_baseline))
        return fn

    return wrap


def estimator_spec(name: str) -> EstimatorSpec:
    """The registered estimator ``name`` (imported first when needed); an unknown name is a ConfigError on
    ``algorithm.adv_type`` listing the known ones."""
    return ESTIMATORS.get(str(name))


def uses_critic(adv_type: str) -> bool:
    """The estimator reads the critic's values (so rollouts ask the policy for values and the actor trains them)."""
    return estimator_spec(adv_type).critic
