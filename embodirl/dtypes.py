"""Torch dtypes by the names the config uses (``model.dtype``, ``actor.fsdp.param_dtype``, ``reduce_dtype``)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def parse_dtype(name: str | None) -> torch.dtype | None:
    """``name`` as a torch dtype (None stays None)."""
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}'; use one of {', '.join(sorted(DTYPES))} or null")
    return DTYPES[name]
