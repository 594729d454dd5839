"""Choosing action tokens from the restricted ``num_bins``-way distribution, and scoring them.

All functions take logits over the action ids only (``[..., num_bins]``, index ``k`` = token id
``first_id + k``), so no sample can ever be a non-action token.

Log-probs and entropies are those of the *tempered, untruncated* distribution
``softmax(logits / temperature)``: top-k / top-p only narrow what the sampler draws from. The actor
recomputes exactly these quantities (it knows the temperature, not the truncation), so behaviour
log-probs from :func:`sample` equal the actor's recomputation for the same weights (RLinf and verl
score rollouts the same way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embodirl.models.base import SamplingParams


def tempered_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(logits / temperature)`` in float32, ``[..., K]``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return F.log_softmax(logits.float() / temperature, dim=-1)


def truncate(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to ``-inf`` (``[..., K]``). The most
    likely token always survives."""
    K = logits.shape[-1]
    out = logits
    if top_k is not None and 0 < top_k < K:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]             # (..., 1)
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)   # (..., K)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs                         # mass of strictly better tokens
        drop_sorted = mass_before >= top_p                                 # keeps the first token always
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def log_prob_and_entropy(logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0,
                         with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``index`` (int64 ``[...]``) and entropy under the tempered distribution, float32 ``[...]``."""
    log_probs = tempered_log_probs(logits, temperature)                    # (..., K)
    logprob = log_probs.gather(-1, index.unsqueeze(-1)).squeeze(-1)        # (...)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return logprob, entropy


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one action index per position from ``[..., K]`` logits.

    Returns ``index`` int64 ``[...]`` and its log-prob float32 ``[...]``. ``params.greedy`` or temperature
    0: argmax, scored at temperature 1 (evaluation; the rest of ``params`` is ignored).
    """
    if params.deterministic:
        index = logits.argmax(dim=-1)
        return index, log_prob_and_entropy(logits, index, 1.0, with_entropy=False)[0]
    tempered = logits.float() / params.temperature
    probs = truncate(tempered, params.top_k, params.top_p).softmax(dim=-1)  # (..., K)
    flat = probs.reshape(-1, probs.shape[-1])
    index = torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
    return index, log_prob_and_entropy(logits, index, params.temperature, with_entropy=False)[0]
