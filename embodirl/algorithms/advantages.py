"""Advantage estimators selected by ``algorithm.adv_type``.

Every estimator is a pure function ``fn(inputs: AdvantageInputs, algorithm: AlgorithmSection) ->
(advantage, returns)`` registered under its config name. Inputs are per-decision tensors of one
trajectory batch ``[N, T]`` (one row = one env slot):

=================  ==================  =======================================================
reward             (N, T) or (N, T, H)  chunk-level (summed over the chunk) or per action
value              (N, T) or (N, T, H)  critic values at each decision (``gae`` only)
valid              (N, T) bool          the decision happened
terminated         (N, T) bool          true episode end after this decision (no bootstrap)
truncated          (N, T) bool          time limit after this decision (bootstrap)
bootstrap_value    (N,) or (N, H)       value of the state after the row's last valid decision
final_value        (N, T) or (N, T, H)  value of a truncated episode's final observation (at its last decision)
executed           (N, T, H) bool       the chunk's action ran (action level; None: all of a valid decision's)
reward_baseline    (N,)                 greedy-rollout return from the same init state (``remax``)
=================  ==================  =======================================================

Time axis. ``reward_type: chunk_level`` uses one step per decision: gamma and lambda apply once per
decision (an action chunk), not once per low-level step. ``action_level`` (rewards and values
``(N, T, H)``) unrolls the chunk into T*H steps, each discounted once; the decision's
``terminated``/``truncated`` flags take effect after its last *executed* action (``executed``: an
episode that ends inside a chunk leaves the rest unexecuted; those steps are invalid, so their values
are never a successor value). Action-level rewards with a chunk-level critic are summed over the chunk
first.

Episode ends (``gae``, ``reinforce_plus_plus``). After a decision with ``terminated`` the successor
value is 0 and the recursion restarts. After ``truncated`` (the time limit) it is ``final_value``, the
value of that episode's own final observation, when the batch has one (the collector records it for
policies with a value head; with auto-reset the next decision belongs to the next episode). Otherwise
the successor value is bootstrapped: for the row's last valid decision it is
``extras.bootstrap_value`` when the batch has one (else 0 at the end of the row); elsewhere it is the
next decision's recorded value. The recursion also restarts after ``truncated`` and wherever the next
decision is invalid.

Outcome estimators (``grpo``, ``rloo``, ``remax``) score each row by its total valid reward (one
episode per row) and give every valid decision of the row the same advantage ``(N, T)``. Groups are
consecutive blocks of ``group_size`` rows that share ``group_id`` (and ``init_state_id``).

:func:`compute_advantages` applies the estimator to a whole batch and optionally whitens the result
over valid entries (``normalize_advantages``). Both need the *whole* rollout batch (group and batch
statistics), so they run before the batch is cut into actor shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from embodirl import data as D
from embodirl.algorithms.estimators import estimator_spec, register_advantage
from embodirl.algorithms.section import AlgorithmSection

if TYPE_CHECKING:  # the batch carrier of the data contract; only named in annotations here
    from tensordict import TensorDict

#: extras key of the ReMax baseline: the return of a greedy rollout from the same init state, ``[N]``
REWARD_BASELINE = "reward_baseline"
#: added to standard deviations before dividing (GRPO, whitening)
STD_EPS = 1e-6

CHUNK_LEVEL, ACTION_LEVEL, REWARD_TYPES = D.CHUNK_LEVEL, D.ACTION_LEVEL, D.REWARD_TYPES


@dataclass
class AdvantageInputs:
    """Per-decision tensors an estimator reads (see module docstring for shapes)."""

    reward: torch.Tensor
    valid: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    value: torch.Tensor | None = None
    bootstrap_value: torch.Tensor | None = None
    group_id: torch.Tensor | None = None
    reward_baseline: torch.Tensor | None = None
    final_value: torch.Tensor | None = None
    executed: torch.Tensor | None = None


# --- helpers ------------------------------------------------------------------------------------------
def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the entries where ``mask`` (broadcast to ``x``) is True, with
    the unbiased std; masked-out entries become 0."""
    mask = mask.expand_as(x)
    count = mask.sum()
    if count < 2:
        return torch.zeros_like(x)
    mean = (x * mask).sum() / count
    var = (((x - mean) * mask) ** 2).sum() / (count - 1)
    return torch.where(mask, (x - mean) / (var.sqrt() + STD_EPS), torch.zeros_like(x))


class _Steps(NamedTuple):
    """Per-row tensors on the estimator's time axis ``(N, S)``, S = T (per decision) or T*H."""

    reward: torch.Tensor
    value: torch.Tensor | None
    valid: torch.Tensor
    terminated: torch.Tensor
    cut: torch.Tensor           # the recursion restarts after this step
    row_final: torch.Tensor     # the row's last valid step
    bootstrap: torch.Tensor | None  # (N,)
    truncated: torch.Tensor     # the time limit ended the episode after this step
    final_value: torch.Tensor | None  # (N, S): V(final observation) at truncated steps


def _steps(inp: AdvantageInputs, per_action: bool) -> _Steps:
    """Flatten the inputs to the estimator's time axis (see module docstring)."""
    N, T = inp.valid.shape
    reward, value, bootstrap, final_value = inp.reward, inp.value, inp.bootstrap_value, inp.final_value
    if final_value is not None and final_value.dim() == 3:
        final_value = final_value[:, :, 0]  # (N, T): the next state's value is that of its first action
    if per_action:
        H = reward.shape[2]
        ran = inp.valid[:, :, None].expand(N, T, H)  # (N, T, H)
        if inp.executed is not None:
            ran = ran & inp.executed
        # the episode's end takes effect after the chunk's last executed action
        at_last_ran = ran & ~torch.cat([ran[:, :, 1:], torch.zeros_like(ran[:, :, :1])], dim=2)  # (N, T, H)
        valid = ran.reshape(N, T * H)  # (N, T*H)
        terminated = (inp.terminated[:, :, None] & at_last_ran).reshape(N, T * H)  # (N, T*H)
        truncated = (inp.truncated[:, :, None] & at_last_ran).reshape(N, T * H)  # (N, T*H)
        reward = reward.reshape(N, T * H)
        value = value.reshape(N, T * H) if value is not None else None
        if final_value is not None:
            final_value = final_value[:, :, None].expand(N, T, H).reshape(N, T * H)  # (N, T*H)
        if bootstrap is not None and bootstrap.dim() == 2:
            bootstrap = bootstrap[:, 0]  # the next state's value is that of its first action
    else:
        if reward.dim() == 3:
            reward = reward.sum(-1)  # (N, T)
        valid, terminated, truncated = inp.valid, inp.terminated, inp.truncated
        if bootstrap is not None and bootstrap.dim() == 2:
            raise ValueError("an action-level bootstrap_value [N, H] needs action-level values")
    next_valid = torch.zeros_like(valid)
    next_valid[:, :-1] = valid[:, 1:]
    # the row's final valid step: valid, and no valid step after it
    later_valid = torch.flip(torch.cumsum(torch.flip(valid.long(), [1]), 1), [1]) - valid.long()  # (N, S)
    return _Steps(reward=reward, value=value, valid=valid, terminated=terminated,
                  cut=terminated | truncated | ~next_valid, row_final=valid & (later_valid == 0), bootstrap=bootstrap,
                  truncated=truncated, final_value=final_value)


def _successor_value(value, steps: _Steps) -> torch.Tensor:
    """V(s_{t+1}) as the module docstring defines it; ``(N, S)``."""
    next_value = torch.zeros_like(value)
    next_value[:, :-1] = value[:, 1:]
    if steps.bootstrap is not None:
        next_value = torch.where(steps.row_final, steps.bootstrap[:, None].to(value.dtype), next_value)
    # without bootstrap_value the successor of the row's last step stays 0
    if steps.final_value is not None:
        next_value = torch.where(steps.truncated, steps.final_value.to(value.dtype), next_value)
    return torch.where(steps.terminated, torch.zeros_like(next_value), next_value)


def _group_scores(inp: AdvantageInputs, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Total valid reward per row ``(N,)`` and the same viewed as groups ``(N // G, G)``."""
    N, T = inp.valid.shape
    reward = inp.reward if inp.reward.dim() == 2 else inp.reward.sum(-1)  # (N, T)
    scores = (reward * inp.valid).sum(-1)  # (N,)
    if group_size < 2:
        raise ValueError(f"group-relative advantages need group_size >= 2, got {group_size}")
    if N % group_size:
        raise ValueError(f"the batch has {N} trajectories, not a multiple of group_size={group_size}")
    if inp.group_id is not None:
        gid = inp.group_id.view(N // group_size, group_size)
        if (gid != gid[:, :1]).any():
            raise ValueError("rows of one group (consecutive blocks of group_size) have different group_id")
    return scores, scores.view(N // group_size, group_size)


def broadcast_rows(per_row: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return per_row[:, None] * valid  # (N, T)


# --- estimators ---------------------------------------------------------------------------------------
@register_advantage("gae", critic=True)
def gae(inp: AdvantageInputs, algorithm: AlgorithmSection) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over decisions or actions.

    Action level when ``value`` is ``(N, T, H)`` (rewards must then be ``(N, T, H)`` too); advantage
    and returns have the value's shape; both are 0 at invalid decisions."""
    if inp.value is None:
        raise ValueError("gae needs the critic's values (trajectory field 'value')")
    per_action = inp.value.dim() == 3
    if per_action and inp.reward.dim() != 3:
        raise ValueError("action-level values [N, T, H] need action-level rewards [N, T, H]")
    steps = _steps(inp, per_action)
    assert steps.value is not None  # inp.value was checked above
    value = steps.value.float()  # (N, S)
    N, S = value.shape
    next_value = _successor_value(value, steps)  # (N, S)
    delta = steps.reward + algorithm.gamma * next_value - value  # (N, S)
    keep = (~steps.cut).to(value.dtype) * (algorithm.gamma * algorithm.gae_lambda)  # (N, S)
    advantage = torch.zeros_like(value)
    running = torch.zeros_like(value[:, 0])  # (N,)
    for t in reversed(range(S)):
        running = delta[:, t] + keep[:, t] * running
        advantage[:, t] = running
    advantage = torch.where(steps.valid, advantage, torch.zeros_like(advantage))
    returns = torch.where(steps.valid, advantage + value, torch.zeros_like(advantage))
    shape = inp.value.shape
    return advantage.reshape(shape), returns.reshape(shape)


@register_advantage("grpo", groups=True)
def grpo(inp: AdvantageInputs, algorithm: AlgorithmSection) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage (Shao et al. 2024): ``(R - mean_g) / (std_g + eps)`` with the group's
    unbiased std, or ``R - mean_g`` when ``norm_adv_by_std_in_grpo`` is off (Dr. GRPO)."""
    scores, grouped = _group_scores(inp, algorithm.group_size)
    centred = grouped - grouped.mean(-1, keepdim=True)  # (N/G, G)
    if algorithm.norm_adv_by_std_in_grpo:
        centred = centred / (grouped.std(-1, keepdim=True) + STD_EPS)
    advantage = broadcast_rows(centred.reshape(-1), inp.valid)  # (N, T)
    return advantage, broadcast_rows(scores, inp.valid)


@register_advantage("rloo", groups=True)
def rloo(inp: AdvantageInputs, algorithm: AlgorithmSection) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): ``R_i - mean_{j != i} R_j`` within the group."""
    scores, grouped = _group_scores(inp, algorithm.group_size)
    G = algorithm.group_size
    others_mean = (grouped.sum(-1, keepdim=True) - grouped) / (G - 1)  # (N/G, G)
    advantage = broadcast_rows((grouped - others_mean).reshape(-1), inp.valid)  # (N, T)
    return advantage, broadcast_rows(scores, inp.valid)


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(inp: AdvantageInputs, algorithm: AlgorithmSection) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go per step (restarting at episode ends, no
    critic, no bootstrap), whitened over all valid steps of the batch."""
    per_action = inp.reward.dim() == 3
    steps = _steps(inp, per_action)
    reward = steps.reward.float()  # (N, S)
    N, S = reward.shape
    keep = (~steps.cut).to(reward.dtype) * algorithm.gamma  # (N, S)
    returns = torch.zeros_like(reward)
    running = torch.zeros_like(reward[:, 0])  # (N,)
    for t in reversed(range(S)):
        running = reward[:, t] + keep[:, t] * running
        returns[:, t] = running
    returns = torch.where(steps.valid, returns, torch.zeros_like(returns))
    advantage = masked_whiten(returns, steps.valid)
    shape = inp.reward.shape
    return advantage.reshape(shape), returns.reshape(shape)


@register_advantage("remax", greedy_baseline=True)
def remax(inp: AdvantageInputs, algorithm: AlgorithmSection) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2024): ``R - b`` with ``b`` the return of a greedy rollout from the same init
    state (``extras.reward_baseline``)."""
    if inp.reward_baseline is None:
        raise ValueError(f"remax needs the greedy baseline return per trajectory (extras '{REWARD_BASELINE}')")
    reward = inp.reward if inp.reward.dim() == 2 else inp.reward.sum(-1)  # (N, T)
    scores = (reward * inp.valid).sum(-1)  # (N,)
    advantage = broadcast_rows(scores - inp.reward_baseline.to(scores.dtype), inp.valid)  # (N, T)
    return advantage, broadcast_rows(scores, inp.valid)


# --- batch entry point --------------------------------------------------------------------------------
def inputs_from_batch(batch: TensorDict, reward_type: str) -> AdvantageInputs:
    """Read :class:`AdvantageInputs` from a trajectory batch, checking ``reward`` against
    ``reward_type`` (chunk-level from an action-level field sums over the chunk)."""
    if reward_type not in REWARD_TYPES:
        raise ValueError(f"unknown reward_type '{reward_type}'; available: {', '.join(REWARD_TYPES)}")
    reward = batch.get(D.REWARD).float()
    if reward_type == ACTION_LEVEL and reward.dim() != 3:
        raise ValueError("reward_type=action_level needs per-action rewards [N, T, H]; the batch has [N, T]")
    if reward_type == CHUNK_LEVEL and reward.dim() == 3:
        reward = reward.sum(-1)  # (N, T)
    extras = batch.get(D.EXTRAS) if D.EXTRAS in batch.keys() else None

    def extra(key):
        return D.get_extra(batch, key) if extras is not None and key in extras.keys() else None

    return AdvantageInputs(
        reward=reward, valid=batch.get(D.VALID), terminated=batch.get(D.TERMINATED),
        truncated=batch.get(D.TRUNCATED), value=batch.get(D.VALUE).float() if D.VALUE in batch.keys() else None,
        bootstrap_value=extra(D.BOOTSTRAP_VALUE),
        group_id=batch.get(D.GROUP_ID)[:, 0] if D.GROUP_ID in batch.keys() else None,
        reward_baseline=extra(REWARD_BASELINE),
        final_value=batch.get(D.FINAL_VALUE).float() if D.FINAL_VALUE in batch.keys() else None,
        executed=batch.get(D.EXECUTED) if D.EXECUTED in batch.keys() else None,
    )


def compute_advantages(batch: TensorDict, algorithm: AlgorithmSection) -> TensorDict:
    """Fill ``advantage`` and ``returns`` of a whole rollout batch (a shallow copy is returned).

    Reads ``algorithm.{adv_type, reward_type, gamma, gae_lambda, group_size, norm_adv_by_std_in_grpo,
    normalize_advantages}``."""
    inp = inputs_from_batch(batch, algorithm.reward_type)
    advantage, returns = estimator_spec(algorithm.adv_type).fn(inp, algorithm)
    if algorithm.normalize_advantages:
        valid = inp.valid if advantage.dim() == 2 else inp.valid[:, :, None]
        if advantage.dim() == 3 and inp.executed is not None:
            valid = valid & inp.executed  # (N, T, H): unexecuted actions stay out of the statistics
        advantage = masked_whiten(advantage, valid)
    out = batch.copy()
    out.set(D.ADVANTAGE, advantage.float().contiguous())
    out.set(D.RETURNS, returns.float().contiguous())
    return out
