"""Final-observation values of time-limit truncations through a real env-worker actor and inference-worker
actor (shared-memory stream, two pipeline stages, auto-reset: a value request beside each stage's next
decision) equal those of the same collection in one process."""

from __future__ import annotations

import torch

from embodirl import data as D
from embodirl.envs.registry import env_config
from embodirl.models.registry import model_config
from embodirl.workers import process_env
from embodirl.workers.env_worker import EnvWorker
from embodirl.workers.inference_worker import EVAL, InferenceWorker, sampling_from_config
from embodirl.workers.transport import unpack_trajectory

STAGES, ENVS, DECISIONS = 2, 2, 4   # 6-step episodes of 4 + 2 steps: truncated at decisions 1 and 3


def test_stream_carries_final_value_requests(ray_local, compose_cfg):
    cfg = compose_cfg("env=toy_reach", "model=state_mlp", "env.train.state_obs=true", "env.train.auto_reset=true",
                      "env.train.max_episode_steps=6", "env.train.step_size=0.001")
    env_kwargs = dict(num_stages=STAGES, envs_per_stage=ENVS, num_decisions=DECISIONS, return_value=True,
                      use_shm=True, queue_size=1)
    inference_kwargs = dict(engine=cfg.rollout.backend, sampling=sampling_from_config(cfg.rollout), init_seed=0)

    local_env = EnvWorker(env_config(cfg.env.train), **env_kwargs)
    local_inference = InferenceWorker(model_config(cfg.model), local_env.spec(), **inference_kwargs)
    local_env.connect_local(local_inference, mode=EVAL)
    want = local_env.collect(seed=5)
    local_env.close()
    local_inference.close()

    variables = process_env.forwarded()
    env = ray_local.remote(EnvWorker).options(num_cpus=0).remote(env_config(cfg.env.train), process_vars=variables,
                                                                 **env_kwargs)
    inference = None
    try:
        spec = ray_local.get(env.spec.remote())
        inference = ray_local.remote(InferenceWorker).options(num_cpus=0).remote(
            model_config(cfg.model), spec, process_vars=variables, **inference_kwargs)
        ray_local.get(env.connect_remote.remote(inference, same_node=True, mode=EVAL))
        got = unpack_trajectory(ray_local.get(env.collect.remote(seed=5, packed=True)))
        assert ray_local.get(env.transport_info.remote())["shm"]
    finally:
        ray_local.get(env.close.remote())
        ray_local.kill(env)
        if inference is not None:
            ray_local.get(inference.close.remote())
            ray_local.kill(inference)
    truncated = want[D.TRUNCATED] & want[D.VALID]
    assert truncated[:, :-1].any() and truncated[:, -1].any()      # inside rows and at their end
    torch.testing.assert_close(got[D.TRUNCATED], want[D.TRUNCATED])
    torch.testing.assert_close(got[D.FINAL_VALUE], want[D.FINAL_VALUE])
    assert (want[D.FINAL_VALUE][truncated] != 0).all() and (want[D.FINAL_VALUE][~truncated] == 0).all()
