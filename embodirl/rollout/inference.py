"""How the collector asks for actions: a small request/result protocol, and its in-process form.

The collector never calls a policy directly. It *requests* actions for an observation batch and later asks the
returned handle for the :class:`PolicyOutput`; between the two it steps another env batch. That is
all pipelining needs, and it hides where inference runs:

* :class:`PolicyInference` (here) runs a :class:`~embodirl.models.base.Policy` in this process -
  synchronously, or on one background thread so that env stepping (simulators in sub-processes) and
  inference (torch ops release the GIL) overlap;
* the worker layer's Ray client sends the batch to an inference worker (shared-memory channel or Ray's
  object store) and returns a handle on the remote call.

:func:`act` is the one place that turns an env observation into a policy call (instructions looked up
from the env's task table, CPU tensors the policy moves to its device after its CPU-side work,
``torch.inference_mode``); inference engines reuse it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from embodirl import data as D
from embodirl.models.base import Policy, SamplingParams
from embodirl.rollout.records import to_numpy

INSTRUCTION = "instruction"   # the policy observation key for the language instruction (list[str])


@dataclass
class PolicyOutput:
    """One decision for a batch: arrays with leading dim B, and the weights' version."""

    fields: dict[str, np.ndarray]      # action_chunk [B,H,A], action_tokens|action_sample [B,L], logprob [B,L], value
    weight_version: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def action_chunk(self) -> np.ndarray:
        return self.fields[D.ACTION_CHUNK]


class Pending(Protocol):
    def result(self) -> PolicyOutput: ...


class InferenceClient(Protocol):
    """Request actions for an observation batch, get a handle; ``return_value`` asks for the value head too."""

    def request(self, obs: Mapping[str, np.ndarray], *, return_value: bool = False) -> Pending: ...


class Done:
    """A :class:`Pending` that already holds its result."""

    def __init__(self, output: PolicyOutput):
        self._output = output

    def result(self) -> PolicyOutput:
        return self._output


class FutureResult:
    """A :class:`Pending` around a :class:`concurrent.futures.Future`."""

    def __init__(self, future: Future):
        self._future = future

    def result(self) -> PolicyOutput:
        return self._future.result()


def policy_obs(obs: Mapping[str, np.ndarray], task_descriptions: Sequence[str]) -> dict:
    """An env observation batch as the policy's input: CPU tensors (uint8 images stay uint8) plus
    ``instruction`` (list[str] of length B) looked up by ``task_id``. The policy does its CPU-side work
    on them (image resizing, prompt ids) and then moves its inputs to its device, once.

    Inputs may be read-only views (a shared-memory slot that is handed back right after the decision):
    the result never aliases them (they are copied)."""
    out: dict = {}
    for key, value in obs.items():
        arr = np.asarray(value)
        out[key] = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
    task_ids = np.asarray(obs[D.TASK_ID]).reshape(-1)
    out[INSTRUCTION] = [task_descriptions[int(k)] for k in task_ids]
    return out


def act(policy: Policy, obs: Mapping[str, np.ndarray], task_descriptions: Sequence[str], sampling: SamplingParams,
        *, return_value: bool = False) -> dict[str, np.ndarray]:
    """One batched decision under ``torch.inference_mode`` on the policy's device; returns numpy arrays
    (leading dim B)."""
    with torch.inference_mode():
        out = policy.act(policy_obs(obs, task_descriptions), sampling, return_value=return_value)
    return {key: to_numpy(value.float() if value.is_floating_point() else value) for key, value in out.items()}


class PolicyInference:
    """In-process :class:`InferenceClient` over a policy.

    ``background=True`` runs every decision on one worker thread, so :meth:`request` returns at once and
    the caller steps another env batch meanwhile (pipelining without Ray). ``weight_version`` is
    reported with every output; :meth:`receive_weights` changes both weights and version.
    """

    def __init__(self, policy: Policy, task_descriptions: Sequence[str], sampling: SamplingParams | None = None,
                 *, background: bool = False, weight_version: int = 0):
        self.policy = policy
        self.task_descriptions = list(task_descriptions)
        self.sampling = sampling or SamplingParams()
        self.weight_version = int(weight_version)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embodirl-infer") if background else None

    def _run(self, obs: Mapping[str, np.ndarray], return_value: bool) -> PolicyOutput:
        t0 = time.perf_counter()
        fields = act(self.policy, obs, self.task_descriptions, self.sampling, return_value=return_value)
        return PolicyOutput(fields, self.weight_version, {"infer_s": time.perf_counter() - t0})

    def request(self, obs: Mapping[str, np.ndarray], *, return_value: bool = False) -> Pending:
        if self._pool is None:
            return Done(self._run(obs, return_value))
        # the env may reuse its observation buffers on the next step: hand the thread its own copy
        snapshot = {k: np.array(v, copy=True) for k, v in obs.items()}
        return FutureResult(self._pool.submit(self._run, snapshot, return_value))

    def receive_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.policy.load_trainable_state_dict(dict(state))
        self.weight_version = int(version)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
