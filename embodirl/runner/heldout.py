"""Training states held out from evaluation, at the run's level: the refusal of a run whose training starts from states
its evaluation runs, the row ``embodirl doctor`` shows, and the sweep over training states that puts success on them
beside success on the held-out evaluation states.

A benchmark's evaluation states (LIBERO's official init states, ManiSkill's seeds ``0 .. num_trials_per_task - 1``)
are for evaluation: by default training draws from states apart from them (``env.train.train_init_states: heldout``,
ids from :data:`~embodirl.envs.base.TRAIN_INIT_STATE_BASE`; the adapters say how, e.g.
:mod:`embodirl.envs.libero.states`), and a configuration that makes the two meet (training ids listed in
``env.train.init_state_ids``, a state file holding official states, ...) is refused before any worker starts, unless it
says so on purpose (``train_init_states: official``, a paper's setting), which the run then reports.

An adapter with evaluation states of its own provides ``training_states(train_env, eval_env) ->``
:class:`~embodirl.envs.base.TrainingStates`; for the others (the toy task) there is nothing to check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from embodirl.envs.base import TRAIN_INIT_STATE_BASE, TrainingStates
from embodirl.envs.registry import get_adapter
from embodirl.errors import ConfigError
from embodirl.schema import Config, run_config

KEY = "env.train.train_init_states"
GAP_KEY = "runner.eval_train_states_per_task"
_SHOWN = 4                      # starts named in a sentence


@dataclass
class StatesCheck:
    """How a run's training starts relate to its evaluation's: ``ok`` False when they meet and the config does not
    say so on purpose; ``disjoint`` False when they meet at all; ``detail`` what was found, ``fix`` the remedy."""

    ok: bool
    disjoint: bool
    detail: str
    fix: str = ""
    key: str = ""               # the key that makes them meet


def training_states(cfg: Config, eval_env) -> TrainingStates | None:
    """``env.train``'s training starts beside the evaluation sweep of ``eval_env`` (``env.eval`` as evaluation runs it:
    :func:`~embodirl.runner.evaluation.eval_env_cfg`); None: the adapter has no evaluation states of its own, or the two
    groups use different adapters."""
    train = cfg.env.train
    adapter = get_adapter(train.adapter)
    if eval_env.adapter != train.adapter or not hasattr(adapter, "training_states"):
        return None
    return adapter.training_states(train, eval_env)


def _ids(ids: Sequence[int]) -> str:
    """``0..49`` for a range, else the first few ids."""
    if isinstance(ids, range):
        return f"{ids.start}..{ids.stop - 1}" if len(ids) else "none"
    shown = ", ".join(str(i) for i in list(ids)[:_SHOWN])
    return shown + (f" and {len(ids) - _SHOWN} more" if len(ids) > _SHOWN else "")


def _starts(pairs: Sequence[tuple[int, int]]) -> str:
    shown = ", ".join(f"task {t} init state {k}" for t, k in pairs[:_SHOWN])
    return shown + (f" and {len(pairs) - _SHOWN} more" if len(pairs) > _SHOWN else "")


def check_states(cfg, eval_env) -> StatesCheck:
    """Where ``cfg`` (typed, or composed: converted) trains from and ``eval_env`` evaluates from, and whether that may
    run."""
    cfg = run_config(cfg)
    states = training_states(cfg, eval_env)
    if states is None:
        return StatesCheck(True, True, f"{cfg.env.train.adapter}: no evaluation states of its own to hold out")
    first = next(iter(states.pools.values()), range(0))
    trained = f"training draws init states {_ids(first)}" + (" per task" if len(states.pools) > 1 else "")
    if not states.shared:
        where = "the evaluation's" if states.same_tasks else "another task's"
        return StatesCheck(True, True, f"{trained}, apart from {where} (held out)")
    if states.on_purpose:
        return StatesCheck(True, False, f"{trained}, {len(states.shared)} of them evaluated too, on purpose ({KEY}="
                                        "official): the success rates mix trained starts")
    if states.key.startswith("env.eval"):
        fix = (f"evaluate official states only (ids below {TRAIN_INIT_STATE_BASE}) and report training states apart "
               f"with {GAP_KEY}")
    else:
        fix = (f"draw training states apart from the evaluation's ({KEY}=heldout, env.train.init_state_ids=null), or "
               f"set {KEY}=official to train on the evaluation states on purpose")
    n = len(states.shared)
    return StatesCheck(False, False, f"training would start from {n} init state{'s' if n > 1 else ''} that evaluation "
                                     f"runs too ({_starts(states.shared)})", fix, key=states.key)


def check(cfg: Config, eval_env) -> None:
    """Refuse (one :class:`ConfigError` sentence naming the keys and the fix) a run whose training starts from
    evaluation states without saying so, and a training-state sweep that cannot run."""
    result = check_states(cfg, eval_env)
    if not result.ok:
        raise ConfigError(result.key, f"{result.detail}; {result.fix}")
    per_task = cfg.runner.eval_train_states_per_task
    if per_task:
        train_schedule(cfg, eval_env, per_task)          # raises when it cannot run


def train_schedule(cfg: Config, eval_env, per_task: int) -> list[tuple[int, int]]:
    """``(task_id, init_state_id)`` of the training-state sweep: the first ``per_task`` training states of each task
    ``env.train`` trains on; ConfigError when the run has none apart from the evaluation's."""
    states = training_states(cfg, eval_env)
    if states is None or not states.same_tasks:
        raise ConfigError(GAP_KEY, f"evaluates training states on the evaluation simulators, and env.eval does not run "
                                   f"env.train's tasks with training states of their own ({cfg.env.train.adapter}); "
                                   f"set it to 0")
    if states.on_purpose:
        raise ConfigError(GAP_KEY, f"compares training states with held-out ones, and {KEY}=official trains on the "
                                   f"evaluation states themselves; set it to 0, or {KEY}=heldout")
    short = {t: len(ids) for t, ids in states.pools.items() if len(ids) < per_task}
    if short:
        task, count = next(iter(short.items()))
        raise ConfigError(GAP_KEY, f"asks for {per_task} training states per task, and task {task} has {count}; "
                                   f"ask for at most {count}")
    return [(t, int(k)) for t, ids in states.pools.items() for k in list(ids[:per_task])]
