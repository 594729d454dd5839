"""What runs around a training step's phases (:mod:`~embodirl.runner.training`) rather than inside them: the
collapse guard's checks, the moving average's swap for evaluation, and parking the actor's state in host memory.

A hook is a context manager factory, ``hook.around(phase, record)``: the code before its ``yield`` runs before the
phase, the code after it once the phase has returned. The training run enters its hooks in list order, so the first
one listed is the outermost: it sees the phase first and has the last word after it. The order the run uses,
``[GuardHook, ParkingHook, EmaHook]``, gives for an evaluation: swap in the average, evaluate, swap back, park the
actor, then let the guard judge the success (and write its best checkpoint).
"""

from __future__ import annotations

import contextlib

from embodirl.errors import NonFiniteUpdate, last_line

COLLECT, PREPARE, UPDATE, PUBLISH, LOG, EVALUATE, CHECKPOINT = (
    "collect", "prepare", "update", "publish", "log", "evaluate", "checkpoint")
#: a step's phases in the order they run (evaluate only every ``runner.val_check_interval`` steps)
PHASES = (COLLECT, PREPARE, UPDATE, PUBLISH, LOG, EVALUATE, CHECKPOINT)


class GuardHook:
    """The collapse guard (:mod:`~embodirl.runner.guard`) around the phases it watches: a non-finite update is rolled
    back instead of ending the run (``runner.guard.nonfinite``), each logged step's metrics and each evaluation's
    success are checked, and a new best evaluation writes the checkpoint a later rollback returns to. ``run`` is the
    :class:`~embodirl.runner.training.TrainingRun` (its ``save`` and ``trip``)."""

    def __init__(self, guard, run):
        self.guard, self.run = guard, run

    @contextlib.contextmanager
    def around(self, phase: str, record):
        if phase == UPDATE and self.guard.settings.nonfinite:
            try:
                yield
            except NonFiniteUpdate as exc:       # the optimizer step was not taken; the weights are the last step's
                self.run.trip(last_line(exc), record.number)
                record.rolled_back = True
            return
        yield
        if phase == LOG:
            self.run.trip(self.guard.after_step(record.metrics), record.number)
        elif phase == EVALUATE:
            if self.guard.is_new_best(record.success):   # the rollback target: these weights and actor state
                self.guard.record_best(record.number, record.success, str(self.run.save(record.number)))
            else:
                self.run.trip(self.guard.after_eval(record.number, record.success), record.number)


class EmaHook:
    """``actor.ema_decay``: the acting policy evaluates the moving average of the weights, then gets the trained
    weights back (also when the evaluation fails)."""

    def __init__(self, actors, groups):
        self.actors, self.groups = actors, groups

    @contextlib.contextmanager
    def around(self, phase: str, record):
        if phase != EVALUATE:
            yield
            return
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        self.actors.swap_ema()
        self.groups.publish_weights(full=True)


class ParkingHook:
    """``actor.enable_offload`` (collocated): the actor's state waits in host memory while rollouts run. It is parked
    after each publication, and after an evaluation whose moving-average swap (``ema``) brought it back."""

    def __init__(self, actors, *, ema: bool):
        self.actors, self.ema = actors, ema

    @contextlib.contextmanager
    def around(self, phase: str, record):
        if phase == EVALUATE and self.ema:
            try:
                yield
            finally:
                self.actors.offload()
            return
        yield
        if phase == PUBLISH:
            self.actors.offload()
