"""``rollout.backend: huggingface``: the policy's own PyTorch/transformers modules as inference engine.

The policy comes from the model registry (``make_policy(model_cfg, env_spec)``, which honours
``model.dtype``: bf16 for the real OpenVLA-OFT, float32 for the tiny preset), is put in ``eval()``
mode on the worker's device (CUDA when present) and answers whole env batches under
``torch.inference_mode`` through :func:`embodirl.rollout.inference.act`. Offload moves the weights
to CPU memory between rollouts (collocated placement) and back before the next one; on a CPU-only
machine both are no-ops.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch

from embodirl.envs.base import EnvSpec
from embodirl.models.base import SamplingParams
from embodirl.models.registry import make_policy
from embodirl.rollout.inference import act
from embodirl.workers.engines import register_engine
from embodirl.workers.engines.base import InferenceEngine
from embodirl.workers.parking import HostParking

log = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@register_engine("huggingface")
class HuggingFaceEngine(InferenceEngine):
    """See module docstring. ``policy`` may be given directly (tests, in-process runs); otherwise it is
    built from ``model_cfg``."""

    def __init__(self, model_cfg: Mapping, env_spec: EnvSpec, *, device: str | None = None, policy=None,
                 merge_lora: bool = False, compile_blocks: bool = False):
        super().__init__(model_cfg, env_spec, device=device)
        self.device = torch.device(device) if device else default_device()
        self.policy = policy if policy is not None else make_policy(self.model_cfg, env_spec)
        self.policy.eval()
        self.policy.to(self.device)
        # rollout.merge_lora: the adapters folded into this copy's weights, again at every weight update
        self.merge_lora = bool(merge_lora)
        if self.merge_lora:
            self.policy.merge_adapters_()
        if compile_blocks:   # rollout.compile: after the merge, so that the graphs see the merged layers
            log.info("rollout.compile: %d modules of the policy compile at their first call",
                     self.policy.compile_blocks_())
        self.value_type = getattr(self.policy, "value_type", None)
        self._offloaded = False
        self._parking = HostParking()   # collocated placement: reused page-locked buffers for this copy

    def generate(self, obs: Mapping[str, np.ndarray], sampling: SamplingParams, *,
                 return_value: bool = False) -> dict[str, np.ndarray]:
        if self._offloaded:
            self.onload()
        return act(self.policy, obs, self.env_spec.task_descriptions, sampling,
                   return_value=return_value and self.value_type is not None)

    def receive_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        self.policy.load_trainable_state_dict(dict(state))
        if self.merge_lora:
            self.policy.merge_adapters_()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return self.policy.trainable_state_dict()

    def offload(self) -> None:
        if self.device.type == "cpu" or self._offloaded:
            return
        self._parking.offload(self.policy)
        self._offloaded = True
        log.debug("rollout weights offloaded to CPU memory")

    def onload(self) -> None:
        if not self._offloaded:
            return
        self._parking.onload(self.policy, self.device)
        self._offloaded = False
