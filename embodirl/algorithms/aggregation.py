"""Loss reductions selected by ``algorithm.loss_agg_func``, invariant to how the batch is split.

A loss is first computed per *unit* - a token, an action or a chunk for the policy loss (see
``algorithm.logprob_type``), a token for entropy and KL, a chunk or an action for the value loss - as
a tensor ``(N, T, K)`` with a boolean mask of the same shape (False for invalid decisions). A
*sequence* is one trajectory row ``n`` (the unit in which ``actor.micro_batch_size`` and
``actor.global_batch_size`` are counted).

==========================  ==========================================================================
``token-mean``              sum of all valid unit losses / number of valid units in the global batch
``seq-mean-token-sum``      mean over sequences of the sum of their unit losses
``seq-mean-token-mean``     mean over sequences of the mean of their unit losses
==========================  ==========================================================================

Why global denominators: the global batch (the rows of one optimizer step, over all data-parallel
ranks) is cut into micro-batches and rank shards, and their gradients are *summed* (gradient
accumulation; FSDP reduce-scatter with SUM). If each piece divided by its own count - e.g. the number
of valid tokens in that micro-batch - a token's weight would depend on how many valid tokens happened
to share its micro-batch, and the result would change with ``micro_batch_size`` and the number of
ranks. Every reduction above is instead written as ``sum over rows of row_term / D`` where ``row_term``
depends only on the row and ``D`` (valid units, or sequences with at least one valid unit) is counted
on the whole global batch *before* splitting (summed across ranks by the actor). A sum of row terms
splits exactly along N, so the micro-batched, sharded gradient equals the full-batch gradient up to
floating-point reassociation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TOKEN_MEAN = "token-mean"
SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"

#: name -> row-term function ``(loss (N, T, K), mask (N, T, K)) -> (N,)``
AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


def register_aggregation(name: str):
    def wrap(fn):
        AGGREGATIONS[name] = fn
        return fn

    return wrap


def _check(name: str) -> None:
    if name not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation '{name}'; available: {', '.join(sorted(AGGREGATIONS))}")


@register_aggregation(TOKEN_MEAN)
@register_aggregation(SEQ_MEAN_TOKEN_SUM)
def _row_sum(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of each row's valid unit losses; token-mean and seq-mean-token-sum differ only in D."""
    N = loss.shape[0]
    return (loss * mask).reshape(N, -1).sum(-1)  # (N,)


@register_aggregation(SEQ_MEAN_TOKEN_MEAN)
def _row_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of each row's valid unit losses (0 for a row without valid units)."""
    N = loss.shape[0]
    total = (loss * mask).reshape(N, -1).sum(-1)  # (N,)
    count = mask.reshape(N, -1).sum(-1)  # (N,)
    return total / count.clamp(min=1)


def local_denominator(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """This piece's share of the denominator ``D`` for ``agg``: valid units for token-mean, rows with
    at least one valid unit for the seq-mean variants. Sum it over every piece of the global batch
    (micro-batches and ranks) before calling :func:`aggregate`. float32 scalar."""
    _check(agg)
    N = mask.shape[0]
    if agg == TOKEN_MEAN:
        return mask.sum().to(torch.float32)
    return mask.reshape(N, -1).any(-1).sum().to(torch.float32)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, *, agg: str, denominator: torch.Tensor | float) -> torch.Tensor:
    """Reduce ``loss`` ``(N, T, K)`` over ``mask`` with the *global* ``denominator`` (see module
    docstring); a zero denominator (nothing valid anywhere) gives 0."""
    _check(agg)
    if loss.shape != mask.shape:
        raise ValueError(f"loss shape {tuple(loss.shape)} and mask shape {tuple(mask.shape)} differ")
    rows = AGGREGATIONS[agg](loss, mask)  # (N,)
    denominator = torch.as_tensor(denominator, dtype=rows.dtype, device=rows.device)
    return rows.sum() / denominator.clamp(min=1.0)


def masked_mean_contribution(x: torch.Tensor, mask: torch.Tensor, denominator: torch.Tensor | float) -> torch.Tensor:
    """``sum(x * mask) / denominator`` (detached): a metric's share of its global mean over valid
    units, so that summing the shares of every micro-batch and rank gives the global mean."""
    return aggregate(x.detach(), mask, agg=TOKEN_MEAN, denominator=denominator)
