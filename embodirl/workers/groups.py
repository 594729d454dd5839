"""Env and rollout worker groups: creation, collection, weight sync, evaluation.

:class:`WorkerGroups` is what the runner talks to::

    groups = WorkerGroups.from_config(cfg)                  # Ray workers (or remote=False: in this process)
    groups.load_weights(learner_all_tensors, version)       # start (or resume) from the learner's weights
    traj = groups.collect()                                 # Trajectory [N, T], N = env.train.num_envs
    groups.publish(learner_changed_tensors, version)        # after each update (driver-held weights)
    groups.close()

The same :class:`~embodirl.workers.env_worker.EnvWorker` and
:class:`~embodirl.workers.rollout_worker.RolloutWorker` classes run in both cases; each group holds its
workers in a :class:`~embodirl.workers.worker_set.WorkerSet`, the one place that tells an object in this
process from a Ray worker (:mod:`embodirl.workers.env_group`, :mod:`embodirl.workers.rollout_group`). The
slot layout is :mod:`embodirl.workers.layout`'s: each env worker runs the
whole rollout loop itself, so the driver issues one call per env worker and concatenates the returned
trajectories in slot order.

Faults (Ray workers; :mod:`embodirl.workers.recovery`):

* an env worker that dies (its process killed) is replaced by a new one with the same arguments and
  placement; its shared memory is swept, and its slots are collected again from the same episode
  starts (GRPO groups stay intact); the event is logged and kept in :attr:`WorkerGroups.events`;
* a rollout worker that dies is restarted with the last published weights, the env workers it served
  reconnect, and their slots are collected again.

Collocated placement (a component sharing devices with another): with ``rollout.enable_offload`` the
rollout workers offload their weights after collection and load them back before the next one;
``env_workers.enable_offload`` does the same for env workers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from omegaconf import DictConfig, OmegaConf

from embodirl.algorithms.advantages import uses_critic
from embodirl.channel import segments
from embodirl.plain import to_plain
from embodirl.rollout.starts import EpisodeStarts
from embodirl.workers import process_env
from embodirl.workers.env_group import EnvWorkerGroup
from embodirl.workers.layout import RolloutLayout, layout_from_config, plan_from_config
from embodirl.workers.rollout_group import RolloutWorkerGroup
from embodirl.workers.rollout_worker import EVAL, TRAIN, sampling_from_config
from embodirl.workers.worker_set import WorkerSet

log = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 10_000  # evaluation simulators are seeded apart from training ones


def _close_workers(workers: list, remote: bool, wait_s: float = 10.0) -> None:
    """Close ``workers`` (objects in this process, or Ray workers) as :meth:`WorkerSet.close` does."""
    closing = WorkerSet(object, remote=remote)
    closing.handles = list(workers)
    closing.close(wait_s)


def trainable_dtype(cfg: DictConfig, train: bool) -> str | None:
    """The dtype a rollout copy holds its trainable tensors in: the one the learner ranks compute them in
    (training), so that the rollout's log-probs are the learner's; evaluation only: the policy's own."""
    from embodirl.learner.fsdp import learner_compute_dtype

    model_dtype = cfg.model.get("dtype") or "float32"
    return learner_compute_dtype(to_plain(cfg.actor.fsdp), str(model_dtype)) if train else None


class WorkerGroups:
    """The runner's handle on rollout collection (see module docstring). Build it with
    :meth:`from_config`; :meth:`evaluate` creates the evaluation env workers (``env.eval``) on first use
    and serves them from the same rollout workers with evaluation sampling."""

    def __init__(self, cfg: DictConfig, env_group: EnvWorkerGroup | None, rollout_group: RolloutWorkerGroup, *,
                 remote: bool, placement=None, process_vars: Mapping[str, str] | None = None,
                 eval_env_group: EnvWorkerGroup | None = None):
        self.cfg = cfg
        self.env = env_group              # None: built for evaluation only
        self.rollout = rollout_group
        self.remote = remote
        self.rollout_offload = bool(cfg.rollout.get("enable_offload", False))
        self.env_offload = bool(cfg.env_workers.get("enable_offload", False))
        self.eval_env = eval_env_group
        self._placement = placement
        self._process_vars = process_vars

    @classmethod
    def from_config(cls, cfg: DictConfig, *, remote: bool = True, policy=None, policy_for=None,
                    use_placement_groups: bool = True, train: bool = True, weight_source=None) -> WorkerGroups:
        """Build the training env workers and the rollout workers from a composed config (placement:
        ``cluster.component_placement``; Ray: :func:`~embodirl.workers.ray_cluster.init_ray`).
        ``remote=False`` runs every worker in this process. The rollout workers build their policy from
        ``model`` unless given one: ``policy`` (an existing policy object), or ``policy_for(env_spec)``
        called once the env spec is known (returning a policy object, or None to build from ``model``).
        ``train=False`` builds the evaluation env workers instead of the training ones (evaluation only).
        ``weight_source``: a callable giving the actor group's full publication (a
        :class:`~embodirl.workers.weight_transfer.WeightHandle`) for restarted rollout workers; the
        driver then keeps no copy of the weights."""
        layout = layout_from_config(cfg, "env.train")
        eval_layout = layout_from_config(cfg, "env.eval")
        placement = process_vars = None
        if remote:
            from embodirl.workers.ray_cluster import init_ray

            init_ray(cfg.cluster)
            process_vars = process_env.forwarded()
            if use_placement_groups:
                from embodirl.workers.placement_groups import create_placement_groups

                plan = plan_from_config(cfg, layout, eval_layout)
                placement = (plan, create_placement_groups(plan))
        # env workers first: the env spec (task table, action bounds) comes from worker 0's simulators
        env_group = eval_group = None
        try:
            if train:
                env_group = _env_group(cfg, "env.train", layout, remote=remote, placement=placement,
                                       process_vars=process_vars)
            else:
                eval_group = _env_group(cfg, "env.eval", eval_layout, remote=remote, placement=placement,
                                        process_vars=process_vars, placement_offset=layout.num_env_workers)
            spec = (env_group or eval_group).spec
            if policy_for is not None:
                policy = policy_for(spec)
            rollout_cfg = to_plain(cfg.rollout)
            rollout_group = RolloutWorkerGroup(cfg.model, spec, num_workers=layout.num_rollout_workers,
                                               backend=rollout_cfg["backend"],
                                               sampling=sampling_from_config(rollout_cfg, cfg.runner.eval_greedy),
                                               remote=remote,
                                               placement=placement, process_vars=process_vars, policy=policy,
                                               seed=int(cfg.runner.seed), init_seed=int(cfg.runner.seed),
                                               weight_source=weight_source, trainable_dtype=trainable_dtype(cfg, train),
                                               merge_lora=bool(rollout_cfg.get("merge_lora", False)))
            for group in (env_group, eval_group):
                if group is not None:
                    group.attach(rollout_group)
        except BaseException:
            for group in (env_group, eval_group):
                if group is not None:
                    group.close()
            if placement is not None:
                from embodirl.workers.placement_groups import remove_placement_groups

                remove_placement_groups(placement[1])
            raise
        return cls(cfg, env_group, rollout_group, remote=remote, placement=placement, process_vars=process_vars,
                   eval_env_group=eval_group)

    # --- phases ------------------------------------------------------------------------------------
    def collect(self, starts: EpisodeStarts | None = None, seed: int | None = None, video_dir: str | None = None,
                step: int = 0, mode: str | None = None):
        """One training rollout: the trajectory ``[N, T]`` (``N = env.train.num_envs``); ``mode=EVAL``
        samples as evaluation does (ReMax's greedy baseline rollout)."""
        if self.env is None:
            raise RuntimeError("these worker groups were built for evaluation only (train=False)")
        return self._phase(self.env, starts, seed, video_dir, step, mode)

    def evaluate(self, starts: EpisodeStarts | None = None, seed: int | None = None, video_dir: str | None = None,
                 step: int = 0):
        """One evaluation rollout on ``env.eval`` with evaluation sampling (greedy by default)."""
        return self._phase(self._eval_group(), starts, seed, video_dir, step)

    def eval_spec(self):
        """The evaluation env's spec (builds the evaluation env workers if needed)."""
        return self._eval_group().spec

    def _eval_group(self) -> EnvWorkerGroup:
        if self.eval_env is None:
            layout = layout_from_config(self.cfg, "env.eval")
            self.eval_env = _env_group(self.cfg, "env.eval", layout, remote=self.remote, placement=self._placement,
                                       process_vars=self._process_vars,
                                       placement_offset=self.env.layout.num_env_workers)
            self.eval_env.attach(self.rollout)
        return self.eval_env

    def _phase(self, group: EnvWorkerGroup, starts, seed, video_dir, step, mode=None):
        # collocated placement: what the rollout phase needs comes back first, and goes after
        if self.rollout_offload:
            self.rollout.onload()
        if self.env_offload:
            group.onload()
        try:
            return group.collect(starts, seed=seed, video_dir=video_dir, step=step, mode=mode)
        finally:
            if self.rollout_offload:
                self.rollout.offload()
            if self.env_offload:
                group.offload()

    def publish(self, tensors: Mapping, version: int | None = None) -> int:
        """Publish changed trainable tensors held by the driver to every rollout worker; returns the version."""
        return self.rollout.publish(tensors, version)

    def receive_weights(self, handle) -> int:
        """Every rollout worker applies the actor group's publication ``handle``."""
        return self.rollout.receive_weights(handle)

    def load_weights(self, tensors: Mapping, version: int) -> int:
        """Give every rollout worker all trainable tensors at ``version`` (start, resume, evaluation of
        a checkpoint); later :meth:`publish` deltas build on them."""
        return self.rollout.load_weights(tensors, version)

    @property
    def events(self) -> list[dict]:
        """Worker deaths and replacements so far (for the run's log)."""
        return [e for g in (self.env, self.eval_env) if g is not None for e in g.events]

    @property
    def videos(self) -> list[str]:
        return [v for g in (self.env, self.eval_env) if g is not None for v in g.videos]

    def close(self, wait_s: float = 60.0) -> None:
        """Stop every worker (``wait_s``: how long env workers may take to close their simulators before
        they are killed) and release the placement groups."""
        pids = [info.get("pid") for group in (self.eval_env, self.env, self.rollout) if group is not None
                for info in (getattr(group, "infos", None) or [])]
        try:
            for group in (self.eval_env, self.env):
                if group is not None:
                    group.close(wait_s)
            self.rollout.close()
        finally:
            self.eval_env = self.env = None
            if self.remote:
                # these workers are gone and can create no more entries: remove what one killed mid-way
                # left behind (e.g. a response ring it opened while the run was interrupted)
                for pid in pids:
                    if pid:
                        segments.sweep(segments.process_prefix(pid))
            if self._placement is not None:
                from embodirl.workers.placement_groups import remove_placement_groups

                remove_placement_groups(self._placement[1])
                self._placement = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _env_group(cfg: DictConfig, env_key: str, layout: RolloutLayout, *, remote: bool, placement, process_vars,
               placement_offset: int = 0) -> EnvWorkerGroup:
    train = env_key == "env.train"
    channel = cfg.rollout.get("channel") or {}
    return_value = train and cfg.model.get("value_type") is not None and uses_critic(cfg.algorithm.adv_type)
    return EnvWorkerGroup(OmegaConf.select(cfg, env_key), layout, remote=remote, return_value=return_value,
                          seed=int(cfg.runner.seed) + (0 if train else EVAL_SEED_OFFSET),
                          use_shm=bool(channel.get("shm", True)), queue_size=int(channel.get("queue_size", 4)),
                          placement=placement, process_vars=process_vars, mode=TRAIN if train else EVAL,
                          env_placement_offset=placement_offset)
