"""The inference engine interface: what an inference worker needs from the engine that runs its policy.

An engine owns one inference copy of the policy and answers batched decisions. The inference worker
(transport, weight versions, offload scheduling) and the env workers never see which engine runs:
``rollout.backend: huggingface`` is the plain PyTorch/transformers model (this package); a vLLM
engine (GPU only) joins by registering another class that implements the same five methods and
keeps the output contract below.

``generate`` returns numpy arrays with leading dim B: ``action_chunk`` float32 ``[B, H, A]``, the
policy's ``action_field`` (``action_tokens`` int64 / ``action_sample`` float32 ``[B, L]``),
``logprob_behavior`` float32 ``[B, L]`` and, with ``return_value``, ``value`` float32 ``[B]`` or
``[B, H]``.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping

import numpy as np
import torch

from embodirl.envs.base import EnvSpec
from embodirl.models.base import SamplingParams
from embodirl.models.registry import model_config


class InferenceEngine(abc.ABC):
    """One inference engine holding the policy (see module docstring)."""

    #: "chunk_level" / "action_level" / None (no value head): lets callers know whether values exist
    value_type: str | None = None

    def __init__(self, model_cfg: Mapping, env_spec: EnvSpec, *, device: str | None = None):
        self.model_cfg = model_config(model_cfg)   # the typed model section (a mapping of it is converted once)
        self.env_spec = env_spec

    @abc.abstractmethod
    def generate(self, obs: Mapping[str, np.ndarray], sampling: SamplingParams, *,
                 return_value: bool = False) -> dict[str, np.ndarray]:
        """One batched decision (see module docstring for the returned arrays)."""

    @abc.abstractmethod
    def receive_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load (a subset of) the trainable tensors, by name, as the actor published them."""

    @abc.abstractmethod
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The current trainable tensors (CPU copies): what a restarted worker must get back."""

    def offload(self) -> None:  # noqa: B027 - optional: engines without device memory do nothing
        """Free accelerator memory while the rollout phase is idle (collocated placement)."""

    def onload(self) -> None:  # noqa: B027
        """Undo :meth:`offload` before the next rollout."""

    def close(self) -> None:  # noqa: B027
        pass
