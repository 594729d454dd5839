"""KL divergence to the reference policy (the base model with its LoRA adapter disabled).

Per-token estimators of ``KL(pi || pi_ref)`` from log-probs of tokens sampled from ``pi``
(Schulman, "Approximating KL divergence", 2020), selected by ``algorithm.kl_penalty``:

==============  ===============================================  ======================================
``kl``          ``log_ratio = logp - logp_ref``                   k1: unbiased, high variance, can be < 0
``abs``         ``|log_ratio|``
``mse``         ``0.5 * log_ratio ** 2``                          k2
``low_var_kl``  ``exp(-r) + r - 1`` (``r`` = log_ratio clamped    k3: unbiased, non-negative
                to +-20, the result to +-10)
==============  ===============================================  ======================================

The KL enters either as a loss term (``use_kl_loss: true``, reduced like the policy loss) or as a
reward penalty (``use_kl_loss: false``: :func:`apply_kl_reward_penalty` subtracts ``coef * KL`` of the
behaviour policy from each decision's (or action's) reward before advantages are computed). The
coefficient is fixed or follows the adaptive controller of Ziegler et al. (2019), :class:`KLController`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

#: k3 is clamped to this range for numerical safety when a token's log-ratio is extreme
LOW_VAR_KL_CLAMP = 10.0
#: k3's log-ratio is clamped to this magnitude before exp(): exp(100) overflows float32, and the clamp of
#: the result then gives 0 * inf = NaN gradients (verl's kl_penalty clamps at the same +-20)
LOW_VAR_KL_LOG_RATIO_CLAMP = 20.0
#: the adaptive controller changes the coefficient by at most this relative error per update
ADAPTIVE_ERROR_CLIP = 0.2

KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
#: ``algorithm.kl_ctrl.type``: a fixed coefficient or the adaptive controller (:class:`KLController`)
KL_CONTROLLERS = ("fixed", "adaptive")


def register_kl(name: str):
    def wrap(fn):
        KL_ESTIMATORS[name] = fn
        return fn

    return wrap


@register_kl("kl")
def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


@register_kl("abs")
def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


@register_kl("mse")
def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


@register_kl("low_var_kl")
def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    log_ratio = log_ratio.clamp(-LOW_VAR_KL_LOG_RATIO_CLAMP, LOW_VAR_KL_LOG_RATIO_CLAMP)
    kl = torch.exp(-log_ratio) + log_ratio - 1.0
    return kl.clamp(min=-LOW_VAR_KL_CLAMP, max=LOW_VAR_KL_CLAMP)


def kl_divergence(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs (e.g. ``(N, T, L)``)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_penalty '{kind}'; available: {', '.join(sorted(KL_ESTIMATORS))}")
    log_ratio = logprob.float() - ref_logprob.float()  # (..., L)
    return KL_ESTIMATORS[kind](log_ratio)


def apply_kl_reward_penalty(reward: torch.Tensor, logprob: torch.Tensor, ref_logprob: torch.Tensor,
                            valid: torch.Tensor, *, coef: float, kind: str, executed: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Subtract ``coef * KL`` from the reward; return the new reward and the mean per-token KL over
    valid decisions (the controller's measurement; float32 scalar).

    ``reward`` ``(N, T)`` takes each decision's KL summed over its L tokens; ``(N, T, H)`` takes each
    action's KL summed over its A = L / H tokens (tokens ordered action-major, ``l = h * A + a``).
    ``executed`` ``(N, T, H)``: tokens of actions that never ran (the episode ended inside the chunk)
    carry no penalty."""
    N, T, L = logprob.shape
    tokens = valid[:, :, None].expand(N, T, L)  # (N, T, L)
    if executed is not None:
        tokens = tokens & executed.repeat_interleave(L // executed.shape[2], dim=2)
    kl = kl_divergence(logprob, ref_logprob, kind) * tokens  # (N, T, L)
    if reward.dim() == 2:
        penalty = kl.sum(-1)  # (N, T)
    else:
        H = reward.shape[2]
        penalty = kl.view(N, T, H, L // H).sum(-1)  # (N, T, H)
    mean_kl = kl.sum() / tokens.sum().clamp(min=1)
    return reward - coef * penalty, mean_kl


class KLController:
    """The KL coefficient: fixed, or adaptive towards ``target_kl`` (per token) over ``horizon``
    trajectories (Ziegler et al. 2019): ``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon``."""

    def __init__(self, initial: float, *, kind: str = "fixed", target_kl: float | None = None,
                 horizon: float | None = None):
        if kind not in KL_CONTROLLERS:
            raise ValueError(f"unknown kl_ctrl.type '{kind}'; available: {', '.join(KL_CONTROLLERS)}")
        if kind == "adaptive" and (not target_kl or not horizon):
            raise ValueError("an adaptive KL coefficient needs a positive target_kl and horizon")
        self.value = float(initial)
        self.kind, self.target_kl, self.horizon = kind, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adapt after a rollout whose measured per-token KL is ``current_kl`` over ``n_steps``
        trajectories; returns the new value."""
        if self.kind == "adaptive":
            assert self.target_kl is not None and self.horizon is not None  # __init__ checks them for adaptive
            error = min(max(float(current_kl) / self.target_kl - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
            self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping) -> None:
        self.value = float(state["value"])
