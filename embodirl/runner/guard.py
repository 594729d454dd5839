"""The collapse guard (``runner.guard``): a run whose evaluation success falls well below its best, whose policy drifts
too far from the reference or loses its entropy, or whose update turns non-finite is rolled back to its best
evaluation's checkpoint and goes on with a lower learning rate - or is stopped - instead of training on, collapsed,
for hours.

Rules, each optional (``runner.guard.*``):

* ``success_drop`` / ``patience``: evaluation success more than ``success_drop`` below the best so far for
  ``patience`` evaluations in a row;
* ``max_kl``: ``kl/behaviour_ref_kl`` (KL of the rollout policy to the reference, adapters off) above it, or not a
  finite number, after a training step (needs the reference's log-probs: ``algorithm.kl_beta > 0``);
* ``min_entropy``: ``actor/entropy`` (mean per action unit) below it, or not a finite number, after a training step
  (every comparison with NaN is false: a NaN would otherwise never trip a rule);
* ``nonfinite``: a non-finite loss term or gradient (:class:`~embodirl.errors.NonFiniteUpdate`), which otherwise
  stops the run.

A tripped rule with ``action: rollback`` restores every actor rank from the checkpoint of the best evaluation so
far (weights, optimizer moments, learning-rate schedule; the guard writes one at each new best), multiplies the
learning rate by ``lr_factor`` (cumulatively), publishes the restored weights and goes on counting steps; after
``max_rollbacks`` rollbacks, or with ``action: stop``, the run stops with one sentence naming the best checkpoint.
Every trip is an event in ``metrics.jsonl`` and on the console.

The decision is :class:`CollapseGuard`'s (pure bookkeeping, no I/O); the runner does the checkpoints and rollbacks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

from embodirl.schema.sections import GUARD_ACTIONS, GuardSection

ROLLBACK, STOP = GUARD_ACTIONS
KL_METRIC = "kl/behaviour_ref_kl"
ENTROPY_METRIC = "actor/entropy"


@dataclass
class GuardState:
    """What the guard remembers (saved in the runner's checkpoint state, restored on resume)."""

    best_success: float | None = None
    best_step: int | None = None
    best_checkpoint: str | None = None
    below: int = 0                  # evaluations in a row more than success_drop below the best
    rollbacks: int = 0
    lr_scale: float = 1.0
    history: list[dict] = field(default_factory=list)


class CollapseGuard:
    """Decides when a run has collapsed (see module docstring)."""

    def __init__(self, settings: GuardSection | None = None, state: GuardState | None = None):
        """``settings``: the typed ``runner.guard`` section; None: no guard (before a run's settings are read)."""
        self.settings = settings
        self.state = state or GuardState()

    @property
    def enabled(self) -> bool:
        return self.settings is not None and self.settings.enabled

    @property
    def _rules(self) -> GuardSection:
        """The settings the rules read: the runner consults a guard only once it has them (:attr:`enabled`)."""
        assert self.settings is not None
        return self.settings

    # --- observations ------------------------------------------------------------------------------------------
    def is_new_best(self, success: float) -> bool:
        return self.state.best_success is None or success > self.state.best_success

    def record_best(self, step: int, success: float, checkpoint: str) -> None:
        self.state.best_success, self.state.best_step, self.state.best_checkpoint = float(success), int(step), checkpoint
        self.state.below = 0

    def after_eval(self, step: int, success: float) -> str | None:
        """The reason the guard trips after this evaluation, or None."""
        s = self._rules
        if s.success_drop is None or self.state.best_success is None:
            return None
        if success < self.state.best_success - s.success_drop:
            self.state.below += 1
        else:
            self.state.below = 0
        if self.state.below >= s.patience:
            return (f"evaluation success {success:.2f} has stayed more than {s.success_drop:g} below its best "
                    f"{self.state.best_success:.2f} (step {self.state.best_step}) for {self.state.below} evaluation(s)")
        return None

    def after_step(self, metrics: Mapping[str, float]) -> str | None:
        """The reason the guard trips after a training step's metrics, or None."""
        s = self._rules
        kl, entropy = metrics.get(KL_METRIC), metrics.get(ENTROPY_METRIC)
        if s.max_kl is not None and kl is not None and not float(kl) <= s.max_kl:        # NaN trips it too
            where = "not comparable with" if math.isnan(float(kl)) else "above"
            return f"the KL to the reference policy is {float(kl):.4g}, {where} runner.guard.max_kl={s.max_kl:g}"
        if s.min_entropy is not None and entropy is not None and not float(entropy) >= s.min_entropy:
            where = "not comparable with" if math.isnan(float(entropy)) else "below"
            return f"the policy's entropy is {float(entropy):.4g}, {where} runner.guard.min_entropy={s.min_entropy:g}"
        return None

    # --- decisions ---------------------------------------------------------------------------------------------
    def decide(self, step: int, reason: str) -> tuple[str, str]:
        """``(action, sentence)`` for a trip at ``step``: roll back (the state records it) or stop."""
        st = self.state
        if st.best_checkpoint is None:
            return STOP, f"the collapse guard tripped at step {step} ({reason}) before any checkpoint to roll back to"
        s = self._rules
        best = "the start, before any evaluation" if st.best_success is None else f"success {st.best_success:.2f}"
        where = f"the best checkpoint is {st.best_checkpoint} ({best} at step {st.best_step})"
        if s.action == STOP:
            return STOP, f"the collapse guard stopped the run at step {step}: {reason}; {where}"
        if st.rollbacks >= s.max_rollbacks:
            return STOP, (f"the collapse guard stopped the run at step {step} after {st.rollbacks} rollback(s) "
                          f"(runner.guard.max_rollbacks): {reason}; {where}")
        st.rollbacks += 1
        st.lr_scale *= s.lr_factor
        st.below = 0
        st.history.append({"step": int(step), "reason": reason, "to_step": st.best_step, "lr_scale": st.lr_scale})
        return ROLLBACK, (f"step {step}: {reason}; rolling back to step {st.best_step} ({best}) with the learning "
                          f"rate x{st.lr_scale:g} (rollback {st.rollbacks} of {s.max_rollbacks})")

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: Mapping | None) -> None:
        """Restore :meth:`state_dict`; a state that is not one (unknown keys, values of the wrong type) raises
        ``ValueError`` saying which entry."""
        if not state:
            return
        if not isinstance(state, Mapping):
            raise ValueError(f"a {type(state).__name__}, not a mapping")
        known = {f.name: f for f in fields(GuardState)}
        unknown = sorted(set(state) - set(known))
        if unknown:
            raise ValueError(f"unknown entry '{unknown[0]}'")
        for name, value in state.items():
            if not _is_a(value, known[name].type):
                raise ValueError(f"'{name}' is {value!r}, not {known[name].type}")
        self.state = GuardState(**dict(state))


_TYPES = {"float": (int, float), "int": (int,), "str": (str,), "list[dict]": (list,)}


def _is_a(value, annotation: object) -> bool:
    """``value`` fits a :class:`GuardState` annotation (``float | None``, ``int``, ...; the module's annotations are
    strings)."""
    names = [a.strip() for a in str(annotation).split("|")]
    if value is None:
        return "None" in names
    if isinstance(value, bool):
        return False
    return any(isinstance(value, _TYPES.get(n, ())) for n in names if n != "None")
