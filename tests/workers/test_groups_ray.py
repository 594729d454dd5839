"""Worker groups as real Ray actors on the toy simulator: shared-memory transport, placement groups,
weight versions, and recovery from SIGKILLed env and inference workers."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch

from embodirl import data as D
from embodirl.channel import segments
from embodirl.workers.groups import WorkerGroups
from embodirl.workers.inference_worker import InferenceWorker

KILL_WAIT_S = 120.0


def _toy(compose_cfg, *overrides):
    return compose_cfg("env=toy_reach", "model=state_mlp", "env.train.state_obs=true", "env.train.num_envs=8",
                       "actor.global_batch_size=8", *overrides)


def _run_entries():
    return segments.listing(segments.run_prefix())


def test_collect_through_actors_over_shared_memory(ray_local, compose_cfg):
    cfg = _toy(compose_cfg, "env_workers.num_workers=2", "rollout.pipeline_stage_num=2")
    with WorkerGroups.from_config(cfg, remote=True) as groups:
        # real placement groups: one STRICT_PACK group of one-core bundles on this node
        table = ray_local.util.placement_group_table()
        ours = [pg for pg in table.values() if pg["name"] == "embodirl-node0" and pg["state"] == "CREATED"]
        assert len(ours) == 1 and all(b == {"CPU": 1.0} for b in ours[0]["bundles"].values())
        traj = groups.collect()
        D.validate(traj)
        assert traj.batch_size == torch.Size([8, 6])
        assert traj[D.VALID][:, 0].all()
        assert (traj[D.GROUP_ID][:, 0] == torch.arange(8)).all()
        # every observation batch went through the env workers' rings, none through the object store;
        # after the call that opened each stream, no Ray message per decision
        infos = ray_local.get([w.transport_info.remote() for w in groups.env.workers])
        assert all(i["stream"] and i["shm_batches"] > 0 and i["ray_batches"] == 0 for i in infos)
        counts = ray_local.get(groups.inference.workers[0].counts.remote())
        assert counts["decisions"] == sum(i["shm_batches"] for i in infos)
        assert counts["streamed"] == counts["decisions"] - len(infos)
        rings = [i["segment"] for i in infos]
        assert all(r in _run_entries() for r in rings)
        # weight sync: the next rollout's decisions carry the published version
        state = groups.inference.workers.call(0, InferenceWorker.trainable_state_dict)
        assert groups.inference.publish_weights({k: v * 0.5 for k, v in state.items()}) == 1
        assert groups.inference.weight_versions() == [1]
        assert (groups.collect()[D.WEIGHT_VERSION] == 1).all()
    assert not [r for r in rings if r in _run_entries()]


def test_object_store_path_when_shared_memory_is_off(ray_local, compose_cfg):
    cfg = _toy(compose_cfg, "rollout.channel.shm=false")
    with WorkerGroups.from_config(cfg, remote=True) as groups:
        traj = groups.collect()
        assert traj[D.VALID][:, 0].all()
        info = ray_local.get(groups.env.workers[0].transport_info.remote())
        assert info["shm_batches"] == 0 and info["ray_batches"] > 0 and info["segment"] is None


def _kill_when_rolling(pid: int, prefix: str, killed: list):
    """SIGKILL ``pid`` once it has sent its first observation batch (its ring exists): mid-rollout."""
    end = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < end:
        if segments.listing(prefix):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.005)


@pytest.mark.slow
def test_env_worker_killed_mid_rollout_is_replaced(ray_local, compose_cfg):
    # long episodes (250 decisions) so that the kill lands while the worker is collecting
    cfg = _toy(compose_cfg, "env_workers.num_workers=2", "env.train.max_episode_steps=1000")
    with WorkerGroups.from_config(cfg, remote=True) as groups:
        victim = groups.env.env_worker_pids()[0]
        killed: list = []
        killer = threading.Thread(target=_kill_when_rolling,
                                  args=(victim, segments.process_prefix(victim), killed))
        killer.start()
        traj = groups.collect()
        killer.join()
        assert killed == [victim]
        # the requested number of valid trajectories, slots in order, whole episodes
        assert traj.batch_size[0] == 8
        assert traj[D.VALID][:, 0].all()
        assert ((traj[D.TERMINATED] | traj[D.TRUNCATED]) & traj[D.VALID]).any(dim=1).all()
        assert (traj[D.GROUP_ID][:, 0] == torch.arange(8)).all()
        events = [e for e in groups.events if e["event"] == "env_worker_replaced"]
        assert len(events) == 1 and events[0]["worker"] == 0 and events[0]["pid"] == victim
        assert groups.env.env_worker_pids()[0] != victim
        # nothing of the dead worker is left in /dev/shm
        assert segments.listing(segments.process_prefix(victim)) == []


@pytest.mark.slow
def test_inference_worker_killed_mid_rollout_restarts_with_published_weights(ray_local, compose_cfg):
    cfg = _toy(compose_cfg, "env_workers.num_workers=2", "env.train.max_episode_steps=1000")
    with WorkerGroups.from_config(cfg, remote=True) as groups:
        state = groups.inference.workers.call(0, InferenceWorker.trainable_state_dict)
        groups.inference.publish_weights({k: v + 0.01 for k, v in state.items()})
        groups.inference.publish_weights({k: v + 0.02 for k, v in state.items()})
        victim = groups.inference.infos[0]["pid"]
        killed: list = []
        # the inference worker's response rings appear once it serves the env workers' streams
        killer = threading.Thread(target=_kill_when_rolling, args=(victim, segments.process_prefix(victim), killed))
        killer.start()
        traj = groups.collect()
        killer.join()
        assert killed == [victim]
        assert traj.batch_size[0] == 8 and traj[D.VALID][:, 0].all()
        assert (traj[D.WEIGHT_VERSION] == 2).all()
        assert [e["event"] for e in groups.events] == ["inference_worker_restarted"]
        assert groups.inference.infos[0]["pid"] != victim
        assert groups.inference.weight_versions() == [2]
        restarted = ray_local.get(groups.inference.workers[0].trainable_state_dict.remote())
        for name, tensor in restarted.items():
            torch.testing.assert_close(tensor, state[name] + 0.02)
        # the next rollout streams from the new worker
        assert groups.collect()[D.VALID][:, 0].all()


def test_a_policy_that_cannot_take_the_envs_observation_is_one_sentence_before_it_is_built(ray_local, compose_cfg):
    """The state MLP on the toy env without a state observation: in one process the driver's build refuses it; on
    Ray the inference worker built it and died with the sentence inside a traceback. The driver checks the policy
    against the spec the first env worker reports, before any inference worker starts, and closes what it started."""
    from embodirl.errors import ConfigError

    cfg = compose_cfg("env=toy_reach", "model=state_mlp", "env.train.num_envs=2", "actor.global_batch_size=2")
    with pytest.raises(ConfigError, match=r"model.name: state_mlp needs a state observation .*state_obs=true"):
        WorkerGroups.from_config(cfg, remote=True)
    assert not _run_entries()   # the env workers' shared-memory rings are gone with them


def test_a_worker_set_answers_on_ray_as_in_this_process_and_names_a_dead_worker(ray_local):
    """tests/workers/test_worker_set.py's calls on Ray workers (here, to share this file's Ray): the same results in
    rank order, a worker's error raised where the result is read, a string refused before anything is sent; a
    killed worker is :class:`WorkerDied` naming its rank."""
    import sys

    from ray import cloudpickle
    from test_worker_set import Counter

    from embodirl.workers.worker_set import WorkerDied, WorkerSet

    module = sys.modules[Counter.__module__]
    cloudpickle.register_pickle_by_value(module)          # the worker processes cannot import the test module
    workers = WorkerSet(Counter, remote=True, options_for=lambda rank: {"num_cpus": 0})
    try:
        for rank in range(2):
            workers.start(rank, rank)
        with pytest.raises(TypeError, match="pass Counter.<method>"):
            workers.call_async(0, "add", 1)
        assert workers.call_all(Counter.add, 1) == [1, 101]
        assert workers.call_each(Counter.add, [10, 20]) == [11, 121]
        with pytest.raises(ValueError, match="worker 1: boom"):
            workers.get(workers.call_async(1, Counter.fail, "boom"))
        assert workers.gather([workers.call_async(r, Counter.add, 0) for r in (1, 0)], ranks=[1, 0]) == [121, 11]
        pid = workers.get(workers.call_async(1, Counter.pid))
        ray_local.kill(workers[1], no_restart=True)
        # ray.kill only asks for the kill: a call sent before it lands is still answered (seen on a loaded CI
        # machine), so the calls below go out once the worker's process is gone
        psutil.Process(pid).wait(timeout=60)
        with pytest.raises(WorkerDied) as died:
            workers.gather([workers.call_async(r, Counter.add, 0) for r in range(2)])
        assert died.value.rank == 1
    finally:
        workers.close(wait_s=5)
        cloudpickle.unregister_pickle_by_value(module)
