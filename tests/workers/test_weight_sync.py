"""Versioned weight sync: deltas of changed tensors, version checks, restarts from the last published
weights, and the version recorded with every decision."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodirl import data as D
from embodirl.envs.registry import make_env
from embodirl.models.base import SamplingParams
from embodirl.models.registry import make_policy
from embodirl.workers.inference_worker import InferenceWorker
from embodirl.workers.weight_sync import WeightPublisher, WeightReceiver, WeightVersionError


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"lora.A": torch.randn(4, 3, generator=g), "lora.B": torch.randn(3, 4, generator=g),
            "value_head.weight": torch.randn(1, 4, generator=g)}


def test_publisher_sends_only_changed_tensors_with_increasing_versions():
    start = _tensors()
    pub = WeightPublisher(start)
    changed = dict(start, **{"lora.A": start["lora.A"] + 1.0})
    update = pub.publish_weights(changed)
    assert (update.base_version, update.version) == (0, 1)
    assert set(update.tensors) == {"lora.A"}
    assert pub.publish_weights(changed).tensors == {}                      # nothing changed since v1
    assert pub.version == 2
    with pytest.raises(WeightVersionError):
        pub.publish_weights(changed, version=2)
    full = pub.publish_weights(full=True)
    assert full.full and full.version == 2 and set(full.tensors) == set(start)
    torch.testing.assert_close(full.tensors["lora.A"], start["lora.A"] + 1.0)


def test_publisher_keeps_its_own_copy():
    tensors = _tensors()
    pub = WeightPublisher()
    pub.publish_weights(tensors)
    tensors["lora.A"].add_(5.0)                                     # the actor keeps training in place
    assert set(pub.publish_weights(tensors).tensors) == {"lora.A"}


def test_receiver_applies_in_order_and_rejects_gaps():
    loaded = {}
    rx = WeightReceiver(loaded.update)
    pub = WeightPublisher(_tensors())
    first = pub.publish_weights(_tensors(1))
    second = pub.publish_weights(_tensors(2))
    with pytest.raises(WeightVersionError, match="full update"):
        rx.apply(second)                                            # v1 -> v2 on top of v0
    assert rx.apply(first) and rx.apply(second) and rx.version == 2
    assert not rx.apply(first)                                      # older: ignored
    late = WeightReceiver(loaded.update)
    assert late.apply(pub.publish_weights(full=True)) and late.version == 2      # a new worker catches up at once


@pytest.fixture
def worker_setup(compose_cfg):
    cfg = compose_cfg("env=toy_reach", "model=state_mlp", "env.train.state_obs=true")
    env = make_env(cfg.env.train, num_envs=4, seed=0)
    obs, _ = env.reset(seed=0)
    return cfg, env.spec, obs


def test_inference_worker_tags_decisions_and_restarts_from_published_weights(worker_setup):
    cfg, spec, obs = worker_setup
    sampling = {"train": SamplingParams(greedy=True), "eval": SamplingParams(greedy=True)}
    worker = InferenceWorker(cfg.model, spec, sampling=sampling)
    assert worker.infer(obs).weight_version == 0
    pub = WeightPublisher(worker.trainable_state_dict())
    trained = {k: v + 0.1 * torch.randn_like(v) for k, v in worker.trainable_state_dict().items()}
    update = pub.publish_weights(trained)
    assert worker.receive_weights(update) == (1, "inline")
    out = worker.infer(obs, return_value=True)
    assert out.weight_version == 1
    # a worker restarted from the publisher's full update acts exactly like the live one
    restarted = InferenceWorker(cfg.model, spec, sampling=sampling, weights=pub.publish_weights(full=True))
    again = restarted.infer(obs, return_value=True)
    assert again.weight_version == 1
    for key in (D.ACTION_CHUNK, D.ACTION_SAMPLE, D.VALUE):
        np.testing.assert_allclose(again.fields[key], out.fields[key], rtol=1e-6, atol=1e-6)
    # ...while a fresh worker (other random init) does not
    fresh = InferenceWorker(cfg.model, spec, sampling=sampling)
    assert not np.allclose(fresh.infer(obs).fields[D.ACTION_CHUNK], out.fields[D.ACTION_CHUNK])


def test_only_changed_tensors_travel_after_an_update(worker_setup):
    cfg, spec, _ = worker_setup
    policy = make_policy(cfg.model, spec)
    pub = WeightPublisher(policy.trainable_state_dict())
    with torch.no_grad():
        policy.critic[-1].bias.add_(1.0)            # an update that only moved the value head's bias
    update = pub.publish_weights(policy.trainable_state_dict())
    assert list(update.tensors) == ["critic.4.bias"]
    assert update.nbytes == policy.critic[-1].bias.numel() * 4


def test_reset_starts_over_at_a_given_version_and_deltas_build_on_it():
    pub = WeightPublisher(_tensors(0))
    pub.publish_weights(_tensors(1))                                        # v1 (e.g. a run's first update)
    restored = _tensors(2)
    full = pub.reset(restored, version=7)                           # a run resumed at actor version 7
    assert full.full and full.version == 7 and set(full.tensors) == set(restored)
    loaded = {}
    rx = WeightReceiver(loaded.update)
    assert rx.apply(full) and rx.version == 7
    torch.testing.assert_close(loaded["lora.A"], restored["lora.A"])
    at_start = WeightReceiver(loaded.update, version=0)
    assert pub.reset(restored, version=0).full and at_start.apply(pub.publish_weights(full=True))   # version 0: still applies
    changed = dict(restored, **{"lora.B": restored["lora.B"] * 2.0})
    pub.reset(restored, version=7)
    delta = pub.publish_weights(changed, version=8)
    assert (delta.base_version, delta.version, set(delta.tensors)) == (7, 8, {"lora.B"})
    assert rx.apply(delta) and rx.version == 8


def test_merged_lora_acts_as_the_adapter_and_remerges_from_the_original_weights(compose_cfg):
    """rollout.merge_lora: an inference worker folds the adapter into its copy's weights at every update. With trained
    (non-zero) adapters it acts as the unmerged copy (float32: greedy tokens equal but for near-ties, log-probs
    within float rounding), and after other weights and then the first ones again, its weights are bit-identical to
    the first merge: every merge starts from the original weights, so no rounding accumulates."""
    from embodirl.workers.weight_sync import WeightUpdate

    cfg = compose_cfg("env=toy_reach", "model=openvla_oft_tiny", "model.lora.target_modules=[all-linear,lm_head]")
    env = make_env(cfg.env.eval, num_envs=4, seed=0)
    obs, _ = env.reset(seed=0)
    env.close()
    workers = {merge: InferenceWorker(cfg.model, env.spec, init_seed=1, merge_lora=merge,
                                    sampling={"train": SamplingParams(), "eval": SamplingParams(greedy=True)})
               for merge in (False, True)}

    def trained(seed):
        g = torch.Generator().manual_seed(seed)
        return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in workers[False].trainable_state_dict().items()}

    first, second = trained(1), trained(2)
    outputs = {}
    for merge, worker in workers.items():
        worker.receive_weights(WeightUpdate(version=1, base_version=None, tensors=first, full=True))
        outputs[merge] = worker.infer(obs, mode="eval").fields
    # greedy decoding is an argmax over the vocabulary: merged and unmerged logits differ by float rounding
    # (~2e-6 here), so a token whose top two logits are closer than that may flip on another CPU's kernels;
    # a wrong merge changes nearly every token
    same = np.asarray(outputs[True][D.ACTION_TOKENS]) == np.asarray(outputs[False][D.ACTION_TOKENS])
    assert same.mean() >= 0.97, f"{int((~same).sum())} of {same.size} greedy tokens differ"
    np.testing.assert_allclose(outputs[True][D.LOGPROB_BEHAVIOR], outputs[False][D.LOGPROB_BEHAVIOR], atol=1e-4)
    merged, plain = workers[True].engine.policy, dict(workers[False].engine.policy.named_parameters())
    weights = {n: p.detach().clone() for n, p in merged.named_parameters() if n.endswith("base_layer.weight")}
    assert weights and not any(torch.equal(w, plain[n]) for n, w in weights.items())   # folded in: they differ
    for version, tensors in ((2, second), (3, first)):
        workers[True].receive_weights(WeightUpdate(version=version, base_version=None, tensors=tensors, full=True))
    for name, param in merged.named_parameters():
        if name in weights:
            assert torch.equal(param, weights[name]), name


@pytest.mark.slow
def test_a_compiled_copy_acts_as_the_plain_one_across_weight_updates(compose_cfg):
    """rollout.compile (with rollout.merge_lora, as a GPU run pairs them): the inference worker's copy has its
    transformer blocks compiled, acts as the plain copy, and keeps doing so after a weight update: the compiled
    graphs read the weights the update merged in place rather than the ones they were compiled with."""
    from embodirl.workers.weight_sync import WeightUpdate

    cfg = compose_cfg("env=toy_reach", "model=openvla_oft_tiny", "model.lora.target_modules=[all-linear,lm_head]")
    env = make_env(cfg.env.eval, num_envs=4, seed=0)
    obs, _ = env.reset(seed=0)
    env.close()
    workers = {compiled: InferenceWorker(cfg.model, env.spec, init_seed=1, merge_lora=True, compile_blocks=compiled,
                                         sampling={"train": SamplingParams(), "eval": SamplingParams(greedy=True)})
               for compiled in (False, True)}
    blocks = list(workers[True].engine.policy.core.language_model.model.layers)
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    assert all(b._compiled_call_impl is None for b in workers[False].engine.policy.core.language_model.model.layers)
    g = torch.Generator().manual_seed(3)
    logprobs = []
    for version in (1, 2):
        tensors = {k: v + 0.05 * torch.randn(v.shape, generator=g)
                   for k, v in workers[False].trainable_state_dict().items()}
        outputs = {}
        for compiled, worker in workers.items():
            worker.receive_weights(WeightUpdate(version=version, base_version=None, tensors=tensors, full=True))
            outputs[compiled] = worker.infer(obs, mode="eval").fields
        # the compiled graphs fuse the elementwise work and round differently (float32, ~1e-6): greedy tokens
        # whose top two logits are that close may flip; stale weights would change nearly every token
        same = np.asarray(outputs[True][D.ACTION_TOKENS]) == np.asarray(outputs[False][D.ACTION_TOKENS])
        assert same.mean() >= 0.97, f"version {version}: {int((~same).sum())} of {same.size} greedy tokens differ"
        np.testing.assert_allclose(outputs[True][D.LOGPROB_BEHAVIOR], outputs[False][D.LOGPROB_BEHAVIOR], atol=1e-4)
        logprobs.append(np.asarray(outputs[True][D.LOGPROB_BEHAVIOR]))
    assert np.abs(logprobs[1] - logprobs[0]).max() > 1e-2   # the update reached the compiled copy
