"""An advantage estimator added the way docs/extending.md's "Adding an advantage estimator" says, from outside the package:
this one module, registered under its dotted name with what it needs declared (here: groups, like GRPO), selected with
``algorithm.adv_type=tests.extension.advantage``. The estimator: each trajectory's return minus its group's median."""

from __future__ import annotations

import torch

from embodirl.algorithms.advantages import AdvantageInputs, broadcast_rows
from embodirl.algorithms.estimators import register_advantage
from embodirl.algorithms.section import AlgorithmSection

CALLS = []


@register_advantage(__name__, groups=True)
def group_median(inp: AdvantageInputs, algorithm: AlgorithmSection) -> tuple[torch.Tensor, torch.Tensor]:
    reward = inp.reward if inp.reward.dim() == 2 else inp.reward.sum(-1)           # (N, T)
    scores = (reward * inp.valid).sum(-1)                                           # (N,)
    groups = inp.group_id if inp.group_id is not None else torch.zeros_like(scores, dtype=torch.int64)
    baseline = torch.stack([scores[groups == g].median() for g in groups])          # (N,)
    CALLS.append(len(scores))
    return broadcast_rows(scores - baseline, inp.valid), broadcast_rows(scores, inp.valid)
