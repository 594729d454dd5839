"""The actor's supervised step (``embodirl sft``): :meth:`Actor.sft_update <embodirl.actor.actor.Actor.sft_update>`.

It goes through the RL update's optimizer, gradient clipping, LR schedule and FSDP2 wrapping; the loss is the
policy's own ``supervised`` sums (OpenVLA-OFT's action-token cross-entropy and L1 regression head, pi0's flow
matching), divided by the label counts of all ranks, so the summed rank gradients are the whole batch's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from embodirl import data as D
from embodirl.actor import fsdp


class _SupervisedActor(Protocol):
    """What the step uses of :class:`~embodirl.actor.actor.Actor` (named here, so that this module does not import
    the actor that imports it)."""

    policy: Any
    device: torch.device
    host: torch.device
    version: int

    def _start_update(self) -> None: ...

    def _optimizer_step(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


def _take(value: Any, rows: torch.Tensor) -> Any:
    """Rows of a batch field: a list (instructions) or an array/tensor."""
    if isinstance(value, (list, tuple)):
        return [value[i] for i in rows.tolist()]
    return torch.as_tensor(value)[rows]


def sft_update(actor: _SupervisedActor, batch: Mapping, *, micro_batch_size: int, token_loss: bool = True,
               stop_token: bool = True, l1_head: bool = False) -> dict[str, torch.Tensor]:
    """One supervised optimizer step of ``actor`` on this rank's samples. ``batch``: ``images``, ``state``
    (optional), ``instruction`` (list of strings) and ``actions`` (normalised chunks ``[B, H, A]``); the losses are
    the policy's ``supervised`` sums over the labels of all ranks, ``token_loss`` the action-token cross-entropy,
    ``l1_head`` OFT's L1 regression loss. Bumps the actor's version; metrics are global over ranks."""
    supervised = getattr(actor.policy, "supervised", None)
    if supervised is None:
        raise TypeError(f"{type(actor.policy).__name__} has no supervised loss (a supervised() method): it cannot be "
                        "trained with embodirl sft")
    actions = torch.as_tensor(batch["actions"])
    B = actions.shape[0]
    L = actions[0].numel()
    norms = fsdp.all_reduce_(torch.tensor([B * (L + int(stop_token)), B * L], dtype=torch.float32,
                                          device=actor.host)).to(actor.device)
    actor._start_update()
    sums: dict[str, torch.Tensor] = {}
    for rows in torch.arange(B).split(int(micro_batch_size)):
        obs = {key: _take(batch[key], rows) for key in (D.IMAGES, D.STATE, "instruction")
               if batch.get(key) is not None}
        out = supervised(obs, actions[rows], stop_token=stop_token, l1_head=l1_head)
        loss = out["ce_sum"] / norms[0] if token_loss else out["ce_sum"].new_zeros(())
        if l1_head:
            loss = loss + out["l1_head_sum"] / norms[1]
        loss.backward()
        for key, value in out.items():
            sums[f"sft/{key}"] = sums.get(f"sft/{key}", 0.0) + value.detach().float()
    raw = actor._optimizer_step(sums)
    actor.version += 1
    return _sft_metrics(raw, L=L, l1_head=l1_head, version=actor.version)


def _sft_metrics(raw: Mapping[str, torch.Tensor], *, L: int, l1_head: bool, version: int) -> dict[str, torch.Tensor]:
    """The step's metrics from its reduced sums ``raw`` (``sft/<key>`` of the policy's ``supervised`` output, beside
    the optimizer step's own): losses and accuracies per label or token, samples (``L`` action entries each)."""
    metrics = {k: v for k, v in raw.items() if not k.startswith("sft/")}
    metrics["sft/loss"] = raw["sft/ce_sum"] / raw["sft/labels"]
    if "sft/correct" in raw:                   # token policies; π0's loss is the velocity's squared error
        metrics["sft/token_accuracy"] = raw["sft/correct"] / raw["sft/tokens"]
    metrics["sft/action_l1"] = raw["sft/l1_sum"] / raw["sft/tokens"]
    if l1_head:
        metrics["sft/l1_head_loss"] = raw["sft/l1_head_sum"] / raw["sft/tokens"]
    metrics["sft/samples"] = raw["sft/tokens"] / L
    metrics["actor/version"] = torch.tensor(float(version))
    return metrics
