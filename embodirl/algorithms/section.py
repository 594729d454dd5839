"""The ``algorithm`` section of the config as the typed object the algorithms run on.

:class:`AlgorithmSection` declares each key's type, range and choices (:mod:`embodirl.config_fields`; the values live in
``config/config.yaml``) and its rules between keys. After validation the section is converted once to an
:class:`AlgorithmSection` instance (:func:`algorithm_of`), and the advantage estimators, the losses, the KL controller and
the actor read its attributes: no second dataclass re-declares its fields, and no code holds a default of its own.

It sits in the algorithms package, below the schema that lists it among the sections, so that the algorithms can
take it as their parameters; its choice lists come from the registries beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embodirl import data as D
from embodirl.algorithms.aggregation import AGGREGATIONS
from embodirl.algorithms.estimators import ESTIMATORS, EstimatorSpec, estimator_spec
from embodirl.algorithms.kl import KL_CONTROLLERS, KL_ESTIMATORS, KLController
from embodirl.config_fields import instance, num, one_of, required, section
from embodirl.errors import ConfigError

#: how the importance ratio groups the action tokens: per token, per action (its A tokens), per chunk (all L)
LOGPROB_TYPES = ("token", "action", "chunk")


def _refuse(key: str, message: str):
    raise ConfigError(key, message)


@dataclass
class KLCtrl:
    type: str = one_of(KL_CONTROLLERS)
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
class AlgorithmSection:
    adv_type: str = one_of(ESTIMATORS.available, known=ESTIMATORS.known)
    group_size: int = num(1)
    reward_type: str = one_of(D.REWARD_TYPES)
    logprob_type: str = one_of(LOGPROB_TYPES)
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
    loss_agg_func: str = one_of(list(AGGREGATIONS))
    kl_beta: float = num(0)
    kl_penalty: str = one_of(list(KL_ESTIMATORS))
    use_kl_loss: bool = required()
    kl_ctrl: KLCtrl = section(KLCtrl)
    filter_groups: FilterGroups = section(FilterGroups)
    update_epochs: int = num(1)
    early_stop_kl: float | None = num(0, lo_open=True, null=True)
    recompute_old_logprob: Any = one_of(("auto", True, False))   # auto: with merged or compiled inference copies
    behaviour_is_cap: float | None = num(1, null=True)     # verl's rollout_is_threshold (token level)

    # --- views the code reads (derived from the fields above, never stored) --------------------------------
    @property
    def estimator(self) -> EstimatorSpec:
        """The registered estimator ``adv_type`` names, with what it needs (critic, groups, greedy baseline)."""
        return estimator_spec(self.adv_type)

    @property
    def uses_critic(self) -> bool:
        """The estimator reads the critic's values (rollouts ask for values; the actor trains the value head)."""
        return self.estimator.critic

    @property
    def kl_active(self) -> bool:
        return self.kl_beta > 0

    def kl_controller(self) -> KLController:
        """A fresh KL coefficient controller: ``kl_beta``, fixed or adaptive (``kl_ctrl``)."""
        return KLController(self.kl_beta, kind=self.kl_ctrl.type, target_kl=self.kl_ctrl.target_kl,
                            horizon=self.kl_ctrl.horizon)

    @staticmethod
    def rules(cfg, ctx) -> None:
        alg = cfg.algorithm
        G, adv_type = int(alg.group_size), alg.adv_type
        spec = estimator_spec(adv_type)
        if spec.groups:
            if G < 2:
                _refuse("algorithm.group_size", f"adv_type={adv_type} compares trajectories within a group: set "
                                                "group_size >= 2")
            if not cfg.env.train.use_fixed_reset_state_ids:
                _refuse("env.train.use_fixed_reset_state_ids", f"adv_type={adv_type} needs groups that share an init "
                                                                "state: set env.train.use_fixed_reset_state_ids=true")
        fg = alg.filter_groups
        if fg.enable:
            lo, hi = float(fg.min_success), float(fg.max_success)
            if G < 2:
                _refuse("algorithm.filter_groups.enable", "group filtering keeps groups whose success rate lies strictly "
                                                         f"between {lo} and {hi}, and a group of 1 trajectory scores 0 or "
                                                         "1, so every row would be dropped; set algorithm.group_size >= 2 "
                                                         "or algorithm.filter_groups.enable=false")
            if not lo < hi:
                _refuse("algorithm.filter_groups.min_success", f"the kept success range ({lo}, {hi}) must satisfy "
                                                              "0 <= min_success < max_success <= 1")
        if fg.resample and not fg.enable:
            _refuse("algorithm.filter_groups.resample", "re-sampling collects more rollouts until the step holds its "
                                                        "batch of kept groups, so it needs algorithm.filter_groups.enable=true")
        if spec.greedy_baseline:
            if cfg.env.train.auto_reset:
                _refuse("env.train.auto_reset", f"adv_type={adv_type} compares each row's episode with a greedy one from "
                                                "the same start, so a row must hold one episode: set "
                                                "env.train.auto_reset=false")
            if ctx.use_ray and not cfg.runner.eval_greedy:
                _refuse("runner.eval_greedy", f"adv_type={adv_type} runs its baseline rollouts with the inference workers' "
                                              "evaluation sampling, which must be greedy: set runner.eval_greedy=true")
        if alg.reward_type != cfg.env.train.reward_type:
            _refuse("env.train.reward_type", f"'{cfg.env.train.reward_type}' differs from algorithm.reward_type "
                                             f"'{alg.reward_type}'; set both to the same value")


def algorithm_of(node: Any) -> AlgorithmSection:
    """The ``algorithm`` node (a DictConfig, a plain dict or an :class:`AlgorithmSection`) as an :class:`AlgorithmSection`."""
    return instance(AlgorithmSection, node, "algorithm")
