"""One training attempt of a :class:`~embodirl.runner.loop.Runner`, as a loop over named phases.

Each step runs::

    collect     rollout.rollout_epoch rollouts -> one batch [N, T]              (Runner._collect)
    prepare     the reference's log-probs (a KL term only), then the driver's KL penalty, group filter, advantages
    update      every actor rank trains on its shard of whole groups
    publish     the tensors the update changed go from rank 0 to the acting policy
    log         the step's metrics to metrics.jsonl, TensorBoard, the console
    evaluate    every runner.val_check_interval steps
    checkpoint  every runner.save_interval steps and at the last; on a preemption signal, the checkpoint and stop

The collapse guard, the moving average (``actor.ema_decay``) and parking the actor in host memory
(``actor.enable_offload``) are hooks around these phases (:mod:`~embodirl.runner.hooks`), not part of them. A step
whose update the guard rolled back publishes, logs and evaluates nothing; it is checkpointed only as the run's last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from embodirl import data as D
from embodirl.actor.actor import prepare_batch
from embodirl.errors import NonFiniteUpdate, RunFailed, last_line
from embodirl.runner import checkpoint as ckpt
from embodirl.runner.collection import collection_metrics
from embodirl.runner.guard import ROLLBACK, STOP, CollapseGuard
from embodirl.runner.hooks import (
    CHECKPOINT,
    COLLECT,
    EVALUATE,
    LOG,
    PREPARE,
    PUBLISH,
    UPDATE,
    EmaHook,
    GuardHook,
    ParkingHook,
)
from embodirl.runner.preemption import PreemptionWatch
from embodirl.runner.run_state import restore as restore_run_state

if TYPE_CHECKING:
    from tensordict import TensorDict

    from embodirl.rollout.collector import RolloutStats

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StepRecord:
    """What one training step's phases hand on to the next ones."""

    number: int
    started: float                    # time.perf_counter() at the step's start
    batch: TensorDict | None = None              # the collected Trajectory batch [N, T]
    stats: RolloutStats | None = None            # its timings
    prepared: TensorDict | None = None           # the batch with advantages, as the actor ranks train on it
    timings: dict = dataclasses.field(default_factory=dict)          # time/* of the step
    metrics: dict = dataclasses.field(default_factory=dict)          # what the log phase writes
    prepare_metrics: dict = dataclasses.field(default_factory=dict)
    update_metrics: dict = dataclasses.field(default_factory=dict)
    sync_metrics: dict = dataclasses.field(default_factory=dict)
    seconds: dict = dataclasses.field(default_factory=dict)          # phase -> seconds it took, hooks included
    success: float | None = None      # the evaluation's success rate (evaluate)
    rolled_back: bool = False         # the collapse guard restored its best checkpoint instead of this update


class TrainingRun:
    """The steps of one attempt, from its start (or the checkpoint it resumes) to ``runner.max_steps``, with the
    worker groups ``groups`` the runner built for it. The runner keeps what outlives an attempt (its collapse guard,
    the run's minutes, the evaluation curve) and the pieces a step calls (``_collect``, ``_save``, ``_log_eval``)."""

    def __init__(self, runner, groups):
        self.runner, self.groups, self.settings = runner, groups, runner.cfg.runner
        self.max_steps = self.settings.max_steps
        self.preemption = PreemptionWatch()     # SIGTERM / SIGUSR1: finish the step, checkpoint, stop
        self.phases = {COLLECT: self._collect, PREPARE: self._prepare, UPDATE: self._update, PUBLISH: self._publish,
                       LOG: self._log, EVALUATE: self._evaluate, CHECKPOINT: self._checkpoint}

    def run(self) -> None:
        self._start()
        try:
            with self.preemption.installed():
                self._before_first_step()
                for step in range(self.start_step + 1, self.max_steps + 1):
                    self._step(step)
        finally:
            if self.progress is not None:
                self.progress.close()
            self.logger.close()

    # --- the start of an attempt ----------------------------------------------------------------------------------
    def _start(self) -> None:
        """The actor ranks (restored from the checkpoint the attempt resumes), the acting policy given their weights,
        ``placement.json``, the metrics logger, the progress bar and the hooks."""
        runner, groups, cfg = self.runner, self.groups, self.runner.cfg
        runner.guard = CollapseGuard(self.settings.guard)
        self.actors = groups.make_actors()
        self.starts_rng = np.random.default_rng(runner.seed)
        self.start_step, self.env_steps = 0, 0.0
        self.kl_coef = runner.algorithm.kl_controller().value
        source = runner._resume_source()
        if source is not None:
            self._resume(source)
        # the acting policy starts from the actor's weights and version (restored ones after a resume)
        groups.publish_weights(full=True)
        runner._write_placement(groups, self.actors)
        self.logger = runner._logger(resume_step=self.start_step)     # a fresh start drops records of an earlier attempt
        self.logger.log_hparams(dataclasses.asdict(cfg))
        self.progress = None
        if self.settings.progress_bar:
            from tqdm import tqdm

            self.progress = tqdm(total=self.max_steps, initial=self.start_step, desc="train", unit="step", leave=False)
        self.saved = (self.start_step, source)      # the step of the latest checkpoint and its folder
        ema = cfg.actor.ema_decay > 0
        self.hooks: list[GuardHook | ParkingHook | EmaHook] = []    # outermost first (embodirl/runner/hooks.py)
        if runner.guard.enabled:
            self.hooks.append(GuardHook(runner.guard, self))
        if cfg.actor.enable_offload:
            self.hooks.append(ParkingHook(self.actors, ema=ema))
        if ema:
            self.hooks.append(EmaHook(self.actors, groups))

    def _resume(self, source: Path) -> None:
        runner = self.runner
        self.start_step = ckpt.checkpoint_step(source)
        ckpt.load_actor_state(self.actors, source, runner.cfg)
        restored = restore_run_state(source, self.starts_rng, runner.guard, self.kl_coef, self.groups)
        self.env_steps, runner._elapsed_offset, self.kl_coef = restored.env_steps, restored.elapsed_min, restored.kl_coef
        log.info("resumed from %s (step %d)", source, self.start_step)

    def _before_first_step(self) -> None:
        guard, first = self.runner.guard, self.start_step == 0
        if guard.enabled and first and not self.settings.val_before_train:
            guard.state.best_checkpoint, guard.state.best_step = str(self.save(0)), 0   # before any evaluation
        if self.settings.val_before_train and first:
            self._run(EVALUATE, StepRecord(0, time.perf_counter()))
        self.stop_if_preempted(self.start_step)      # a signal during the start's checkpoint or evaluation

    # --- one step ---------------------------------------------------------------------------------------------------
    def _step(self, step: int) -> None:
        record = StepRecord(step, time.perf_counter())
        self._run(COLLECT, record)
        self._run(PREPARE, record)
        try:
            self._run(UPDATE, record)
        except NonFiniteUpdate as exc:            # no collapse guard took it (runner.guard.nonfinite)
            raise RunFailed(last_line(exc)) from None
        if record.rolled_back:
            self._tick()
        else:
            self._run(PUBLISH, record)
            self._run(LOG, record)
            interval = self.settings.val_check_interval
            if interval and step % interval == 0 and not self.preemption.requested:
                self._run(EVALUATE, record)
        self._run(CHECKPOINT, record)

    def _run(self, phase: str, record: StepRecord) -> None:
        """Phase ``phase`` of the step inside its hooks; ``record.seconds[phase]``: how long both took."""
        started = time.perf_counter()
        with contextlib.ExitStack() as around:
            for hook in self.hooks:
                around.enter_context(hook.around(phase, record))
            self.phases[phase](record)
        record.seconds[phase] = time.perf_counter() - started

    # --- the phases -------------------------------------------------------------------------------------------------
    def _collect(self, record: StepRecord) -> None:
        batch: TensorDict
        stats: RolloutStats
        batch, stats = self.runner._collect(self.groups, record.number, self.starts_rng)
        record.batch, record.stats = batch, stats
        collect_s = time.perf_counter() - record.started - stats.baseline_s   # ReMax's greedy rollouts apart
        H = self.runner.cfg.model.action_chunk
        record.timings, record.metrics = collection_metrics(batch, stats, H, collect_s)

    def _prepare(self, record: StepRecord) -> None:
        """Advantages, driver side, on the whole batch."""
        batch = record.batch
        assert batch is not None                  # the collect phase ran first
        if self.runner.algorithm.kl_active and D.LOGPROB_REF not in batch.keys():
            batch = self.actors.with_ref_logprob(batch)
        record.prepared, record.prepare_metrics = prepare_batch(batch, self.runner.algorithm, kl_coef=self.kl_coef)

    def _update(self, record: StepRecord) -> None:
        record.update_metrics = self.actors.train(record.prepared)
        self.kl_coef = float(record.update_metrics.get("actor/kl_coef", self.kl_coef))

    def _publish(self, record: StepRecord) -> None:
        """The tensors this update changed go from rank 0 to the acting policy."""
        record.sync_metrics = self.groups.publish_weights()

    def _log(self, record: StepRecord) -> None:
        seconds = record.seconds
        record.timings["time/advantages"] = seconds[PREPARE]
        record.timings["time/update"] = seconds[PREPARE] + seconds[UPDATE]       # advantages included
        record.timings["time/publish_weights"] = seconds[PUBLISH]
        record.timings["time/step"] = time.perf_counter() - record.started
        metrics = record.metrics
        metrics.update({k: float(v) for k, v in record.prepare_metrics.items()})
        metrics.update(record.update_metrics)
        metrics.update(record.sync_metrics)
        metrics.update(record.timings)
        self.env_steps += metrics["train/episode_length"] * metrics["train/episodes"]
        metrics["env/total_steps"] = self.env_steps
        metrics["time/elapsed_min"] = self.runner._elapsed_min()
        self.logger.log(record.number, metrics)
        self._tick()

    def _evaluate(self, record: StepRecord) -> None:
        record.success = self.runner._log_eval(self.logger, self.groups, record.number)

    def _checkpoint(self, record: StepRecord) -> None:
        step, interval = record.number, self.settings.save_interval
        # a step the guard rolled back is written only as the run's last (its weights are then final)
        if interval and (step == self.max_steps or (not record.rolled_back and step % interval == 0)):
            self.save(step)
        self.stop_if_preempted(step)

    # --- what the phases and hooks share ----------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        path = self.runner._save(step, self.actors, self.starts_rng, self.env_steps, groups=self.groups,
                                 kl_coef=self.kl_coef)
        self.saved = (step, path)
        return path

    def trip(self, reason: str | None, step: int) -> None:
        """A tripped collapse guard (``reason``; None: nothing tripped): log the event; roll every actor rank back to
        the best checkpoint, scale the learning rate and publish the restored weights - or stop the run."""
        if reason is None:
            return
        guard = self.runner.guard
        action, sentence = guard.decide(step, reason)
        st = guard.state
        self.logger.event(step, "guard", sentence, {"guard/rollbacks": st.rollbacks, "guard/lr_scale": st.lr_scale,
                                                    "guard/rolled_back_to": st.best_step if action == ROLLBACK else -1})
        if action == STOP:
            raise RunFailed(sentence)
        ckpt.load_actor_state(self.actors, Path(st.best_checkpoint), self.runner.cfg)
        self.actors.set_lr_scale(st.lr_scale)
        self.groups.publish_weights(full=True)

    def stop_if_preempted(self, step: int) -> None:
        """After training step ``step`` (or before the first, at ``start_step``): on a preemption signal, write its
        checkpoint unless it exists, and raise :class:`~embodirl.runner.preemption.Preempted`."""
        if not self.preemption.requested:
            return
        saved_step, path = self.saved
        if saved_step != step:
            path = self.save(step)
        if step < self.max_steps:          # at the last step the run is complete: it ends as any finished run
            raise self.preemption.stop(step, path)

    def _tick(self) -> None:
        if self.progress is not None:
            self.progress.update(1)
