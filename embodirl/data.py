"""The batch contract: one ``Trajectory`` structure crosses every worker boundary.

A trajectory batch is a :class:`tensordict.TensorDict` with batch dims ``[N, T]`` (N episodes or env
slots, T decisions). Per-episode fields (``task_id``, ``group_id``, ``init_state_id``) are stored
broadcast over T so that the whole batch splits and concatenates along N with tensordict's own
``split``/``torch.cat``, and pickles through Ray.

Shape letters: N envs, T decisions, H chunk length, A action dim, L action tokens per decision
(= H*A for OpenVLA-OFT; = H*A Gaussian dimensions for the state policy), V cameras, C channels,
h/w image size, S state dim, G group size, X chain values per decision (flow policies).

=====================  ==================  =======  ===============================================
field                  shape               dtype    meaning
=====================  ==================  =======  ===============================================
images                 [N,T,V,C,h,w]       uint8    observation at each decision (pixel policies)
state                  [N,T,S]             float32  proprio or full state (optional)
task_id                [N,T]               int64    index into the task/instruction table
action_tokens          [N,T,L]             int64    sampled tokens (token policies)
action_sample          [N,T,L]             float32  sampled pre-squash actions (Gaussian policies)
action_chain           [N,T,X]             float32  the denoising-chain states a flow policy's log-prob needs
action_chunk           [N,T,H,A]           float32  executed, un-normalised actions
executed               [N,T,H]             bool     the chunk's action ran (False after an episode ended
                                                    inside the chunk, and at invalid decisions)
logprob_behavior       [N,T,L]             float32  log-probs from the inference worker
value                  [N,T] or [N,T,H]    float32  chunk- or action-level value (PPO)
final_value            [N,T] or [N,T,H]    float32  value of the episode's final observation after a decision
                                                    that truncated it (time limit); 0 elsewhere (PPO)
reward                 [N,T] or [N,T,H]    float32  chunk reward (sum over H steps) or per step
terminated             [N,T]               bool     true episode end (success/failure)
truncated              [N,T]               bool     time limit reached
valid                  [N,T]               bool     the decision happened (False after the end)
success                [N,T]               bool     the task was solved at or before this decision
group_id               [N,T]               int64    GRPO grouping (constant over T)
init_state_id          [N,T]               int64    reset state (constant over T)
weight_version         [N,T]               int64    version of the weights that made the decision
bootstrap_value        [N] or [N,H]        float32  value of the state after the last decision
advantage              [N,T] or [N,T,H]    float32  filled by the advantage estimator
returns                [N,T] or [N,T,H]    float32  filled by the advantage estimator
logprob_ref            [N,T,L]             float32  reference-policy log-probs (KL)
=====================  ==================  =======  ===============================================

``bootstrap_value`` is a per-episode quantity (``[N]`` or ``[N, H]``); it rides in the sub-structure
``extras``, repeated over T so that the batch still splits along N, and is read back with
:func:`get_extra`. Configuration never rides in the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from embodirl.envs import base as _base

if TYPE_CHECKING:
    from tensordict import TensorDict


def __getattr__(name: str):
    # tensordict is imported on first use, not with this module: it imports torch._dynamo (without it `embodirl
    # train --cfg job` took 0.80x the time), and the schema reads this module's field names before anything runs.
    if name == "TensorDict":
        from tensordict import TensorDict

        return TensorDict
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

IMAGES = "images"
STATE = "state"
TASK_ID = "task_id"
ACTION_TOKENS = "action_tokens"
ACTION_SAMPLE = "action_sample"
ACTION_CHAIN = "action_chain"
ACTION_CHUNK = "action_chunk"
EXECUTED = "executed"
LOGPROB_BEHAVIOR = "logprob_behavior"
VALUE = "value"
FINAL_VALUE = "final_value"
REWARD = "reward"
TERMINATED = "terminated"
TRUNCATED = "truncated"
VALID = "valid"
SUCCESS = "success"
GROUP_ID = "group_id"
INIT_STATE_ID = "init_state_id"
WEIGHT_VERSION = "weight_version"

#: reward (and value) granularity, as the env contract names it (``algorithm.reward_type``, ``model.value_type``)
CHUNK_LEVEL, ACTION_LEVEL, REWARD_TYPES = _base.CHUNK_LEVEL, _base.ACTION_LEVEL, _base.REWARD_TYPES
ADVANTAGE = "advantage"
RETURNS = "returns"
LOGPROB_REF = "logprob_ref"
EXTRAS = "extras"
BOOTSTRAP_VALUE = "bootstrap_value"


@dataclass(frozen=True)
class FieldSpec:
    """Trailing shape (symbols after ``[N, T]``) and dtype of one field."""

    dims: tuple[str, ...]
    dtype: torch.dtype
    required: bool = False
    alt_dims: tuple[str, ...] | None = None  # value/reward/advantage may be per chunk or per action


FIELDS: dict[str, FieldSpec] = {
    IMAGES: FieldSpec(("V", "C", "h", "w"), torch.uint8),
    STATE: FieldSpec(("S",), torch.float32),
    TASK_ID: FieldSpec((), torch.int64, required=True),
    ACTION_TOKENS: FieldSpec(("L",), torch.int64),
    ACTION_SAMPLE: FieldSpec(("L",), torch.float32),
    ACTION_CHAIN: FieldSpec(("X",), torch.float32),
    ACTION_CHUNK: FieldSpec(("H", "A"), torch.float32, required=True),
    EXECUTED: FieldSpec(("H",), torch.bool),
    LOGPROB_BEHAVIOR: FieldSpec(("L",), torch.float32),
    VALUE: FieldSpec((), torch.float32, alt_dims=("H",)),
    FINAL_VALUE: FieldSpec((), torch.float32, alt_dims=("H",)),
    REWARD: FieldSpec((), torch.float32, required=True, alt_dims=("H",)),
    TERMINATED: FieldSpec((), torch.bool, required=True),
    TRUNCATED: FieldSpec((), torch.bool, required=True),
    VALID: FieldSpec((), torch.bool, required=True),
    SUCCESS: FieldSpec((), torch.bool),
    GROUP_ID: FieldSpec((), torch.int64),
    INIT_STATE_ID: FieldSpec((), torch.int64),
    WEIGHT_VERSION: FieldSpec((), torch.int64),
    ADVANTAGE: FieldSpec((), torch.float32, alt_dims=("H",)),
    RETURNS: FieldSpec((), torch.float32, alt_dims=("H",)),
    LOGPROB_REF: FieldSpec(("L",), torch.float32),
}


class TrajectoryError(ValueError):
    """A trajectory batch violates the contract; the message names the field."""


def validate(batch: TensorDict, *, require: tuple[str, ...] = ()) -> dict[str, int]:
    """Check every known field's dtype and shape against the table; return the bound symbols.

    Symbols (H, A, L, V, ...) must be consistent across fields: e.g. ``action_tokens``'s L must equal
    ``logprob_behavior``'s L. Unknown keys are rejected so that nothing rides along untyped.
    """
    from tensordict import TensorDict

    if not isinstance(batch, TensorDict):
        raise TrajectoryError(f"a trajectory must be a TensorDict, got {type(batch).__name__}")
    if batch.batch_dims != 2:
        raise TrajectoryError(f"a trajectory has batch dims [N, T], got batch_size {list(batch.batch_size)}")
    N, T = batch.batch_size
    symbols: dict[str, int] = {}
    for key in batch.keys():
        if key == EXTRAS:
            continue
        if key not in FIELDS:
            raise TrajectoryError(f"trajectory field '{key}' is not part of the contract (embodirl/data.py)")
    for key, spec in FIELDS.items():
        if key not in batch.keys():
            if spec.required or key in require:
                raise TrajectoryError(f"trajectory field '{key}' is missing")
            continue
        tensor = batch.get(key)
        if tensor.dtype != spec.dtype:
            raise TrajectoryError(f"trajectory field '{key}' has dtype {tensor.dtype}, expected {spec.dtype}")
        trailing = tuple(tensor.shape[2:])
        options = [spec.dims] + ([spec.alt_dims] if spec.alt_dims is not None else [])
        matched = None
        for dims in options:
            if len(dims) != len(trailing):
                continue
            bound = dict(symbols)
            ok = True
            for sym, size in zip(dims, trailing):
                if bound.setdefault(sym, size) != size:
                    ok = False
                    break
            if ok:
                matched = bound
                break
        if matched is None:
            want = " or ".join("[N,T" + "".join("," + d for d in dims) + "]" for dims in options)
            raise TrajectoryError(
                f"trajectory field '{key}' has shape {list(tensor.shape)}, expected {want} with {symbols or 'no'} "
                f"sizes bound so far (N={N}, T={T})"
            )
        symbols = matched
    if EXTRAS in batch.keys():
        extras = batch.get(EXTRAS)
        if BOOTSTRAP_VALUE in extras.keys():
            bv = extras.get(BOOTSTRAP_VALUE)
            if bv.dtype != torch.float32 or bv.dim() > 3:
                raise TrajectoryError(f"trajectory field 'extras.{BOOTSTRAP_VALUE}' must be float32 [N] or [N,H]")
    return symbols


def make_trajectory(fields: dict[str, torch.Tensor], extras: dict[str, torch.Tensor] | None = None) -> TensorDict:
    """Build and validate a trajectory from ``[N, T, ...]`` tensors (per-episode ``[N]`` fields are
    broadcast over T)."""
    reward = fields.get(REWARD)
    if reward is None:
        raise TrajectoryError("trajectory field 'reward' is missing")
    N, T = reward.shape[:2]
    data = {}
    for key, tensor in fields.items():
        if tensor.dim() == 1 and tensor.shape[0] == N and FIELDS.get(key, FieldSpec((), torch.int64)).dims == ():
            tensor = tensor[:, None].expand(N, T).contiguous()
        data[key] = tensor
    from tensordict import TensorDict

    td = TensorDict(data, batch_size=[N, T])
    if extras:
        td.set(EXTRAS, _extras_td(extras, N, T))
    validate(td)
    return td


def _extras_td(extras: dict[str, torch.Tensor], N: int, T: int) -> TensorDict:
    # Stored with batch dims [N, T] so that the whole batch splits along N; the value is repeated over
    # T and read back with :func:`get_extra` (first decision).
    from tensordict import TensorDict

    return TensorDict({k: v.unsqueeze(1).expand(N, T, *v.shape[1:]).contiguous() for k, v in extras.items()},
                      batch_size=[N, T])


def set_extra(batch: TensorDict, key: str, value: torch.Tensor) -> TensorDict:
    """A shallow copy of ``batch`` with the per-episode extra ``key`` = ``value`` ``[N, ...]``."""
    N, T = batch.batch_size
    out = batch.copy()
    if EXTRAS not in out.keys():
        out.set(EXTRAS, _extras_td({key: value}, N, T))
    else:
        out.set((EXTRAS, key), value.unsqueeze(1).expand(N, T, *value.shape[1:]).contiguous())
    return out


def get_extra(batch: TensorDict, key: str) -> torch.Tensor:
    """A per-episode extra (e.g. ``bootstrap_value``) as ``[N, ...]``."""
    return batch.get((EXTRAS, key))[:, 0]


def concat(batches: list[TensorDict]) -> TensorDict:
    """Concatenate trajectory batches along N (they must share T)."""
    from tensordict import TensorDict

    return TensorDict.cat(batches, dim=0)     # what torch.cat dispatches to (torch's stubs take tensors only)


def split(batch: TensorDict, sizes: int | list[int]) -> tuple[TensorDict, ...]:
    """Split a trajectory batch along N into chunks of ``sizes``."""
    return batch.split(sizes, dim=0)
