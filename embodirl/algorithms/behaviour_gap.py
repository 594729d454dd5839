"""How far the learner's log-probs are from the behaviour policy's, over the tokens an update trains on.

The rollout's log-probs come from an inference copy (merged LoRA, compiled blocks, another dtype or kernel), the
learner's from the actor's forward. Their difference per token, ``|logp_learner - logp_behaviour|``, is what the
truncated importance weight corrects (``algorithm.behaviour_is_cap``) and what a run should watch. An update reports
its mean, its 99th percentile and its maximum over the executed tokens of valid decisions of its first optimizer step,
over all ranks.

The percentile comes from a histogram summed over the ranks (one all-reduce of a fixed-size vector, whatever the batch
and the number of ranks): :data:`EDGES` are log-spaced, so the reported p99 is the upper edge of the bin that holds it,
at most 12 % above the exact value; gaps under ``EDGES[0]`` count as 0.
"""

from __future__ import annotations

import torch

#: bin edges of the gap histogram: 1e-9 .. 1e2, 220 bins, a factor of 10**0.05 (1.122) per bin
EDGES_LOG10 = (-9.0, 2.0)
BINS = 220
#: order of the statistics vector: summed entries, then the max, then the histogram
SUM, COUNT, MAX = 0, 1, 2
QUANTILE = 0.99


def edges(device: torch.device) -> torch.Tensor:
    return torch.logspace(EDGES_LOG10[0], EDGES_LOG10[1], BINS + 1, device=device, dtype=torch.float32)


def token_mask(valid: torch.Tensor, L: int, *, action_dim: int, executed: torch.Tensor | None = None) -> torch.Tensor:
    """``(N, T, L)``: the executed tokens of valid decisions (``valid`` ``(N, T)``, ``executed`` ``(N, T, H)``)."""
    N, T = valid.shape
    mask = valid[:, :, None].expand(N, T, L)
    if executed is not None:
        mask = mask & executed.repeat_interleave(action_dim, dim=2)
    return mask


def statistics(logprob: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """This piece's statistics, float32 ``(3 + BINS + 1,)``: sum and count of the gaps, their max, and the counts of
    the histogram (bin 0: under ``EDGES[0]``; bin ``BINS``: over the last edge). Add pieces with :func:`merge`."""
    # masks, never boolean indexing: shapes stay independent of the data (the dry run runs this on the meta device)
    gap = torch.where(mask, (logprob.detach().float() - behaviour.float()).abs(), 0.0).flatten()
    counted = mask.flatten().float()
    bins = torch.bucketize(gap, edges(gap.device))
    hist = torch.zeros(BINS + 2, device=gap.device).scatter_add_(0, bins, counted)
    head = torch.stack([gap.sum(), counted.sum(), gap.amax() if gap.numel() else gap.new_zeros(())])
    return torch.cat([head, hist])


def merge(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """Two pieces' statistics in one (sums add, maxima take the larger)."""
    if a is None:
        return b
    out = a + b
    out[MAX] = torch.maximum(a[MAX], b[MAX])
    return out


def summary(stats: torch.Tensor) -> dict[str, float]:
    """``mean``, ``p99`` and ``max`` of the gaps the statistics (already reduced over ranks) describe."""
    stats = stats.detach().float().cpu()
    count = float(stats[COUNT])
    if count == 0:
        return {"mean": 0.0, "p99": 0.0, "max": 0.0}
    hist = stats[3:]
    reached = int(torch.searchsorted(hist.cumsum(0), torch.tensor(QUANTILE * count)).item())
    upper = edges(torch.device("cpu"))
    # bin 0 holds the gaps under the first edge (reported as 0), bin i the gaps in (EDGES[i-1], EDGES[i]]
    # and bin BINS + 1 the gaps over the last edge (reported as the max)
    p99 = 0.0 if reached == 0 else float(stats[MAX]) if reached > BINS else float(upper[reached])
    return {"mean": float(stats[SUM]) / count, "p99": min(p99, float(stats[MAX])), "max": float(stats[MAX])}
