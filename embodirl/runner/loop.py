"""The single-controller loop: ``collect -> advantages -> update -> sync weights``, each timed, with
evaluation, checkpoints and logging around it.

Rollouts come from a collection back-end (:mod:`embodirl.runner.backends`, chosen by
``cluster.use_ray``): in this process (env batches in simulator sub-processes, the learner's policy
acting; pipeline stages overlap through a background inference thread), or Ray env and rollout worker
groups with the shared-memory observation channel. The loop is the same for both.

One step::

    batch   = collect()                  # rollout.rollout_epoch rollouts of env.train.num_envs slots -> [N, T]
    metrics = learner.step(batch)        # advantages (driver side) -> replay buffer -> update epochs
    sync_weights()                       # publish changed trainable tensors to the acting policy

Every ``runner.train_video_interval`` steps the first rollout of the step is recorded to
``videos/train/step_<n>/`` (the envs of ``env.train.video.env_ids``).

Resuming: ``runner.resume_mode=auto`` continues from the latest complete checkpoint of
``runner.output_dir`` (or ``runner.resume_dir``); learner state, RNG states and the start-planning
generator are restored, and the acting policy starts from the restored weights and version. On the
in-process path the next steps reproduce the uninterrupted run on CPU; Ray rollout workers sample
with their own generators, which are not checkpointed.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from embodirl import data as D
from embodirl.learner.learner import Learner
from embodirl.rollout.collector import RolloutStats
from embodirl.rollout.starts import plan_starts
from embodirl.runner import checkpoint as ckpt
from embodirl.runner.backends import open_backend
from embodirl.runner.eval_report import plot_success, print_table, write_eval_info
from embodirl.runner.metrics_logger import MetricsLogger

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rollout_metrics(batch, H: int, collect_s: float) -> dict[str, float]:
    """Success rate, return and length of the episodes in a rollout batch ``[N, T]``, and the oldest
    weight version that acted in it."""
    valid = batch.get(D.VALID)
    done = (batch.get(D.TERMINATED) | batch.get(D.TRUNCATED)) & valid
    reward = batch.get(D.REWARD)
    reward = reward.sum(-1) if reward.dim() == 3 else reward                     # (N, T)
    success = batch.get(D.SUCCESS) if D.SUCCESS in batch.keys() else torch.zeros_like(valid)
    # An episode is a finished one (done) or the unfinished tail of a row.
    unfinished_tail = valid[:, -1] & ~done[:, -1]
    episodes = float(done.sum() + unfinished_tail.sum())
    succeeded = float((success & done).sum() + (success[:, -1] & unfinished_tail).sum())
    decisions = float(valid.sum())
    metrics = {
        "train/success_rate": succeeded / max(episodes, 1.0),
        "train/return": float((reward * valid).sum()) / max(episodes, 1.0),
        "train/episode_length": decisions * H / max(episodes, 1.0),
        "train/episodes": episodes,
        "env/steps_per_s": decisions * H / max(collect_s, 1e-9),
    }
    if D.WEIGHT_VERSION in batch.keys():
        # the oldest weights that acted: the version the last sync published when rollouts are on-policy
        metrics["rollout/weight_version"] = float(batch.get(D.WEIGHT_VERSION)[valid].min())
    return metrics


class Runner:
    """Owns one run's components and its output folder (see module docstring)."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.out = Path(cfg.runner.output_dir)
        self.seed = int(cfg.runner.seed)
        self._t_start = time.perf_counter()
        self._elapsed_offset = 0.0
        self._curve: list[tuple[int, float, float]] = []

    # --- shared pieces -------------------------------------------------------------------------------
    def _write_config(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))

    def _logger(self, resume_step: int | None) -> MetricsLogger:
        lc = self.cfg.runner.logger
        return MetricsLogger(self.out, console=lc.console, tensorboard=lc.tensorboard, wandb=lc.wandb,
                             wandb_mode=lc.wandb_mode, project=lc.project, run_name=self.cfg.runner.experiment_name,
                             config=OmegaConf.to_container(self.cfg), resume_step=resume_step)

    def _evaluate(self, backend, step: int, out_dir: Path) -> dict:
        info = backend.evaluate(step=step, out_dir=out_dir, seed=self.seed + 7919)
        write_eval_info(info, out_dir)
        plot_success(info, out_dir / "eval_success.png")
        return info

    # --- evaluation only ---------------------------------------------------------------------------------
    def run_eval(self) -> dict:
        model_path = ckpt.eval_model_path(self.cfg.runner)
        if model_path is not None:
            # runner.resume_dir names a model checkpoint (e.g. a public OpenVLA-OFT one): load it as model.path
            with open_dict(self.cfg):
                self.cfg.model.path = model_path
                self.cfg.runner.resume_dir = ckpt.DISABLE
        self._write_config()
        seed_everything(self.seed)
        with open_backend(self.cfg, train=False) as backend:
            source = self._resume_source()
            if source is not None:
                self._load_policy_weights(backend.policy, source)
                backend.load_weights(backend.policy.trainable_state_dict(), version=0)
            info = self._evaluate(backend, step=ckpt.checkpoint_step(source) if source else 0, out_dir=self.out)
        print_table(info)
        print(f"eval_info: {self.out / 'eval_info.json'}")
        return info

    # --- training -------------------------------------------------------------------------------------------
    def _resume_source(self) -> Path | None:
        """The checkpoint this run starts from, by ``runner.resume_dir`` / ``runner.resume_mode``
        (:func:`~embodirl.runner.checkpoint.resume_source`)."""
        r = self.cfg.runner
        return ckpt.resume_source(r.resume_dir, r.resume_mode, self.out)

    @staticmethod
    def _load_policy_weights(policy, source: Path) -> None:
        """Load checkpoint ``source``'s trained weights (its ``policy/`` folder, nothing else) into ``policy``."""
        from embodirl.errors import ConfigError

        try:
            policy.load_trainable(source / ckpt.POLICY)
        except (FileNotFoundError, ValueError) as exc:
            written = source / ckpt.CONFIG / "config.yaml"
            hint = (f" (the checkpoint was written with model.name={OmegaConf.load(written).model.name}; use that "
                    f"run's model options, see {written})" if written.is_file() else "")
            raise ConfigError("runner.resume_dir", f"{str(exc).rstrip('.')}{hint}") from None

    @classmethod
    def _load_learner_state(cls, learner: Learner, source: Path) -> None:
        """Restore the learner from checkpoint ``source``: trained weights, then optimizer, schedule,
        replay buffer and counters."""
        cls._load_policy_weights(learner.policy, source)
        state = ckpt.load_train_state(source / ckpt.LEARNER)
        learner.load_state_dict({**state, "trainable": learner.policy.trainable_state_dict()})

    def run_train(self) -> None:
        self._write_config()
        seed_everything(self.seed)
        with open_backend(self.cfg) as backend:
            self._train(backend)

    def _train(self, backend) -> None:
        cfg, r = self.cfg, self.cfg.runner
        spec, policy = backend.spec, backend.policy
        learner = Learner(policy, {"algorithm": cfg.algorithm, "actor": cfg.actor}, task_table=spec.task_descriptions,
                          temperature=float(cfg.rollout.temperature))
        starts_rng = np.random.default_rng(self.seed)
        start_step, env_steps = 0, 0.0
        source = self._resume_source()
        if source is not None:
            start_step = ckpt.checkpoint_step(source)
            self._load_learner_state(learner, source)
            runner_state = json.loads((source / "runner" / "state.json").read_text())
            starts_rng.bit_generator.state = runner_state["starts_rng"]
            env_steps = float(runner_state.get("env_steps", 0.0))
            self._elapsed_offset = float(runner_state.get("elapsed_min", 0.0))
            ckpt.load_rng(source / "runner")
            backend.set_rng_states(ckpt.load_worker_rng(source / "runner"))
            log.info("resumed from %s (step %d)", source, start_step)
        # the acting policy starts from the learner's weights and version (restored ones after a resume)
        version, tensors = learner.publish_weights(full=True)
        backend.load_weights(tensors, version)
        logger = self._logger(resume_step=start_step)     # a fresh start drops records of an earlier attempt
        H = policy.action_chunk
        max_steps = int(r.max_steps)
        if r.max_epochs is not None:
            max_steps = min(max_steps, int(r.max_epochs))
        progress = None
        if r.progress_bar:
            from tqdm import tqdm

            progress = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", leave=False)
        try:
            if r.val_before_train and start_step == 0:
                self._log_eval(logger, backend, 0)
            for step in range(start_step + 1, max_steps + 1):
                timings: dict[str, float] = {}
                t0 = time.perf_counter()
                batch, stats = self._collect(backend, step, starts_rng)
                timings["time/collect"] = time.perf_counter() - t0
                timings["time/env"] = stats.env_s
                timings["time/inference"] = stats.infer_s
                timings["time/channel_wait"] = stats.wait_s
                metrics = rollout_metrics(batch, H, timings["time/collect"])
                metrics["train/dropped_episodes"] = float(stats.recollected_rows)
                # advantages + update
                t1 = time.perf_counter()
                update_metrics = learner.step(batch)
                timings["time/update"] = time.perf_counter() - t1
                # sync weights: the tensors this update changed go to the acting policy
                t2 = time.perf_counter()
                version, tensors = learner.publish_weights()
                backend.sync_weights(tensors, version)
                timings["time/sync_weights"] = time.perf_counter() - t2
                timings["time/step"] = time.perf_counter() - t0
                metrics.update({k: float(v) for k, v in update_metrics.items()})
                metrics.update(timings)
                env_steps += metrics["train/episode_length"] * metrics["train/episodes"]
                metrics["env/total_steps"] = env_steps
                metrics["time/elapsed_min"] = self._elapsed_min()
                logger.log(step, metrics)
                if progress is not None:
                    progress.update(1)
                if r.val_check_interval and step % int(r.val_check_interval) == 0:
                    self._log_eval(logger, backend, step)
                if r.save_interval and (step % int(r.save_interval) == 0 or step == max_steps):
                    self._save(step, learner, starts_rng, env_steps, backend=backend)
        finally:
            if progress is not None:
                progress.close()
            logger.close()

    def _collect(self, backend, step: int, starts_rng: np.random.Generator) -> tuple:
        """``rollout.rollout_epoch`` rollouts -> one batch ``[N, T]`` and their summed timings; the first
        is recorded when this step is a training-video step."""
        cfg = self.cfg
        env_cfg = OmegaConf.to_container(cfg.env.train, resolve=True)
        interval = int(cfg.runner.train_video_interval or 0)
        video_dir = self.out / "videos" / "train" if interval and step % interval == 0 else None
        batches, stats = [], RolloutStats()
        for epoch in range(int(cfg.rollout.rollout_epoch)):
            starts = plan_starts(env_cfg, backend.spec, backend.num_slots, int(cfg.algorithm.group_size), starts_rng)
            batches.append(backend.collect(starts, seed=self.seed + 1_000_003 * step + 7_919 * epoch,
                                           video_dir=video_dir if epoch == 0 else None, step=step))
            for key in ("env_s", "infer_s", "wait_s", "recollected_rows"):
                setattr(stats, key, getattr(stats, key) + getattr(backend.stats, key))
        return (D.concat(batches) if len(batches) > 1 else batches[0]), stats

    def _log_eval(self, logger: MetricsLogger, backend, step: int) -> None:
        out_dir = self.out / "eval" / f"step_{step:06d}"
        info = self._evaluate(backend, step, out_dir)
        o = info["overall"]
        elapsed = self._elapsed_min()
        logger.log(step, {"eval/success_rate": o["success_rate"], "eval/return": o["avg_return"],
                          "eval/episode_length": o["avg_length"], "eval/episodes": o["n_episodes"],
                          "time/eval": o.get("eval_s", 0.0), "time/elapsed_min": elapsed})
        # the success curve so far, one line per evaluation
        self._curve.append((step, elapsed, o["success_rate"]))
        curve = "  ".join(f"{m:.1f}min:{sr:.2f}" for _, m, sr in self._curve[-8:])
        print(f"[eval step {step}] success {o['success_rate']:.2f} over {o['n_episodes']} episodes "
              f"at {elapsed:.1f} min | curve {curve}", flush=True)

    def _elapsed_min(self) -> float:
        """Minutes of this run (across resumes) since the runner started."""
        return self._elapsed_offset + (time.perf_counter() - self._t_start) / 60.0

    def _save(self, step: int, learner: Learner, starts_rng: np.random.Generator, env_steps: float = 0.0, *,
              backend=None) -> Path:
        """Checkpoint ``step_<step>`` in the layout of :mod:`embodirl.runner.checkpoint` (``backend``:
        where remote rollout workers' RNG states come from)."""
        state = learner.state_dict()
        worker_rng = None if backend is None else backend.rng_states()

        def write_policy(folder: Path) -> None:
            learner.policy.save_trainable(folder, state["trainable"])

        def write_learner(folder: Path) -> None:
            ckpt.save_train_state(folder, state)

        def write_runner(folder: Path) -> None:
            (folder / "state.json").write_text(json.dumps({"step": step, "starts_rng": starts_rng.bit_generator.state,
                                                           "env_steps": env_steps, "elapsed_min": self._elapsed_min()}))
            ckpt.save_rng(folder)
            ckpt.save_worker_rng(folder, worker_rng)

        def write_config(folder: Path) -> None:
            (folder / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))

        path = ckpt.save_checkpoint(self.out, step, {ckpt.POLICY: write_policy, ckpt.LEARNER: write_learner,
                                                     ckpt.RUNNER: write_runner, ckpt.CONFIG: write_config})
        log.info("checkpoint: %s", path)
        return path


def run(cfg: DictConfig):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runner = Runner(cfg)
    if cfg.runner.only_eval:
        return runner.run_eval()
    return runner.run_train()
