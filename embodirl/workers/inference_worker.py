"""The inference worker: an inference copy of the policy answering env workers' observation batches.

A plain class (driven in-process by tests and CPU runs) that the worker groups wrap with
``ray.remote``. Observations arrive three ways:

* on this node, through a shared-memory stream (:mod:`embodirl.workers.stream`): one Ray call opens
  it (:meth:`InferenceWorker.open_stream`), then a thread of this worker answers every queued batch
  from zero-copy views and writes the answers into a response ring - no Ray message per decision;
* as the argument of :meth:`InferenceWorker.infer`: a dict of arrays (in-process, or through Ray's
  object store between nodes) or a :class:`~embodirl.channel.ShmRef` into a ring on this node; the
  answer (action chunk, policy-space actions, log-probs, values: a few KB) is the return value.

Every answer carries the weight version that produced it. A lock keeps weight updates and offloading
apart from decisions of the streaming thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from embodirl import runtime
from embodirl.channel.shm_channel import ChannelInfo, ShmReader, ShmRef
from embodirl.envs.base import EnvSpec
from embodirl.models.base import SamplingParams
from embodirl.rollout.inference import PolicyOutput
from embodirl.schema import to_object
from embodirl.schema.sections import RolloutSection
from embodirl.workers import process_env
from embodirl.workers.engines import make_engine
from embodirl.workers.stream import StreamServer
from embodirl.workers.weight_sync import WeightReceiver, WeightUpdate

log = logging.getLogger(__name__)

TRAIN, EVAL = "train", "eval"


def sampling_from_config(rollout: RolloutSection, eval_greedy: bool = True) -> dict[str, SamplingParams]:
    """The typed ``rollout`` section's ``temperature`` (null: 1, the policy's own distribution), ``top_k`` and
    ``top_p`` for training; evaluation is greedy (``runner.eval_greedy``) or samples like training."""
    rollout = to_object(RolloutSection, rollout, "rollout")
    temperature = 1.0 if rollout.temperature is None else rollout.temperature
    train = SamplingParams(greedy=False, temperature=temperature, top_k=rollout.top_k, top_p=rollout.top_p)
    evaluation = SamplingParams(greedy=bool(eval_greedy), temperature=temperature, top_k=rollout.top_k,
                                top_p=rollout.top_p)
    return {TRAIN: train, EVAL: evaluation}


class InferenceWorker:
    """One inference engine behind the transport (see module docstring).

    Args:
        model_cfg: the ``model`` config.
        env_spec: the env's static description (task table for instructions, action bounds).
        engine: the inference engine's name (``rollout.backend``).
        sampling: ``{"train": SamplingParams, "eval": SamplingParams}``.
        weights: a full :class:`WeightUpdate` to start from (a restarted worker).
        device: where the engine runs the policy (default: CUDA when visible, else CPU).
        process_vars: environment variables to adopt before anything heavy is imported (Ray workers
            do not inherit the driver's later ``os.environ`` changes).
        policy: an already built policy instead of one built from ``model_cfg``; in-process it is used
            as is (the engine puts it in eval mode on its device), through Ray it arrives as a copy.
        seed: seeds this process's generators (action sampling) when given; leave it None in-process,
            where the generators are the driver's.
        init_seed: build the policy with this seeded initialisation (as the actor ranks do) when no
            ``policy`` is given.
        trainable_dtype: hold the trainable tensors of a policy built here in this dtype (the one the actor
            ranks compute them in: :func:`embodirl.actor.fsdp.actor_compute_dtype`), so that the rollout's
            log-probs are the actor's and the importance ratio starts at 1.
        merge_lora: fold the LoRA adapters into this copy's weights at every weight update (``rollout.merge_lora``).
        compile_blocks: compile this copy's networks with ``torch.compile`` (``rollout.compile``).
    """

    def __init__(self, model_cfg: Mapping, env_spec: EnvSpec, *, engine: str = "huggingface",
                 sampling: Mapping[str, SamplingParams] | None = None, weights: WeightUpdate | None = None,
                 device: str | None = None, process_vars: Mapping[str, str] | None = None, policy=None,
                 seed: int | None = None, init_seed: int | None = None, trainable_dtype: str | None = None,
                 merge_lora: bool = False, compile_blocks: bool = False):
        process_env.adopt(process_vars)
        if policy is None and init_seed is not None:
            # the actor ranks build the same seeded initialisation: a random frozen base needs no transfer
            from embodirl.workers.actor_worker import build_policy
            from embodirl.workers.engines.huggingface import default_device

            # built where this worker runs it (its GPU), not on the host first
            policy = build_policy(model_cfg, env_spec, init_seed, device=device or default_device())
        if trainable_dtype is not None and policy is not None:
            from embodirl.dtypes import parse_dtype

            policy.cast_trainable_(parse_dtype(trainable_dtype))
        if seed is not None:
            import torch

            torch.manual_seed(seed)
            np.random.seed(seed % 2**32)
        kwargs: dict[str, Any] = {"device": device}
        if merge_lora:
            kwargs["merge_lora"] = True
        if compile_blocks:
            kwargs["compile_blocks"] = True
        if policy is not None:
            kwargs["policy"] = policy
        self.engine = make_engine(engine, model_cfg, env_spec, **kwargs)
        self.sampling = dict(sampling or {TRAIN: SamplingParams(), EVAL: SamplingParams(greedy=True)})
        self.receiver = WeightReceiver(self.engine.receive_weights)
        self.reader = ShmReader()
        self.requests = 0
        self._lock = threading.RLock()      # decisions (any thread) vs weight updates and offload
        self.server = StreamServer(self._decide, has_value=self.engine.value_type is not None)
        if weights is not None:
            self.receiver.apply(weights)

    # --- inference ---------------------------------------------------------------------------------
    def infer(self, batch: Mapping[str, np.ndarray] | ShmRef, *, return_value: bool = False,
              mode: str = TRAIN) -> PolicyOutput:
        """One decision for an observation batch (a dict or a shared-memory reference)."""
        if not isinstance(batch, ShmRef):
            return self._decide(batch, return_value, mode)
        try:
            return self._decide(self.reader.read(batch), return_value, mode)
        finally:
            self.reader.release(batch)

    def open_stream(self, request: ChannelInfo, first: ShmRef, meta: int):
        """Start serving an env worker's request ring (see :mod:`embodirl.workers.stream`); answers the
        batch ``first`` and returns ``(response ring, answer)``."""
        return self.server.open(request, first, meta)

    def _decide(self, obs: Mapping[str, np.ndarray], return_value: bool, mode: str) -> PolicyOutput:
        t0 = time.perf_counter()
        with self._lock:
            fields = self.engine.generate(obs, self.sampling[mode], return_value=return_value)
            version = self.receiver.version
            self.requests += 1
        return PolicyOutput(fields, version, {"infer_s": time.perf_counter() - t0})

    # --- weights -----------------------------------------------------------------------------------
    def _apply(self, update: WeightUpdate) -> int:
        """Apply a published update; returns the version now held."""
        with self._lock:
            applied = self.receiver.apply(update)
        if applied:
            log.debug("inference worker %d now holds weights v%d", os.getpid(), self.receiver.version)
        return self.receiver.version

    def receive_weights(self, handle) -> tuple[int, str]:
        """Apply a publication of the actor group (:class:`~embodirl.workers.weight_transfer.WeightHandle`),
        read through shared memory on rank 0's node, Ray's object store elsewhere, or CUDA IPC on rank
        0's GPU; returns the version now held and the path taken. An int: the version of an actor rank
        whose module this worker acts with (in this process), whose weights are already these. A
        :class:`~embodirl.workers.weight_sync.WeightUpdate` (already in this process) is applied as it is
        (path ``inline``)."""
        from embodirl.workers.weight_transfer import INLINE, receive

        if isinstance(handle, WeightUpdate):
            return self._apply(handle), INLINE
        if isinstance(handle, int):
            with self._lock:
                self.receiver.version = int(handle)
            return self.receiver.version, "shared"

        device = getattr(getattr(self.engine, "device", None), "type", None) and self.engine.device
        update, path = receive(handle, node_id=process_env.describe()["node_id"], device=device)
        return self._apply(update), path

    def weight_version(self) -> int:
        return self.receiver.version

    def trainable_state_dict(self):
        return self.engine.trainable_state_dict()

    # --- lifecycle ---------------------------------------------------------------------------------
    def offload(self) -> None:
        with self._lock:
            self.engine.offload()

    def onload(self) -> None:
        with self._lock:
            self.engine.onload()

    def forget_channels(self, prefix: str) -> None:
        """Close streams and unmap rings whose names start with ``prefix`` (their producer was replaced)."""
        self.server.close_matching(prefix)
        self.reader.forget(prefix)

    def info(self) -> dict:
        return process_env.describe()

    def counts(self) -> dict:
        """Decisions made in total and those served through shared-memory streams."""
        return {"decisions": self.requests, "streamed": self.server.served}

    def ready(self) -> bool:
        return True

    def rng_state(self) -> dict:
        """This process's generator states (action sampling), for checkpoints."""
        with self._lock:
            return runtime.rng_state()

    def set_rng_state(self, state: dict) -> None:
        with self._lock:
            runtime.set_rng_state(state)

    def close(self) -> None:
        self.server.close()
        self.reader.close()
        self.engine.close()
