"""Every worker builds its policy on its own device, never on the host first: the full-size OpenVLA-OFT (7.7 B
parameters, 15 GB in bf16) built by an inference worker whose device is ``meta`` (standing for its GPU) allocates
nothing on the host; a ``model.device`` set in the config wins over the worker's."""

from __future__ import annotations

import dataclasses
import resource

import torch

from embodirl.config import compose
from embodirl.schema import run_config
from embodirl.tools.dry_run import dry_run_spec
from embodirl.workers.actor_worker import build_policy
from embodirl.workers.inference_worker import InferenceWorker

GIB = 1024**3


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_an_inference_worker_builds_the_7b_on_its_device():
    cfg = run_config(compose(["env=libero_10", "model=openvla_oft"]))
    spec = dry_run_spec(cfg)
    before = _peak_rss()
    worker = InferenceWorker(cfg.model, spec, device="meta", init_seed=0)
    params = list(worker.engine.policy.parameters())
    assert sum(p.numel() for p in params) > 7.6e9
    assert all(p.device.type == "meta" for p in params)
    assert _peak_rss() - before < 2 * GIB      # a host build first would have taken ~15 GiB


def test_the_configs_model_device_wins():
    cfg = run_config(compose(["env=toy_reach", "model=openvla_oft_tiny"]))
    spec = dry_run_spec(cfg)
    on_meta = build_policy(cfg.model, spec, 0, device="meta")
    assert all(p.device.type == "meta" for p in on_meta.parameters())
    pinned = build_policy(dataclasses.replace(cfg.model, device="cpu"), spec, 0, device="meta")
    assert all(p.device == torch.device("cpu") for p in pinned.parameters())
