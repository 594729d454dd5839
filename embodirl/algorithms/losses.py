"""The PPO / GRPO objective of one micro-batch, as pure functions.

Units. Policy-space actions of one decision are L = H*A tokens (OpenVLA-OFT action tokens, or the
Gaussian dimensions of the state policy), ordered action-major (``l = h * A + a``). The importance
ratio is taken at ``algorithm.logprob_type``:

=========  =====  ==========================================================
token      K = L  one ratio per token
action     K = H  ``log_ratio`` summed over the A tokens of each action
chunk      K = 1  ``log_ratio`` summed over all L tokens of the decision
=========  =====  ==========================================================

Advantages ``(N, T)`` (chunk-level) are shared by all units of a decision; ``(N, T, H)``
(action-level) go to the units of their action (chunk-level ratios need chunk-level advantages).
Entropy and KL are per token; the value loss is per value (``(N, T)`` or ``(N, T, H)``).

The objective (CleanRL's naming, in the order of the paper)::

    log_ratio = logp - logp_old                  ratio = exp(log_ratio)
    pg_loss_unclipped = -A * ratio               pg_loss_clipped = -A * clip(ratio, 1 - eps_low, 1 + eps_high)
    pg_loss = max(pg_loss_unclipped, pg_loss_clipped)                      (Schulman et al. 2017; DAPO's clip-higher)
    pg_loss = min(pg_loss, -A * c)  where A < 0                            (dual clip, Ye et al. 2020)
    v_loss  = max(l(V - R), l(V_old + clip(V - V_old, -eps_v, eps_v) - R))  l = 0.5 x^2 or Huber
    loss = agg(pg_loss) - entropy_bonus * agg(entropy) + value_coef * agg(v_loss) + kl_coef * agg(kl)

``agg`` is :func:`embodirl.algorithms.aggregation.aggregate` with denominators counted on the whole
global batch (:func:`normalisers`), which is what makes micro-batching and data parallelism exact.
Inputs at invalid decisions may hold anything (even NaN): they are replaced before any arithmetic,
so they receive exactly zero gradient.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from embodirl import data as D
from embodirl.algorithms import aggregation, kl
from embodirl.algorithms.section import AlgorithmSection

if TYPE_CHECKING:  # the batch carrier of the data contract; only named in annotations here
    from tensordict import TensorDict

#: log-ratios are clamped to this magnitude before exp() so a wild token cannot overflow the loss
LOG_RATIO_CLAMP = 20.0
#: order of the entries of :func:`normalisers`' vector (summed across ranks in one all-reduce)
NORMALISER_KEYS = ("policy_agg", "token_agg", "value_agg", "policy_units", "token_units", "value_units")

# keys of the policy's score_actions() output that compute_loss reads (scattered to [n, T, ...])
LOGPROB = "logprob"
ENTROPY = "entropy"


# --- unit conversion ----------------------------------------------------------------------------------
def to_units(x: torch.Tensor, logprob_type: str, action_dim: int) -> torch.Tensor:
    """Sum per-token ``x`` ``(N, T, L)`` into ratio units ``(N, T, K)``."""
    N, T, L = x.shape
    if logprob_type == "token":
        return x
    if logprob_type == "action":
        return x.view(N, T, L // action_dim, action_dim).sum(-1)  # (N, T, H)
    if logprob_type == "chunk":
        return x.sum(-1, keepdim=True)  # (N, T, 1)
    raise ValueError(f"unknown logprob_type '{logprob_type}'")


def expand_to_units(x: torch.Tensor, logprob_type: str, L: int, action_dim: int) -> torch.Tensor:
    """Broadcast a per-decision ``(N, T)`` or per-action ``(N, T, H)`` tensor (advantage, mask,
    importance weight) to ratio units ``(N, T, K)``."""
    N, T = x.shape[:2]
    H = L // action_dim
    if x.dim() == 2:
        K = {"token": L, "action": H, "chunk": 1}[logprob_type]
        return x[:, :, None].expand(N, T, K)
    if x.shape[2] != H:
        raise ValueError(f"per-action tensor has {x.shape[2]} actions per decision, the policy has H={H}")
    if logprob_type == "token":
        return x.repeat_interleave(action_dim, dim=2)  # (N, T, L)
    if logprob_type == "action":
        return x
    raise ValueError("chunk-level ratios (logprob_type=chunk) need chunk-level advantages [N, T]")


# --- the two clipped losses ---------------------------------------------------------------------------
@dataclass
class PolicyLossTerms:
    """Per-unit quantities of the clipped policy loss, all ``(N, T, K)``."""

    pg_loss: torch.Tensor
    clipped: torch.Tensor          # bool: the ratio clip was active
    dual_clipped: torch.Tensor     # bool: the dual clip was active
    log_ratio: torch.Tensor
    ratio: torch.Tensor


def clipped_policy_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantage: torch.Tensor, mask: torch.Tensor,
                        *, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None = None,
                        is_weight: torch.Tensor | None = None) -> PolicyLossTerms:
    """PPO's clipped surrogate with asymmetric and dual clipping, per unit (module docstring).

    All inputs ``(N, T, K)``; ``is_weight`` (detached importance weight behaviour -> proximal policy,
    for replayed data) multiplies the loss. Masked units give 0 and zero gradient."""
    zero = torch.zeros_like(logprob)
    log_ratio = torch.where(mask, logprob - torch.where(mask, old_logprob, zero), zero)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (N, T, K)
    ratio = torch.exp(log_ratio)  # (N, T, K)
    advantage = torch.where(mask, advantage, zero)  # (N, T, K)
    pg_loss_unclipped = -advantage * ratio
    pg_loss_clipped = -advantage * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_loss = torch.maximum(pg_loss_unclipped, pg_loss_clipped)  # (N, T, K)
    clipped = (pg_loss_clipped > pg_loss_unclipped) & mask
    dual_clipped = torch.zeros_like(clipped)
    if clip_ratio_c is not None:
        pg_loss_dual = -advantage * clip_ratio_c
        dual_clipped = (advantage < 0) & (pg_loss > pg_loss_dual) & mask
        pg_loss = torch.where(advantage < 0, torch.minimum(pg_loss, pg_loss_dual), pg_loss)
    if is_weight is not None:
        pg_loss = pg_loss * torch.where(mask, is_weight, zero).detach()
    return PolicyLossTerms(pg_loss=pg_loss, clipped=clipped, dual_clipped=dual_clipped, log_ratio=log_ratio,
                           ratio=ratio)


def _value_error(error: torch.Tensor, huber_delta: float | None) -> torch.Tensor:
    if huber_delta is None:
        return 0.5 * error.square()
    return torch.nn.functional.huber_loss(error, torch.zeros_like(error), reduction="none", delta=huber_delta)


def clipped_value_loss(value: torch.Tensor, old_value: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
                       value_clip: float | None, huber_delta: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-value loss and a bool "clip active" tensor, both the shape of ``value``
    (``(N, T)`` or ``(N, T, H)``). ``value_clip=None`` is the plain (unclipped) loss."""
    zero = torch.zeros_like(value)
    value = torch.where(mask, value, zero)
    returns = torch.where(mask, returns.to(value.dtype), zero)
    v_loss_unclipped = _value_error(value - returns, huber_delta)
    if value_clip is None:
        return torch.where(mask, v_loss_unclipped, zero), torch.zeros_like(mask)
    old_value = torch.where(mask, old_value.to(value.dtype), zero)
    value_clipped = old_value + (value - old_value).clamp(-value_clip, value_clip)
    v_loss_clipped = _value_error(value_clipped - returns, huber_delta)
    v_loss = torch.maximum(v_loss_unclipped, v_loss_clipped)
    return torch.where(mask, v_loss, zero), (v_loss_clipped > v_loss_unclipped) & mask


# --- normalisers and the full objective ---------------------------------------------------------------
def loss_masks(valid: torch.Tensor, algorithm: AlgorithmSection, *, L: int, action_dim: int, value_dims: int = 2,
               executed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masks of the policy units ``(N, T, K)``, tokens ``(N, T, L)`` and values ``(N, T)`` or
    ``(N, T, H)`` (``value_dims`` = 2 or 3) from ``valid`` ``(N, T)``.

    ``executed`` ``(N, T, H)`` (None: every action of a valid decision ran): actions an episode's end
    inside the chunk left unexecuted are masked out - their tokens, their action units, their values;
    a chunk unit sums the log-ratios of the executed tokens only (see :func:`compute_loss`)."""
    N, T = valid.shape
    H = L // action_dim
    ran = valid[:, :, None].expand(N, T, H)  # (N, T, H)
    if executed is not None:
        ran = ran & executed
    token_mask = ran.repeat_interleave(action_dim, dim=2)  # (N, T, L), tokens action-major
    policy_mask = {"token": token_mask, "action": ran, "chunk": valid[:, :, None]}[algorithm.logprob_type]
    value_mask = valid if value_dims == 2 else ran
    return policy_mask, token_mask, value_mask


def normalisers(valid: torch.Tensor, algorithm: AlgorithmSection, *, L: int, action_dim: int,
                value_dims: int = 2, executed: torch.Tensor | None = None) -> torch.Tensor:
    """This piece's share of the global denominators, float32 ``(6,)`` in :data:`NORMALISER_KEYS`
    order: the aggregation denominators of the policy, token (entropy, KL) and value losses, then
    the valid unit counts that metrics average over. Sum over all pieces of the global batch."""
    masks = loss_masks(valid, algorithm, L=L, action_dim=action_dim, value_dims=value_dims, executed=executed)
    agg = [aggregation.local_denominator(m, algorithm.loss_agg_func) for m in masks]
    units = [m.sum().to(torch.float32) for m in masks]
    return torch.stack(agg + units)


def compute_loss(out: Mapping[str, torch.Tensor], batch: TensorDict, *, old_logprob: torch.Tensor,
                 algorithm: AlgorithmSection, norms: torch.Tensor, action_dim: int, kl_coef: float = 0.0,
                 is_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The objective of one micro-batch ``[n, T]`` and its metric contributions.

    ``out``: the policy's recomputed ``logprob`` ``(n, T, L)``, optional ``entropy`` ``(n, T, L)`` and
    ``value`` ``(n, T[, H])`` (zeros at invalid decisions are fine). ``batch``: the micro-batch's
    ``valid``, ``advantage`` and, as needed, ``value`` (old), ``returns``, ``logprob_ref``.
    ``old_logprob`` ``(n, T, L)``: behaviour (or proximal) log-probs. ``norms``: the *global*
    :func:`normalisers`. ``is_weight`` ``(n, T, K)``: optional importance weights per ratio unit
    (:func:`importance_weight`).

    Returns the scalar loss and detached metric contributions: each is this micro-batch's share of the
    global value, so summing them over micro-batches and ranks gives the full-batch metric."""
    agg = algorithm.loss_agg_func
    policy_agg, token_agg, value_agg, policy_units, token_units, value_units = norms.unbind(0)
    logprob = out[LOGPROB].float()  # (n, T, L)
    n, T, L = logprob.shape
    valid = batch.get(D.VALID)  # (n, T)
    executed = batch.get(D.EXECUTED) if D.EXECUTED in batch.keys() else None  # (n, T, H)
    value_dims = out[D.VALUE].dim() if D.VALUE in out else 2
    policy_mask, token_mask, value_mask = loss_masks(valid, algorithm, L=L, action_dim=action_dim, value_dims=value_dims,
                                                     executed=executed)

    # policy loss at the configured ratio level
    zero_tok = torch.zeros_like(logprob)
    old_logprob = torch.where(token_mask, old_logprob.float(), zero_tok)
    logprob = torch.where(token_mask, logprob, zero_tok)
    advantage = expand_to_units(batch.get(D.ADVANTAGE).float(), algorithm.logprob_type, L, action_dim)  # (n, T, K)
    terms = clipped_policy_loss(
        to_units(logprob, algorithm.logprob_type, action_dim), to_units(old_logprob, algorithm.logprob_type, action_dim),
        advantage, policy_mask, clip_ratio_low=algorithm.clip_ratio_low, clip_ratio_high=algorithm.clip_ratio_high,
        clip_ratio_c=algorithm.clip_ratio_c, is_weight=is_weight)
    pg_loss = aggregation.aggregate(terms.pg_loss, policy_mask, agg=agg, denominator=policy_agg)
    loss = pg_loss
    approx_kl = (terms.ratio - 1.0) - terms.log_ratio  # (n, T, K) k3 estimate of KL(old || new)
    metrics = {
        "actor/pg_loss": pg_loss.detach(),
        "actor/clip_fraction": aggregation.masked_mean_contribution(terms.clipped.float(), policy_mask, policy_units),
        "actor/dual_clip_fraction": aggregation.masked_mean_contribution(
            terms.dual_clipped.float(), policy_mask, policy_units),
        "actor/approx_kl": aggregation.masked_mean_contribution(approx_kl, policy_mask, policy_units),
        "actor/ratio": aggregation.masked_mean_contribution(terms.ratio, policy_mask, policy_units),
    }

    if ENTROPY in out:
        entropy = torch.where(token_mask, out[ENTROPY].float(), zero_tok)  # (n, T, L)
        metrics["actor/entropy"] = aggregation.masked_mean_contribution(entropy, token_mask, token_units)
        if algorithm.entropy_bonus:
            loss = loss - algorithm.entropy_bonus * aggregation.aggregate(entropy, token_mask, agg=agg,
                                                                       denominator=token_agg)

    if algorithm.uses_critic:
        if D.VALUE not in out:
            raise ValueError("the critic's value loss needs the policy's value output")
        v_loss_units, v_clipped = clipped_value_loss(
            out[D.VALUE].float(), batch.get(D.VALUE), batch.get(D.RETURNS), value_mask,
            value_clip=algorithm.value_clip, huber_delta=algorithm.huber_delta)
        v_loss = aggregation.aggregate(v_loss_units, value_mask, agg=agg, denominator=value_agg)
        loss = loss + algorithm.value_coef * v_loss
        metrics["critic/value_loss"] = v_loss.detach()
        metrics["critic/value_clip_fraction"] = aggregation.masked_mean_contribution(
            v_clipped.float(), value_mask, value_units)

    if algorithm.use_kl_loss and kl_coef:
        ref = torch.where(token_mask, batch.get(D.LOGPROB_REF).float(), zero_tok)
        kl_tokens = torch.where(token_mask, kl.kl_divergence(logprob, ref, algorithm.kl_penalty), zero_tok)  # (n, T, L)
        kl_loss = aggregation.aggregate(kl_tokens, token_mask, agg=agg, denominator=token_agg)
        loss = loss + kl_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach()
        metrics["actor/kl"] = aggregation.masked_mean_contribution(kl_tokens, token_mask, token_units)

    metrics["actor/loss"] = loss.detach()
    return loss, metrics


def max_ratio_error(logprob: torch.Tensor, old_logprob: torch.Tensor, valid: torch.Tensor, *, action_dim: int,
                    executed: torch.Tensor | None = None) -> torch.Tensor:
    """``max |exp(logprob - old_logprob) - 1|`` over the executed tokens of valid decisions (0-dim float32, detached):
    how far the importance ratio is from 1 where the rows are on-policy. Inputs ``(n, T, L)`` and ``(n, T)``."""
    N, T, L = logprob.shape
    token_mask = valid[:, :, None].expand(N, T, L)
    if executed is not None:
        token_mask = token_mask & executed.repeat_interleave(action_dim, dim=2)
    error = (logprob.detach().float() - old_logprob.float()).exp() - 1.0
    return torch.where(token_mask, error.abs(), torch.zeros_like(error)).amax() if error.numel() else error.new_zeros(())


def importance_weight(prox_logprob: torch.Tensor, behaviour_logprob: torch.Tensor, valid: torch.Tensor, *,
                      logprob_type: str, action_dim: int, max_weight: float,
                      executed: torch.Tensor | None = None) -> torch.Tensor:
    """Truncated importance weight ``min(pi_prox / pi_behaviour, max_weight)`` per ratio unit
    ``(N, T, K)`` from token log-probs ``(N, T, L)`` (1 at invalid decisions; unexecuted tokens count as equal), for
    replayed data and for the gap between the rollout's copy and the learner (decoupled PPO)."""
    N, T, L = prox_logprob.shape
    token_mask = valid[:, :, None].expand(N, T, L)
    if executed is not None:
        token_mask = token_mask & executed.repeat_interleave(action_dim, dim=2)
    log_w = torch.where(token_mask, prox_logprob.float() - behaviour_logprob.float(),
                        torch.zeros_like(prox_logprob, dtype=torch.float32))
    log_w = to_units(log_w, logprob_type, action_dim)  # (N, T, K)
    return torch.exp(log_w.clamp(max=math.log(max_weight))).detach()


def explained_variance_sums(value: torch.Tensor, returns: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Sufficient statistics ``(5,)`` of the explained variance over valid values: count, sum and sum
    of squares of ``returns`` and of ``returns - value``. Add them across pieces, then call
    :func:`explained_variance`."""
    mask = valid if value.dim() == 2 else valid[:, :, None].expand_as(value)
    r = torch.where(mask, returns.float(), torch.zeros_like(returns, dtype=torch.float32))
    e = torch.where(mask, returns.float() - value.float(), torch.zeros_like(r))
    return torch.stack([mask.sum().float(), r.sum(), r.square().sum(), e.sum(), e.square().sum()])


def explained_variance(sums: torch.Tensor) -> torch.Tensor:
    """``1 - Var(returns - value) / Var(returns)`` from :func:`explained_variance_sums` (NaN when the
    returns have no variance)."""
    count, r_sum, r_sq, e_sum, e_sq = sums.unbind(0)
    count = count.clamp(min=1)
    var_r = r_sq / count - (r_sum / count) ** 2
    var_e = e_sq / count - (e_sum / count) ** 2
    return torch.where(var_r > 0, 1.0 - var_e / var_r, torch.full_like(var_r, float("nan")))
