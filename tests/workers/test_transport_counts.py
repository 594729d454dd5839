"""Per-collection counts of how observation batches reached the inference worker (issue 11: shared
memory inside a node, Ray's object store otherwise), through a real env-worker actor and
inference-worker actor on the toy simulator."""

from __future__ import annotations

import pytest

from embodirl.envs.registry import env_config
from embodirl.models.registry import model_config
from embodirl.workers import process_env
from embodirl.workers.env_worker import EnvWorker
from embodirl.workers.inference_worker import InferenceWorker, sampling_from_config

STAGES, ENVS, DECISIONS = 2, 2, 3


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "object_store"])
def test_last_stats_count_the_batches_of_each_collection_by_path(ray_local, compose_cfg, use_shm):
    cfg = compose_cfg("env=toy_reach", "model=state_mlp", "env.train.state_obs=true")
    variables = process_env.forwarded()
    # no CPU reserved: the two actors fit beside whatever else the test session's Ray holds
    env = ray_local.remote(EnvWorker).options(num_cpus=0).remote(
        env_config(cfg.env.train), num_stages=STAGES, envs_per_stage=ENVS, num_decisions=DECISIONS,
        use_shm=use_shm, process_vars=variables)
    inference = None
    try:
        spec = ray_local.get(env.spec.remote())
        inference = ray_local.remote(InferenceWorker).options(num_cpus=0).remote(
            model_config(cfg.model), spec, engine=cfg.rollout.backend, sampling=sampling_from_config(cfg.rollout),
            process_vars=variables, seed=0)
        env_node, inference_node = (ray_local.get(a.info.remote())["node_id"] for a in (env, inference))
        assert env_node == inference_node
        ray_local.get(env.connect_remote.remote(inference, same_node=True))

        sent = []
        for _ in range(2):
            ray_local.get(env.collect.remote(packed=True))
            stats = ray_local.get(env.last_stats.remote())
            # one observation batch per decision (no value bootstrap asked, no simulator restarts)
            assert stats.decisions > 0
            path, other = (("shm_batches", "object_store_batches") if use_shm
                           else ("object_store_batches", "shm_batches"))
            assert getattr(stats, path) == stats.decisions and getattr(stats, other) == 0
            sent.append(stats.decisions)
        # the client's counters run over its life; the stats hold each collection's own share
        info = ray_local.get(env.transport_info.remote())
        assert info["shm_batches" if use_shm else "ray_batches"] == sum(sent)
        assert ray_local.get(inference.counts.remote())["decisions"] == sum(sent)
    finally:
        ray_local.get(env.close.remote())   # unlinks the env worker's ring
        ray_local.kill(env)
        if inference is not None:
            ray_local.get(inference.close.remote())
            ray_local.kill(inference)
