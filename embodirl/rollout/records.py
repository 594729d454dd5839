"""Per-decision records of one env batch, assembled into the ``Trajectory`` contract.

A :class:`DecisionRecorder` holds preallocated numpy buffers for ``B`` env slots over ``T`` decisions
and is filled one decision at a time, in the order the collector sees things:

1. :meth:`~DecisionRecorder.record_obs` - the observation the policy acted on (``images``, ``state``,
   ``task_id``) and whether the decision happened (``valid``);
2. :meth:`~DecisionRecorder.record_policy` - what the inference worker returned (``action_chunk``, the
   policy-space actions ``action_tokens``/``action_sample``, ``logprob_behavior``, ``value``) and the
   ``weight_version`` that produced it;
3. :meth:`~DecisionRecorder.record_step` - what the env returned for that chunk (``reward``,
   ``terminated``, ``truncated``, ``success``, and which of its actions ran: ``executed``); rewards and
   done flags of invalid decisions are zeroed;
4. :meth:`~DecisionRecorder.record_final_value` - for policies with a value head, the value of the final
   observation of each episode the chunk truncated (``final_value``; zeros wherever values exist
   otherwise).

:meth:`~DecisionRecorder.build` turns the buffers into a validated :class:`tensordict.TensorDict`
with batch dims ``[B, T]`` (see :mod:`embodirl.data`), adding the per-episode fields ``group_id``,
``init_state_id`` and, for policies with a value head, ``extras.bootstrap_value``.

Nothing here knows about processes or Ray: the in-process collector and the env worker share it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from embodirl import data as D

OBS_FIELDS = (D.IMAGES, D.STATE, D.TASK_ID)
POLICY_FIELDS = (D.ACTION_CHUNK, D.ACTION_TOKENS, D.ACTION_SAMPLE, D.ACTION_CHAIN, D.LOGPROB_BEHAVIOR, D.VALUE)

def decisions_per_episode(cfg) -> int:
    """T: decisions per training rollout of the typed config ``cfg`` (``rollout.max_decisions`` or
    ceil(env.train.max_episode_steps / H))."""
    explicit = cfg.rollout.max_decisions
    return explicit if explicit else math.ceil(cfg.env.train.max_episode_steps / cfg.model.action_chunk)

_DTYPES = {
    D.IMAGES: np.uint8, D.STATE: np.float32, D.TASK_ID: np.int64, D.ACTION_CHUNK: np.float32,
    D.ACTION_TOKENS: np.int64, D.ACTION_SAMPLE: np.float32, D.ACTION_CHAIN: np.float32, D.LOGPROB_BEHAVIOR: np.float32,
    D.VALUE: np.float32, D.REWARD: np.float32, D.FINAL_VALUE: np.float32, D.EXECUTED: np.bool_,
}


def to_numpy(x) -> np.ndarray:
    """A tensor or array as a numpy array on the CPU (no copy when it already is one)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


class DecisionRecorder:
    """Buffers for ``B`` env slots x ``T`` decisions (see module docstring).

    Buffers are allocated on first use from the shapes actually seen, so the recorder needs no
    knowledge of the policy or camera set-up.
    """

    def __init__(self, num_envs: int, num_decisions: int):
        self.B, self.T = int(num_envs), int(num_decisions)
        self._buf: dict[str, np.ndarray] = {}
        self.valid = np.zeros((self.B, self.T), bool)            # (B, T)
        self.terminated = np.zeros((self.B, self.T), bool)       # (B, T)
        self.truncated = np.zeros((self.B, self.T), bool)        # (B, T)
        self.success = np.zeros((self.B, self.T), bool)          # (B, T)
        self.weight_version = np.zeros((self.B, self.T), np.int64)  # (B, T)
        self.steps_recorded = 0

    # --- filling ---------------------------------------------------------------------------------
    def _put(self, key: str, t: int, value) -> None:
        arr = to_numpy(value)
        if arr.shape[:1] != (self.B,):
            raise ValueError(f"record '{key}' at decision {t} has shape {list(arr.shape)}, expected [B={self.B}, ...]")
        buf = self._buf.get(key)
        if buf is None:
            buf = self._buf[key] = np.zeros((self.B, self.T, *arr.shape[1:]), _DTYPES.get(key, arr.dtype))
        buf[:, t] = arr

    def record_obs(self, t: int, obs: Mapping[str, np.ndarray], valid: np.ndarray) -> None:
        """The observation decision ``t`` acted on; ``valid`` bool ``[B]``: the decision happened."""
        for key in OBS_FIELDS:
            if key in obs:
                self._put(key, t, obs[key])
        self.valid[:, t] = valid

    def record_policy(self, t: int, out: Mapping[str, object], weight_version: int) -> None:
        """The inference worker's answer for decision ``t`` (tensors or arrays with leading dim B)."""
        for key in POLICY_FIELDS:
            if key in out:
                self._put(key, t, out[key])
        if D.VALUE in self._buf and D.FINAL_VALUE not in self._buf:
            self._buf[D.FINAL_VALUE] = np.zeros_like(self._buf[D.VALUE])   # (B, T) or (B, T, H)
        self.weight_version[:, t] = int(weight_version)

    def record_step(self, t: int, reward: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
                    success: np.ndarray, steps: np.ndarray | None = None, chunk: int | None = None) -> None:
        """The env's answer to decision ``t``'s chunk: reward ``[B]`` (chunk level) or ``[B, H]``
        (action level), done flags and success-so-far ``[B]``, and ``steps`` ``[B]``: how many of the
        chunk's ``chunk`` (H) actions ran (None: all; an episode that ends inside the chunk runs fewer).
        Invalid decisions get zero reward, no done flag and no executed action; ``success`` carries over
        from the last valid decision."""
        valid = self.valid[:, t]
        if chunk is not None:
            ran = np.full(self.B, chunk, np.int64) if steps is None else np.asarray(steps, np.int64)
            self._put(D.EXECUTED, t, (np.arange(chunk)[None, :] < ran[:, None]) & valid[:, None])   # (B, H)
        reward = to_numpy(reward).astype(np.float32, copy=True)
        reward[~valid] = 0.0
        self._put(D.REWARD, t, reward)
        self.terminated[:, t] = np.asarray(terminated, bool) & valid
        self.truncated[:, t] = np.asarray(truncated, bool) & valid
        previous = self.success[:, t - 1] if t > 0 else np.zeros(self.B, bool)
        self.success[:, t] = np.where(valid, np.asarray(success, bool), previous)
        self.steps_recorded = max(self.steps_recorded, t + 1)

    def record_final_value(self, t: int, rows: np.ndarray, value: np.ndarray) -> None:
        """``final_value`` of decision ``t`` for the bool ``rows`` ``[B]`` whose episode it truncated:
        the critic's value ``[B]`` or ``[B, H]`` of each episode's final observation (other rows ignored)."""
        value = to_numpy(value).astype(np.float32)
        buf = self._buf.get(D.FINAL_VALUE)
        if buf is None:
            buf = self._buf[D.FINAL_VALUE] = np.zeros((self.B, self.T, *value.shape[1:]), np.float32)
        buf[rows, t] = value[rows]

    def mark_rest_invalid(self, t: int) -> None:
        """Decisions ``t ..`` did not happen (every episode had ended): invalid, zero records, success
        carried over."""
        for buf in self._buf.values():
            buf[:, t:] = 0
        self.valid[:, t:] = False
        self.terminated[:, t:] = False
        self.truncated[:, t:] = False
        if t > 0:
            self.success[:, t:] = self.success[:, t - 1: t]
        if t > 0:
            self.weight_version[:, t:] = self.weight_version[:, t - 1: t]
        self.steps_recorded = self.T

    def field(self, key: str) -> np.ndarray | None:
        """The buffer of ``key`` ``[B, T, ...]`` (None before the first record of it)."""
        return self._buf.get(key)

    # --- output ----------------------------------------------------------------------------------
    def replace_rows(self, rows: np.ndarray, other: DecisionRecorder, other_rows: np.ndarray) -> None:
        """Overwrite ``rows`` with ``other``'s ``other_rows`` (re-collected episodes)."""
        for key, buf in other._buf.items():
            if key not in self._buf:
                raise ValueError(f"re-collected records have field '{key}' the original rollout lacks")
            self._buf[key][rows] = buf[other_rows]
        for name in ("valid", "terminated", "truncated", "success", "weight_version"):
            getattr(self, name)[rows] = getattr(other, name)[other_rows]

    def build(self, *, group_id: np.ndarray, init_state_id: np.ndarray,
              bootstrap_value: np.ndarray | None = None):
        """The records as a validated trajectory ``[B, T]``. ``group_id``/``init_state_id`` int64
        ``[B]``; ``bootstrap_value`` float32 ``[B]`` or ``[B, H]`` goes to ``extras``."""
        if self.steps_recorded != self.T:
            raise ValueError(f"only {self.steps_recorded} of {self.T} decisions were recorded")
        fields = {key: torch.from_numpy(buf) for key, buf in self._buf.items()}
        fields[D.TERMINATED] = torch.from_numpy(self.terminated)
        fields[D.TRUNCATED] = torch.from_numpy(self.truncated)
        fields[D.VALID] = torch.from_numpy(self.valid)
        fields[D.SUCCESS] = torch.from_numpy(self.success)
        fields[D.WEIGHT_VERSION] = torch.from_numpy(self.weight_version)
        fields[D.GROUP_ID] = torch.as_tensor(np.asarray(group_id, np.int64))
        fields[D.INIT_STATE_ID] = torch.as_tensor(np.asarray(init_state_id, np.int64))
        extras = None
        if bootstrap_value is not None:
            extras = {D.BOOTSTRAP_VALUE: torch.as_tensor(np.asarray(bootstrap_value, np.float32))}
        return D.make_trajectory(fields, extras)
