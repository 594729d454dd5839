"""Seconds per training step from a :class:`~embodirl.calibration.measure.Calibration` and the config's recipe.

The model, for one step of the runner's ``collect -> advantages -> update -> sync weights``::

    N = K x S x B          env slots: K env workers, S pipeline stages each, B simulators per stage
    T decisions, H actions per decision, E = rollout.rollout_epoch rollouts per step

    env    (one stage, one decision)  t_env = chunk_ms x B x K / min(K x B, cores)
           the K workers' stepping stages (B simulators each) share the machine's cores; one simulator per core
           costs chunk_ms (H physics steps and one observation, rendered once at the chunk's end)
    act    (one stage, one decision)  t_act = B / act_per_s + B x overhead_ms (the collector's recording), queued: an
           inference worker serves K / R env workers
    round  (every stage one decision) S = 1 and one env worker per inference worker: t_env + t_act (they alternate);
           else the closed pipeline's rate: max(S x t_env, (K/R) x S x t_act, t_env + t_act). Without an accelerator
           the policy computes on the same cores: when the simulators already fill them (K x B >= cores) nothing
           overlaps and a round is S x t_env + (K/R) x S x t_act
    collect = E x (T x round + reset)          reset: B x K / min(K x B, cores) simulator resets
    update  = N x E x T x valid x (update_epochs [+1 scoring forward]) / update_per_s / ranks
    sync    = the measured publication when the acting policy is a copy (Ray workers, an accelerator); the
              in-process CPU run acts with the actor's own module: nothing moves
    step    = collect + update + sync

``gpus`` (``--gpus N``): N devices, each with this machine's cores for simulators, at least one inference worker
on each (R becomes max(R, N)) acting at the calibrated rate, and N data-parallel actor ranks (the update rate times N);
the sync does not shrink. The bound is the slowest
part alone (env stepping, inference, update or sync): a step can be no shorter, and ``step / bound`` says how far
the pipeline is from hiding everything else behind it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from embodirl.calibration.measure import Calibration
from embodirl.placement import use_ray
from embodirl.schema import run_config

#: the parts of a step, in the order the table prints them
PARTS = ("env", "inference", "update", "sync")


@dataclass
class Recipe:
    """The numbers of a config the prediction reads (see :mod:`embodirl.calibration.predict`)."""

    num_envs: int               # N
    env_workers: int            # K
    stages: int                 # S
    envs_per_stage: int         # B
    inference_workers: int      # R
    decisions: int              # T
    chunk: int                  # H
    rollout_epoch: int          # E
    update_epochs: int
    recompute_logprob: bool
    group_size: int
    global_batch_size: int
    micro_batch_size: int
    max_steps: int
    actor_ranks: int            # ranks the update is split over (CPU ranks share the cores: 1 for the rate)
    acting_copy: bool           # the acting policy is a copy the sync must reach (Ray workers)

    @classmethod
    def from_config(cls, cfg) -> Recipe:
        from embodirl.workers.layout import layout_from_config

        cfg = run_config(cfg)
        layout = layout_from_config(cfg, "env.train")
        return cls(num_envs=layout.num_slots, env_workers=layout.num_env_workers, stages=layout.num_stages,
                   envs_per_stage=layout.envs_per_stage, inference_workers=layout.num_inference_workers,
                   decisions=layout.num_decisions, chunk=cfg.model.action_chunk, rollout_epoch=cfg.rollout.rollout_epoch,
                   update_epochs=cfg.algorithm.update_epochs, recompute_logprob=cfg.algorithm.recompute_old_logprob,
                   group_size=cfg.algorithm.group_size, global_batch_size=cfg.actor.global_batch_size,
                   micro_batch_size=cfg.actor.micro_batch_size, max_steps=cfg.runner.max_steps, actor_ranks=1,
                   acting_copy=use_ray(cfg))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Prediction:
    """Seconds of one step and its parts (see module docstring)."""

    env_s: float                # simulators' busy time per step (all rollouts)
    inference_s: float          # inference workers' busy time per step
    collect_s: float            # the collection as the pipeline overlaps env and inference
    update_s: float
    sync_s: float
    step_s: float
    bottleneck: str             # the slowest part
    bound_s: float              # its time: no step is shorter
    gpus: int
    max_steps: int

    @property
    def step_over_bound(self) -> float:
        return self.step_s / max(self.bound_s, 1e-12)

    @property
    def wall_h(self) -> float:
        return self.step_s * self.max_steps / 3600.0

    @property
    def device_hours(self) -> float:
        return self.wall_h * self.gpus

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "step_over_bound": self.step_over_bound, "wall_h": self.wall_h,
                "device_hours": self.device_hours}


def predict(cal: Calibration, recipe: Recipe, *, gpus: int = 1, accelerator: bool | None = None) -> Prediction:
    """The step ``recipe`` takes with the parts ``cal`` measured, on ``gpus`` devices (see module docstring).
    ``accelerator``: whether the policy computes apart from the simulators' cores (default: the calibration's device
    is not the CPU)."""
    if accelerator is None:
        accelerator = cal.device != "cpu"
    n = max(1, int(gpus))
    K, S, B, R = recipe.env_workers, recipe.stages, recipe.envs_per_stage, recipe.inference_workers
    cores = cal.cores * n
    share = B * K / min(B * K, cores)                     # simulators per core while every worker steps a stage
    t_env = cal.chunk_ms / 1e3 * share                    # one stage's chunk, s
    t_act = B / cal.act_per_s + B * cal.overhead_ms / 1e3   # one stage's decision and its recording, s
    queue = max(1.0, K / max(R, n))                       # env workers one inference worker (one a device) serves
    if S == 1 and queue == 1.0:
        round_s = t_env + t_act
    elif not accelerator and K * B >= cores:
        round_s = S * t_env + queue * S * t_act
    else:
        round_s = max(S * t_env, queue * S * t_act, t_env + t_act)
    E, T = recipe.rollout_epoch, recipe.decisions
    reset_s = cal.reset_ms / 1e3 * share
    env_s = E * T * S * t_env + E * reset_s
    inference_s = E * T * queue * S * t_act
    collect_s = E * (T * round_s + reset_s)
    passes = recipe.update_epochs + (1 if recipe.recompute_logprob else 0)
    decisions = recipe.num_envs * E * T * cal.valid_fraction
    update_s = decisions * passes / (cal.update_per_s * n)
    sync_s = cal.sync_s if (recipe.acting_copy or accelerator) else 0.0
    parts = {"env": env_s, "inference": inference_s, "update": update_s, "sync": sync_s}
    bottleneck = max(parts, key=parts.__getitem__)
    return Prediction(env_s=env_s, inference_s=inference_s, collect_s=collect_s, update_s=update_s, sync_s=sync_s,
                      step_s=collect_s + update_s + sync_s, bottleneck=bottleneck, bound_s=parts[bottleneck],
                      gpus=n, max_steps=recipe.max_steps)
