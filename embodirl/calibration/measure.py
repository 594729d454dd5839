"""Time the parts of one config on this machine with its real components (no stand-ins).

One :func:`calibrate` call, for the typed config of a run:

* **env**: the training env (``env.train``: toy, ManiSkill or LIBERO, through :func:`~embodirl.envs.registry.make_env`,
  one simulator process each as a run has them) with ``b`` simulators (the run's envs per pipeline stage, at most
  :data:`MAX_ENVS`): reset, then chunks of the configured ``H`` actions and chunks of one action. A chunk costs
  ``H x physics + one observation`` (the cameras render once, at the chunk's end), so the two lengths split physics
  per low-level step from the per-decision cost (rendering, observation transfer). Each is the time of one simulator
  owning one core: the batch's wall time times ``min(b, cores) / b``.
* **act**: the configured policy's ``act`` (through :class:`~embodirl.rollout.inference.PolicyInference`, the
  in-process inference client) on a batch of real observations the size an inference worker sees (the run's envs per
  pipeline stage).
* **collector**: a short real rollout of those ``b`` simulators with the policy's actions: its chunks set the chunk's
  cost (the probes' split kept), and what the collector spends beyond env and act (recording, action conversion)
  is its per-decision overhead.
* **update**: the same rollout (:class:`~embodirl.rollout.collector.RolloutCollector`),
  advantages (:func:`~embodirl.actor.actor.prepare_batch`) and an update of
  :class:`~embodirl.actor.actor.Actor` over it with the run's ``algorithm.update_epochs`` (at most
  :data:`MAX_UPDATE_EPOCHS`) (the second of two: the first pays one-off costs), as decision passes
  (forward and backward of one decision) per second.
* **sync**: the actor's publication of its trainable tensors after that update and their load into an acting copy.

Each timing is a wall-clock on a machine others may be using: the 1-minute load average is recorded beside them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from embodirl.schema import Config, run_config

if TYPE_CHECKING:
    from tensordict import TensorDict

    from embodirl.actor.actor import Actor
    from embodirl.algorithms.section import AlgorithmSection
    from embodirl.rollout.inference import PolicyInference

log = logging.getLogger(__name__)
#: simulators the calibration starts at most (the model scales the rest: :mod:`embodirl.calibration.predict`)
MAX_ENVS = 16
#: decisions of the calibration rollout (its batch is what the update is timed on)
ROLLOUT_DECISIONS = 25
#: chunks timed per chunk length, after one untimed
CHUNKS = 4
#: act calls are repeated until this many seconds have passed (at least ACT_CALLS of them)
ACT_SECONDS = 1.5
ACT_CALLS = 3
#: update epochs of the timed update at most (the run's own when fewer)
MAX_UPDATE_EPOCHS = 8


@dataclass
class Calibration:
    """What one calibration measured (milliseconds and rates on this machine; see module docstring)."""

    cores: int                   # CPU cores this process may run on
    load: float                  # 1-minute load average when the calibration started
    device: str                  # where the policy ran: cpu, or the accelerator's name
    envs: int                    # simulators stepped together (b)
    chunk_len: int               # H of the timed chunks
    cameras: int                 # V rendered per decision (0: state observations)
    physics_ms: float            # one low-level step of one simulator (on its own core)
    decision_ms: float           # per decision of one simulator beyond physics: rendering, observation, transfer
    render_ms: float             # decision_ms per camera frame (0 without cameras)
    reset_ms: float              # one simulator's episode reset (on its own core)
    overhead_ms: float           # per simulator per decision in the collector beyond env and act (recording, conversion)
    act_batch: int               # the batch act was timed at
    act_per_s: float             # decisions per second of act at act_batch
    update_per_s: float          # decision passes (forward + backward of one decision) per second of one update
    valid_fraction: float        # of the calibration rollout's decisions (the rest: after episodes ended)
    sync_s: float                # publishing the trainable tensors and loading them into an acting copy
    trainable_mb: float          # their size
    seconds: float               # the calibration's own wall-clock

    @property
    def chunk_ms(self) -> float:
        """One simulator's configured chunk (H low-level steps and one observation), on its own core."""
        return self.chunk_len * self.physics_ms + self.decision_ms

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def machine_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def calibration_envs(cfg: Config) -> int:
    """b: the run's simulators per pipeline stage (at most :data:`MAX_ENVS`), a multiple of the group size."""
    from embodirl.workers.layout import layout_from_config

    layout = layout_from_config(cfg, "env.train")
    G = max(1, cfg.algorithm.group_size)
    b = min(layout.envs_per_stage, MAX_ENVS)
    return max(G, b - b % G)


def _tile(obs: dict, rows: int) -> dict:
    """``obs`` (leading dim b) repeated to ``rows`` rows."""
    b = next(iter(obs.values())).shape[0]
    index = np.arange(rows) % b
    return {k: np.ascontiguousarray(v[index]) for k, v in obs.items()}


def _env_times(env, H: int, cores: int, new_starts) -> tuple[float, float, float, int]:
    """(physics ms per step, per-decision ms beyond physics, reset ms) of one simulator on its own core, and V.
    ``new_starts()``: the reset arguments of one rollout, planned as the runner plans them (a new init state each)."""
    b = env.num_envs
    A = env.spec.action_dim
    own_core = min(b, cores) / b          # the batch's wall time -> one simulator's time with a core to itself
    low, high = np.broadcast_to(env.spec.action_low, (A,)), np.broadcast_to(env.spec.action_high, (A,))
    rng = np.random.default_rng(0)

    def chunk(length: int):
        def step():
            actions = rng.uniform(low, high, size=(b, length, A)).astype(np.float32) * 0.2   # small, in range
            env.step(actions)
        return step

    reset_s = _timed(lambda: env.reset(seed=0, **new_starts()), 2)
    long_len = max(H, 2)
    t_long = _timed(chunk(long_len), CHUNKS)
    t_one = _timed(chunk(1), CHUNKS)
    physics = max(0.0, (t_long - t_one) / (long_len - 1))
    decision = max(0.0, t_one - physics)
    return physics * 1e3 * own_core, decision * 1e3 * own_core, reset_s * 1e3 * own_core, len(env.spec.camera_names)


def _act_rate(inference: PolicyInference, batch_obs: dict[str, np.ndarray], return_value: bool) -> float:
    """Decisions per second of ``inference``'s act on ``batch_obs``: repeated calls (at least :data:`ACT_CALLS`, for at
    least :data:`ACT_SECONDS`) after one untimed."""
    rows = next(iter(batch_obs.values())).shape[0]
    inference.request(batch_obs, return_value=return_value).result()     # untimed: first-call costs
    calls, t0 = 0, time.perf_counter()
    while calls < ACT_CALLS or time.perf_counter() - t0 < ACT_SECONDS:
        inference.request(batch_obs, return_value=return_value).result()
        calls += 1
    return calls * rows / (time.perf_counter() - t0)


def _update_seconds(policy: torch.nn.Module, actor: Actor, batch: TensorDict, algorithm: AlgorithmSection) -> float:
    """Seconds of one update of ``actor`` on ``batch`` (advantages included): the faster of two, as the first pays
    one-off costs (optimizer state, first backward)."""
    from embodirl.actor.actor import prepare_batch

    update_s = []
    for _ in range(2):
        policy.train()
        t0 = time.perf_counter()
        prepared, _ = prepare_batch(batch, algorithm)
        actor.train(prepared)
        update_s.append(time.perf_counter() - t0)
    return min(update_s)


def _sync_times(actor: Actor, inference: PolicyInference) -> tuple[float, float]:
    """(seconds, MiB) of the actor's publication of its trainable tensors and their load into the acting copy."""
    t0 = time.perf_counter()
    version, tensors = actor.publish_weights(full=True)
    inference.receive_weights(tensors, version)
    sync_s = time.perf_counter() - t0
    return sync_s, sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20


def calibrate(cfg) -> Calibration:
    """Time the parts of ``cfg`` (a typed or composed run config) on this machine (see module docstring)."""
    from embodirl import data as D
    from embodirl.actor.actor import Actor
    from embodirl.envs.registry import make_env
    from embodirl.models.registry import make_policy
    from embodirl.rollout.collector import RolloutCollector
    from embodirl.rollout.inference import PolicyInference
    from embodirl.rollout.starts import plan_starts
    from embodirl.schema.envs import action_conversion
    from embodirl.workers.inference_worker import TRAIN, sampling_from_config
    from embodirl.workers.layout import layout_from_config

    t_start = time.perf_counter()
    cfg = run_config(cfg)
    cores, load = machine_cores(), os.getloadavg()[0]
    layout = layout_from_config(cfg, "env.train")
    b, H = calibration_envs(cfg), cfg.model.action_chunk
    env = make_env(cfg.env.train, num_envs=b, seed=cfg.runner.seed)
    try:
        starts_rng = np.random.default_rng(cfg.runner.seed)

        def new_starts() -> dict:
            return plan_starts(cfg.env.train, env.spec, b, cfg.algorithm.group_size, starts_rng).reset_kwargs()

        physics_ms, decision_ms, reset_ms, V = _env_times(env, H, cores, new_starts)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.runner.seed)
            policy = make_policy(cfg.model, env.spec)
        sampling = sampling_from_config(cfg.rollout, cfg.runner.eval_greedy)[TRAIN]
        inference = PolicyInference(policy, env.spec.task_descriptions, sampling)
        return_value = cfg.algorithm.uses_critic
        # act at the batch an inference worker sees: one pipeline stage's observations
        obs, _ = env.reset(seed=cfg.runner.seed)
        batch_obs = _tile(obs, layout.envs_per_stage)
        policy.eval()
        act_per_s = _act_rate(inference, batch_obs, return_value)
        # a real rollout of the b simulators: its chunks and, below, the batch the update is timed on
        collector = RolloutCollector([env], inference, num_decisions=min(ROLLOUT_DECISIONS, layout.num_decisions),
                                     auto_reset=bool(cfg.env.train.auto_reset), return_value=return_value,
                                     group_size=cfg.algorithm.group_size, seed=cfg.runner.seed,
                                     conversion=action_conversion(cfg, "env.train"))
        batch = collector.collect(plan_starts(cfg.env.train, env.spec, b, cfg.algorithm.group_size, starts_rng),
                                  seed=cfg.runner.seed)
    finally:
        env.close()
    # the rollout's chunks (the policy's actions, the collector's path) set the chunk's cost; the probes above split
    # it into physics and the per-decision part in their proportion
    stats, T_cal = collector.stats, collector.T
    own_core = min(b, cores) / b
    chunk_ms = max(0.0, stats.env_s - reset_ms / 1e3 / own_core) / T_cal * 1e3 * own_core
    probe_ms = H * physics_ms + decision_ms
    if chunk_ms > 0 and probe_ms > 0:
        physics_ms, decision_ms = physics_ms * chunk_ms / probe_ms, decision_ms * chunk_ms / probe_ms
    overhead_ms = max(0.0, stats.total_s - stats.env_s - stats.infer_s) / T_cal / b * 1e3
    # the run's update epochs over a small batch: the per-update costs (advantages, replay) spread as in the run
    epochs = min(cfg.algorithm.update_epochs, MAX_UPDATE_EPOCHS)
    small = dataclasses.replace(
        cfg, algorithm=dataclasses.replace(cfg.algorithm, update_epochs=epochs),
        actor=dataclasses.replace(cfg.actor, global_batch_size=b, micro_batch_size=min(b, cfg.actor.micro_batch_size)))
    actor = Actor(policy, small, task_table=env.spec.task_descriptions,
                  temperature=1.0 if cfg.rollout.temperature is None else cfg.rollout.temperature)
    valid = float(batch.get(D.VALID).sum())
    update_s = _update_seconds(policy, actor, batch, cfg.algorithm)
    passes = valid * (epochs + (1 if cfg.algorithm.recompute_old_logprob else 0))   # a scoring forward counts as one
    sync_s, trainable_mb = _sync_times(actor, inference)
    device = str(next(policy.parameters()).device)
    if device.startswith("cuda"):
        device = torch.cuda.get_device_name()
    return Calibration(cores=cores, load=round(load, 2), device=device, envs=b, chunk_len=H, cameras=V,
                       physics_ms=physics_ms, decision_ms=decision_ms, render_ms=decision_ms / V if V else 0.0,
                       reset_ms=reset_ms, overhead_ms=overhead_ms, act_batch=layout.envs_per_stage, act_per_s=act_per_s,
                       update_per_s=passes / update_s, valid_fraction=valid / batch.get(D.VALID).numel(),
                       sync_s=sync_s, trainable_mb=trainable_mb, seconds=time.perf_counter() - t_start)
