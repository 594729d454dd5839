"""The environment interface every simulator adapter implements.

Two levels, so that each simulator can live in its own process (MuJoCo and PhysX-CPU are
single-threaded) while GPU-batched simulators implement the batch directly:

* :class:`SimEnv` - one simulator instance. It knows how to reset to a task / init state and how to
  execute one action chunk ``[H, A]`` of low-level steps, rendering cameras only where asked.
* :class:`ChunkVectorEnv` - a batch of ``B`` environments stepped one action chunk ``[B, H, A]`` at
  a time; this is what env workers drive. :class:`embodirl.envs.vector.vector_env.ProcessVectorEnv` lifts
  ``SimEnv`` factories into it (one process per simulator, fault recovery); a GPU-batched ManiSkill
  backend implements it directly.

Batched observations are a dict of numpy arrays::

    images       uint8   [B, V, C, h, w]   camera images at the chunk's end (absent for state-only envs)
    state        float32 [B, S]            proprio / full state (absent when the env has none)
    task_id      int64   [B]               index into ``spec.task_descriptions``

Conventions follow gymnasium's vector envs where they fit: ``reset`` returns ``(obs, info)``,
``step`` returns ``(obs, reward, terminated, truncated, info)``; ``terminated`` (success or failure)
and ``truncated`` (time limit) are kept apart. With ``auto_reset`` an env whose episode ended is reset
inside the same ``step`` call (gymnasium's "same-step" mode): the returned observation is the new
episode's first one and the final observation is in ``info["final_obs"]``. With
``ignore_terminations`` an episode runs to its time limit whatever the simulator's done flag says,
and ``info["success"]`` is "succeeded at some step of this episode so far".
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from embodirl.config_fields import num, one_of, required, section
from embodirl.envs.conventions import ActionConvention

#: reward (and value) granularity: one per decision ``[N, T]`` or one per action ``[N, T, H]``
#: (``env.*.reward_type``, ``algorithm.reward_type``, ``model.value_type``); named once, here, so that the
#: simulator processes need not import torch to read it
CHUNK_LEVEL = "chunk_level"
ACTION_LEVEL = "action_level"
REWARD_TYPES = (CHUNK_LEVEL, ACTION_LEVEL)

#: ``train_init_states``: where training episodes start. ``heldout``: from states apart from the ones the benchmark
#: evaluates (LIBERO: sampled as LIBERO made its init files, :mod:`embodirl.envs.libero.states`; ManiSkill: seeds from
#: :data:`TRAIN_INIT_STATE_BASE` on); ``official``: from the evaluation's own states, on purpose (a paper's setting)
HELDOUT, OFFICIAL = "heldout", "official"
TRAIN_INIT_STATES = (HELDOUT, OFFICIAL)
#: init state ids from this one on name held-out training states, those below it the benchmark's evaluation states
#: (LIBERO: official init state k; ManiSkill: episode seed k), so the two sets never share an id
TRAIN_INIT_STATE_BASE = 2**30


@dataclass
class EnvSpec:
    """Static description of an environment (identical for every sub-environment)."""

    action_dim: int                       # A: low-level action dim the simulator consumes
    max_episode_steps: int                # low-level steps before truncation
    task_descriptions: list[str]          # the task/instruction table; obs["task_id"] indexes it
    camera_names: list[str] = field(default_factory=list)   # V cameras, in image order
    image_size: tuple[int, int] | None = None                # (h, w) of every camera image
    state_dim: int = 0                    # S; 0 when the env has no state vector
    num_init_states: list[int] = field(default_factory=list)  # per task: training resets draw from this many init
    first_init_state: int = 0             # ... states, ids first_init_state + 0..n-1; empty: random seeds from it on
    action_low: float | list[float] = -1.0
    action_high: float | list[float] = 1.0
    name: str = ""
    #: per task: the suite (or other group) it belongs to, which evaluation reports group by; empty: all ``name``
    task_groups: list[str] = field(default_factory=list)
    #: what the simulator consumes natively, as its adapter declares it (:func:`embodirl.envs.registry.make_env` sets
    #: it; None: undeclared). ``action_low``/``action_high`` are in this convention
    action_convention: ActionConvention | None = None


@dataclass
class ChunkResult:
    """What :meth:`SimEnv.step_chunk` returns for one simulator.

    ``rewards`` has one entry per executed step (``steps`` <= H; the chunk stops early when the episode
    ends). ``frames`` holds ``[steps, V, C, h, w]`` images only when ``render_all`` was asked.
    """

    obs: dict[str, np.ndarray]            # un-batched: images [V,C,h,w], state [S], task_id ()
    rewards: np.ndarray                   # float32 [steps]
    terminated: bool
    truncated: bool
    success: bool
    steps: int
    frames: np.ndarray | None = None
    info: dict = field(default_factory=dict)


class SimEnv(abc.ABC):
    """One simulator instance (lives in one process)."""

    spec: EnvSpec
    #: the init state the last ``reset`` used; adapters with fixed init states set it when they choose
    #: one themselves (``init_state_id=None``), so that a crashed simulator is restarted into the same
    #: state. None: random / unknown.
    init_state_id: int | None = None

    @abc.abstractmethod
    def reset(self, task_id: int | None = None, init_state_id: int | None = None,
              seed: int | None = None) -> dict[str, np.ndarray]:
        """Start an episode of ``task_id`` from ``init_state_id`` (None: the adapter's choice) and
        return the un-batched observation."""

    @abc.abstractmethod
    def step_chunk(self, actions: np.ndarray, render_all: bool = False) -> ChunkResult:
        """Execute ``actions`` ``[H, A]`` (un-normalised, in the simulator's own convention, as its adapter declares
        it: the rollout has converted the policy's, :mod:`embodirl.envs.conventions`). Cameras render only after the
        last executed step unless ``render_all``."""

    def render_frame(self) -> np.ndarray | None:
        """An RGB frame ``[h, w, 3]`` uint8 for video of the current state (None if no camera)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class ChunkVectorEnv(abc.ABC):
    """A batch of B environments stepped one action chunk at a time (see module docstring)."""

    spec: EnvSpec
    num_envs: int

    @abc.abstractmethod
    def reset(self, *, env_ids: np.ndarray | None = None, task_ids: np.ndarray | None = None,
              init_state_ids: np.ndarray | None = None, seed: int | None = None
              ) -> tuple[dict[str, np.ndarray], dict]:
        """Reset all (or ``env_ids``) envs; returns the full batched observation and info."""

    @abc.abstractmethod
    def step(self, actions: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray, dict]:
        """Step chunks ``[B, H, A]``. Returns ``obs``, ``reward`` (float32 ``[B]`` chunk-level: the sum
        of the executed steps' rewards times ``reward_coef``; ``[B, H]`` action-level, zero-padded),
        ``terminated`` bool ``[B]``, ``truncated`` bool ``[B]``, and ``info`` with at least
        ``success`` bool ``[B]``, ``restarted`` bool ``[B]`` (a crashed simulator was replaced: the
        episode is invalid), ``episode_return``/``episode_length`` for envs whose episode ended."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --- config ---------------------------------------------------------------------------------------------------
def _adapters():
    from embodirl.envs.registry import available_adapters
    return available_adapters()


def _known_adapter(name) -> bool:
    from embodirl.envs.registry import ADAPTERS
    return isinstance(name, str) and ADAPTERS.known(name)


@dataclass
class VideoConfig:
    """``env.*.video``: episode videos (:mod:`embodirl.envs.video`)."""

    enabled: bool = required()
    env_ids: list[int] = required()
    fps: int = num(1)
    overlay: bool = required()


@dataclass
class CommonEnvConfig:
    """The keys every env split has, whatever its adapter (types and ranges; the values live in the YAML). An
    adapter types its own keys with a subclass it registers with (``@register_adapter(name, config=...)``)."""

    adapter: str = one_of(_adapters, known=_known_adapter)
    num_envs: int = num(1)
    max_episode_steps: int = num(1)
    step_timeout_s: float | None = num(0, lo_open=True, null=True)    # null: wait for ever
    reward_coef: float = required()
    use_rel_reward: bool = required()
    reward_type: str = one_of(REWARD_TYPES)
    auto_reset: bool = required()
    ignore_terminations: bool = required()
    use_fixed_reset_state_ids: bool = required()
    init_state_ids: list[int] | None = required()
    num_trials_per_task: int = num(1)
    video: VideoConfig = section(VideoConfig)
    #: the keys that define the training-state set; evaluation takes env.train's, so that the training states it can
    #: sweep (``runner.eval_train_states_per_task``) are the ones training started from
    training_state_keys: ClassVar[tuple[str, ...]] = ()

    @property
    def task_subset(self) -> list[int] | None:
        """The task ids this group's episodes are drawn from (an adapter's ``task_ids`` key); None or empty: every
        task of the env's table."""
        return None

    @property
    def statistics_key(self) -> str | None:
        """The name a checkpoint's action statistics are kept under for this env (a dataset or suite name, as
        OpenVLA-OFT's ``unnorm_key``); None: the env names none."""
        return None


@dataclass
class TrainingStates:
    """Where an env split's training episodes start, beside the evaluation sweep of another group (the adapters with
    evaluation states of their own: ``training_states(train_env, eval_env)``)."""

    pools: dict[int, Sequence[int]]       # task id -> the init state ids training resets draw from
    shared: list[tuple[int, int]]         # (task id, init state id) of the evaluation sweep that training starts from too
    key: str                              # the key that makes them shared (``env.train.init_state_ids``, ...)
    on_purpose: bool                      # ``train_init_states: official``: training uses the evaluation states
    same_tasks: bool                      # the evaluation group runs the training group's tasks (suite, task)


def shared_starts(schedule: Sequence[tuple[int, int]], pools: dict[int, Sequence[int]]) -> list[tuple[int, int]]:
    """The ``(task, init state)`` pairs of an evaluation ``schedule`` that the training ``pools`` (task -> ids, ranges
    included) also hold."""
    return [(task, k) for task, k in schedule if task in pools and k in pools[task]]
