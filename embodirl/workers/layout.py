"""Worker layout: how N env slots split over env workers, pipeline stages and simulators, which inference
worker serves which env worker, and the placement plan of every component.

Layout (``K = env_workers.num_workers``, ``S = rollout.pipeline_stage_num``, ``R =
rollout.num_workers``): env worker ``k`` holds S stages of ``B = N / (K*S)`` simulators, i.e. slots
``k*S*B .. (k+1)*S*B - 1``, and is served by inference worker ``k % R``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from embodirl.errors import ConfigError
from embodirl.rollout.records import decisions_per_episode


@dataclass(frozen=True)
class SlotLayout:
    """How N env slots split over K env workers x S stages x B simulators, served by R inference
    workers, for T decisions."""

    num_env_workers: int      # K
    num_stages: int           # S
    envs_per_stage: int       # B
    num_inference_workers: int  # R
    num_decisions: int        # T
    group_size: int = 1       # G

    @property
    def num_slots(self) -> int:
        return self.num_env_workers * self.num_stages * self.envs_per_stage

    @property
    def slots_per_worker(self) -> int:
        return self.num_stages * self.envs_per_stage

    def inference_worker_of(self, k: int) -> int:
        return k % self.num_inference_workers


def layout_from_config(cfg, env_key: str = "env.train") -> SlotLayout:
    """The layout the typed config asks for (``env_key``: ``env.train`` or ``env.eval``).

    Evaluation gets its own env workers: as many as training has when they divide ``env.eval.num_envs``
    (else one), without pipelining, each episode run to its time limit (``rollout.max_decisions`` is a
    training horizon)."""
    env = cfg.env.train if env_key == "env.train" else cfg.env.eval
    N = env.num_envs
    K, S = cfg.env_workers.num_workers, cfg.rollout.pipeline_stage_num
    if env_key != "env.train":
        S = 1
        K = K if N % K == 0 else 1
    if N % (K * S):
        raise ConfigError(f"{env_key}.num_envs", f"{N} envs cannot be split over env_workers.num_workers x "
                                                 f"rollout.pipeline_stage_num = {K} x {S}")
    if env_key == "env.train":
        T = decisions_per_episode(cfg)
    else:
        T = math.ceil(env.max_episode_steps / cfg.model.action_chunk)
    G = cfg.algorithm.group_size if env_key == "env.train" else 1
    return SlotLayout(K, S, N // (K * S), cfg.rollout.num_workers, T, G)


def plan_from_config(cfg, layout: SlotLayout, eval_layout: SlotLayout | None = None):
    """The placement plan for this layout (and the evaluation env workers, placed after the training
    ones) plus the actor's ranks (``actor``)."""
    from embodirl.placement import data_parallel_size, placement_from_config
    from embodirl.workers.placement_groups import plan_placement

    num_nodes = cfg.cluster.num_nodes
    placement = placement_from_config(cfg.cluster)
    num_env = layout.num_env_workers + (eval_layout.num_env_workers if eval_layout is not None else 0)
    workers = {"env": num_env, "rollout": layout.num_inference_workers,
               "actor": data_parallel_size(cfg, placement)}
    return plan_placement(placement, workers, num_nodes=num_nodes)


def placement_options(placement, component: str, offset: int = 0):
    """``WorkerSet`` options for worker ``k`` of ``component`` under ``placement`` ((plan, groups) or None)."""
    if placement is None:
        return None
    from embodirl.workers.placement_groups import worker_options

    plan, groups = placement
    return lambda k: worker_options(plan, groups, component, offset + k)
