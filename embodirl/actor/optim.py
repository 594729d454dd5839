"""The actor's optimizer: AdamW with separate learning rates for the policy and the value head,
linear warm-up, and global-norm gradient clipping that works on FSDP2 (DTensor) gradients.

Reads ``actor.optim.{lr, value_lr, weight_decay, betas, eps, warmup_steps, clip_grad, lr_schedule,
lr_decay_steps, min_lr_ratio}``. Warm-up counts optimizer steps; the decay counts training steps
(actor updates), so that early stopping on ``algorithm.early_stop_kl`` does not stretch it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from embodirl.errors import NonFiniteUpdate
from embodirl.schema.sections import LR_SCHEDULES, OptimSection

#: a parameter belongs to the critic when a component of its dotted name starts with one of these
#: (``value_head`` in OpenVLA-OFT, also inside peft's ``modules_to_save``; ``critic`` in state_mlp)
VALUE_PARAM_MARKERS = ("value_head", "critic")


def is_value_param(name: str) -> bool:
    return any(part.startswith(VALUE_PARAM_MARKERS) for part in name.split("."))


def trainable_named_parameters(policy: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in policy.named_parameters() if p.requires_grad]


def build_optimizer(policy: nn.Module, optim: OptimSection) -> torch.optim.AdamW:
    """AdamW over the trainable parameters: a ``policy`` group at ``lr`` and a ``value`` group at
    ``value_lr`` (empty groups are left out)."""
    named = trainable_named_parameters(policy)
    if not named:
        raise ValueError("the policy has no trainable parameters")
    policy_params = [p for n, p in named if not is_value_param(n)]
    value_params = [p for n, p in named if is_value_param(n)]
    groups = []
    if policy_params:
        groups.append({"params": policy_params, "lr": optim.lr, "name": "policy"})
    if value_params:
        groups.append({"params": value_params, "lr": optim.value_lr, "name": "value"})
    betas = (float(optim.betas[0]), float(optim.betas[1]))
    return torch.optim.AdamW(groups, betas=betas, eps=optim.eps, weight_decay=optim.weight_decay)




def decay_factor(kind: str, progress: float, min_ratio: float) -> float:
    """The decay multiplier at ``progress`` (fraction of the decay steps done, clamped to [0, 1]):
    1 for ``constant``; from 1 down to ``min_ratio`` linearly or along a half cosine."""
    p = min(max(float(progress), 0.0), 1.0)
    if kind == "constant":
        return 1.0
    if kind == "linear":
        shape = 1.0 - p
    elif kind == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * p))
    else:
        raise ValueError(f"unknown learning-rate schedule {kind!r}; choose one of {', '.join(LR_SCHEDULES)}")
    return min_ratio + (1.0 - min_ratio) * shape


def lr_schedule(optimizer: torch.optim.Optimizer, optim: OptimSection, training_step: Callable[[], int]
                ) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up from ``lr / warmup_steps`` to ``lr`` over the first ``warmup_steps`` optimizer
    steps, times the ``lr_schedule`` decay over ``lr_decay_steps`` training steps (read through
    ``training_step()``, the actor's update count, which the actor's own state restores). The
    settings are those :class:`~embodirl.actor.settings.ActorSettings` checked."""
    warmup_steps, kind, min_ratio = optim.warmup_steps, optim.lr_schedule, optim.min_lr_ratio

    def factor(step: int) -> float:
        warm = 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)
        if kind == "constant":
            return warm
        assert optim.lr_decay_steps is not None     # a decaying schedule needs it (schema's actor_rules)
        return warm * decay_factor(kind, training_step() / optim.lr_decay_steps, min_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def refresh_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Re-apply the schedule's current factors without stepping it (the training step moved on)."""
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """Clip the global gradient norm to ``max_norm`` (None or <= 0: measure only) and return the
    norm before clipping as a plain detached tensor (FSDP2's DTensor norm is materialised)."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    limit = float(max_norm) if max_norm and max_norm > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach()


def check_finite(metrics: Mapping[str, torch.Tensor], grad_norm: torch.Tensor, optimizer: torch.optim.Optimizer,
                 trainable: Sequence[tuple[str, nn.Parameter]], *, step: int, within: int) -> None:
    """Before an optimizer step: when a loss term in ``metrics`` or the gradient norm is not finite, drop the gradients
    and raise :class:`NonFiniteUpdate` naming the term (loss terms first), so the weights stay as they are. ``step``
    is the training step, ``within`` the optimizer step's number within its update."""
    bad = next((k for k in sorted(metrics, key=lambda k: ("loss" not in k, k))
                if not bool(torch.isfinite(metrics[k]).all())), None)
    if bad is None and bool(torch.isfinite(grad_norm)):
        return
    optimizer.zero_grad(set_to_none=True)
    if bad is not None:
        what = f"the loss term {bad} is {float(metrics[bad])}"
    else:
        params = [n for n, p in trainable if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        what = (f"the gradient norm is {float(grad_norm)} (non-finite in {len(params)} tensor(s), e.g. "
                f"{params[0] if params else '?'})")
    raise NonFiniteUpdate(f"training step {step}, optimizer step {within} of its update: {what}, so the update "
                          "stopped before that optimizer step changed the weights; lower actor.optim.lr, or set "
                          "runner.guard.enabled=true to roll back and go on")
