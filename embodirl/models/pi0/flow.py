"""The denoising chain of a flow-matching policy as an MDP with Gaussian transitions (πRL, arXiv 2510.25889).

A flow policy turns noise ``x_K ~ N(0, I)`` at time ``t = 1`` into an action chunk ``x_0`` at ``t = 0`` in ``K``
Euler steps of its velocity field ``v``: ``x_{k+1} = x_k + dt * v(x_k, t_k)`` with ``dt = -1/K`` and ``t_k = 1 + k dt``
(transformers' ``PI0ForConditionalGeneration.sample_actions``; indices here count denoising steps, so ``x_0`` of the
chain is the noise and ``x_K`` the action). The chain has no likelihood. Two ways to give it one:

* **Flow-SDE**: the ODE replaced by an SDE with the same marginals, discretised. A step from time ``t`` by ``delta``
  is Gaussian with mean ``x0 (1 - t + delta) + x1 (t - delta - sigma^2 delta / (2 t))`` (``x0 = x - v t`` and
  ``x1 = x + v (1 - t)`` are the model's predictions of the clean action and of the noise) and standard deviation
  ``sqrt(delta) sigma``, where ``sigma = a sqrt(t / (1 - t))`` for a noise level ``a`` (at ``t = 1`` the ratio
  uses the next grid time's ``1 - t``, where the formula is infinite). With ``sigma = 0`` the mean is the Euler step.
  RL trains one step per decision, drawn at random, with the others deterministic (πRL's mixed ODE-SDE rollout).
* **Flow-Noise**: the Euler step's mean with a standard deviation a small network predicts from the action expert's
  features, every step stochastic. The network's output goes through tanh and maps linearly onto the log-variance
  between ``log(min^2)`` and ``log(max^2)`` (:func:`log_variance_std`). The decision's log-probability is, with
  ``joint_logprob`` (RLinf's Flow-Noise setting), the mean over ``K + 1`` terms: the prior's ``log N(x_0; 0, I)`` and
  the ``K`` steps; without it the mean over the ``K`` steps. The prior's term does not depend on the weights, so a
  joint log-ratio is ``K / (K + 1)`` of the other: RLinf's clip and KL readings assume the joint one.

These are the formulas of RLinf's ``rlinf/models/embodiment/openpi/openpi_action_model.py``
(``sample_mean_var_val``, ``get_logprob_norm``, ``sample_actions``' ``joint_logprob`` branch) and
``rlinf/models/embodiment/modules/explore_noise_net.py`` (``ExploreNoiseNet.post_process``), RLinf/RLinf @ 558aeb38,
written from the paper's equations.
"""

from __future__ import annotations

import math

import torch

FLOW_SDE, FLOW_NOISE = "flow_sde", "flow_noise"
METHODS = (FLOW_SDE, FLOW_NOISE)
_LOG_2PI = math.log(2.0 * math.pi)


def step_time(step: int, num_steps: int) -> float:
    """``t_k = 1 + k dt`` with ``dt = -1/K``, computed as transformers' ``sample_actions`` computes it."""
    return 1.0 + step * (-1.0 / num_steps)


def sde_sigma(times: torch.Tensor, num_steps: int, noise_level: float) -> torch.Tensor:
    """``sigma`` of the Flow-SDE at the grid times ``times`` (any shape; each one of ``t_0 .. t_{K-1}``)."""
    first_gap = 1.0 - step_time(1, num_steps) if num_steps > 1 else 1.0
    gap = torch.where(times >= 1.0, torch.full_like(times, first_gap), 1.0 - times)
    return noise_level * torch.sqrt(times / gap)


def sde_transition(x: torch.Tensor, velocity: torch.Tensor, times: torch.Tensor, delta: float,
                   sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of one Flow-SDE step from ``x`` at ``times`` (broadcast over ``x``) by ``delta``."""
    x0 = x - velocity * times
    x1 = x + velocity * (1.0 - times)
    mean = x0 * (1.0 - times + delta) + x1 * (times - delta - sigma ** 2 * delta / (2.0 * times))
    return mean, math.sqrt(delta) * sigma * torch.ones_like(mean)


def gaussian_logprob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Element-wise ``log N(x; mean, std^2)``."""
    return -0.5 * ((x - mean) / std) ** 2 - torch.log(std) - 0.5 * _LOG_2PI


def standard_normal_logprob(x: torch.Tensor) -> torch.Tensor:
    """Element-wise ``log N(x; 0, 1)``: the prior's term of a joint Flow-Noise log-probability."""
    return -0.5 * x ** 2 - 0.5 * _LOG_2PI


def log_variance_std(raw: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Flow-Noise's standard deviation from the noise head's output: ``tanh(raw)`` mapped linearly from ``[-1, 1]`` onto
    the log-variance ``[log(low^2), log(high^2)]``, then ``std = exp(log_var / 2)`` (so ``std`` runs geometrically
    from ``low`` to ``high``)."""
    log_var_low, log_var_high = 2.0 * math.log(low), 2.0 * math.log(high)
    log_var = log_var_low + (log_var_high - log_var_low) * (torch.tanh(raw) + 1.0) / 2.0
    return torch.exp(0.5 * log_var)


def gaussian_entropy(std: torch.Tensor) -> torch.Tensor:
    """Element-wise entropy of ``N(., std^2)``."""
    return 0.5 + 0.5 * _LOG_2PI + torch.log(std)
