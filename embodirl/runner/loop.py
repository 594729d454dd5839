"""The single-controller loop: ``collect -> advantages -> update -> sync weights``, each timed, with
evaluation, checkpoints and logging around it.

This is the in-process path (zero remote workers): env batches, the inference policy and the learner
live in this process, and the simulators in their own sub-processes. Pipeline stages
(``rollout.pipeline_stage_num``) overlap simulation of one env batch with inference on another through
a background inference thread.

One step::

    batch   = collect()                  # rollout.rollout_epoch rollouts of env.train.num_envs slots -> [N, T]
    metrics = learner.step(batch)        # advantages (driver side) -> replay buffer -> update epochs
    sync_weights()                       # publish changed trainable tensors to the inference policy

Resuming: ``runner.resume_mode=auto`` continues from the latest complete checkpoint of
``runner.output_dir`` (or ``runner.resume_dir``); learner state, RNG states and the start-planning
generator are restored so that, on CPU, the next steps reproduce the uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from embodirl import data as D
from embodirl.config import decisions_per_episode
from embodirl.envs.registry import make_env
from embodirl.learner.learner import Learner
from embodirl.models.base import SamplingParams
from embodirl.models.registry import make_policy
from embodirl.rollout.collector import RolloutCollector
from embodirl.rollout.inference import PolicyInference
from embodirl.rollout.starts import plan_starts
from embodirl.runner import checkpoint as ckpt
from embodirl.runner.eval_report import plot_success, print_table, write_eval_info
from embodirl.runner.evaluation import evaluate
from embodirl.runner.metrics_logger import MetricsLogger

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rollout_metrics(batch, H: int, collect_s: float) -> dict[str, float]:
    """Success rate, return and length of the episodes in a rollout batch ``[N, T]``."""
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
    return {
        "train/success_rate": succeeded / max(episodes, 1.0),
        "train/return": float((reward * valid).sum()) / max(episodes, 1.0),
        "train/episode_length": decisions * H / max(episodes, 1.0),
        "train/episodes": episodes,
        "env/steps_per_s": decisions * H / max(collect_s, 1e-9),
    }


class Runner:
    """Owns one run's components and its output folder (see module docstring)."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.out = Path(cfg.runner.output_dir)
        self.seed = int(cfg.runner.seed)

    # --- shared pieces -------------------------------------------------------------------------------
    def _write_config(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))

    def _logger(self, resume_step: int | None) -> MetricsLogger:
        lc = self.cfg.runner.logger
        return MetricsLogger(self.out, console=lc.console, tensorboard=lc.tensorboard, wandb=lc.wandb,
                             wandb_mode=lc.wandb_mode, project=lc.project, run_name=self.cfg.runner.experiment_name,
                             config=OmegaConf.to_container(self.cfg), resume_step=resume_step)

    def _evaluate(self, policy, step: int, out_dir: Path) -> dict:
        r = self.cfg.runner
        policy.eval()
        info = evaluate(policy, OmegaConf.to_container(self.cfg.env.eval, resolve=True), out_dir=out_dir, step=step,
                        seed=self.seed + 7919, greedy=bool(r.eval_greedy), temperature=float(self.cfg.rollout.temperature),
                        episodes_per_task=r.eval_episodes_per_task, num_videos=int(r.eval_num_videos))
        write_eval_info(info, out_dir)
        plot_success(info, out_dir / "eval_success.png")
        return info

    # --- evaluation only ---------------------------------------------------------------------------------
    def run_eval(self) -> dict:
        self._write_config()
        seed_everything(self.seed)
        probe = make_env(OmegaConf.to_container(self.cfg.env.eval, resolve=True), num_envs=1, seed=self.seed)
        spec = probe.spec
        probe.close()
        policy = make_policy(self.cfg.model, spec)
        source = self._resume_source()
        if source is not None:
            self._load_policy_weights(policy, source)
        info = self._evaluate(policy, step=ckpt.checkpoint_step(source) if source else 0, out_dir=self.out)
        print_table(info)
        print(f"eval_info: {self.out / 'eval_info.json'}")
        return info

    # --- training -------------------------------------------------------------------------------------------
    def _resume_source(self) -> Path | None:
        r = self.cfg.runner
        if r.resume_mode == "disable" or r.resume_dir == "disable":
            return None
        if r.resume_dir not in (None, "auto"):
            path = Path(r.resume_dir)
            if (path / ckpt.COMPLETE).is_file():
                return path
            latest = ckpt.latest_checkpoint(path)
            if latest is None:
                raise FileNotFoundError(f"runner.resume_dir={path} holds no complete checkpoint")
            return latest
        return ckpt.latest_checkpoint(self.out)

    @staticmethod
    def _load_policy_weights(policy, source: Path) -> None:
        state = torch.load(source / "learner" / "learner.pt", weights_only=False)
        policy.load_trainable_state_dict(state["trainable"])

    def run_train(self) -> None:
        cfg, r = self.cfg, self.cfg.runner
        self._write_config()
        seed_everything(self.seed)
        env_cfg = OmegaConf.to_container(cfg.env.train, resolve=True)
        S = int(cfg.rollout.pipeline_stage_num)
        B = int(env_cfg["num_envs"]) // S
        envs = [make_env(env_cfg, num_envs=B, seed=self.seed, env_offset=s * B) for s in range(S)]
        spec = envs[0].spec
        policy = make_policy(cfg.model, spec)
        learner = Learner(policy, {"algorithm": cfg.algorithm, "actor": cfg.actor}, task_table=spec.task_descriptions,
                          temperature=float(cfg.rollout.temperature))
        sampling = SamplingParams(temperature=float(cfg.rollout.temperature), top_k=cfg.rollout.top_k,
                                  top_p=cfg.rollout.top_p)
        inference = PolicyInference(policy, spec.task_descriptions, sampling, background=S > 1)
        G = int(cfg.algorithm.group_size)
        collector = RolloutCollector(envs, inference, num_decisions=decisions_per_episode(cfg),
                                     auto_reset=bool(env_cfg["auto_reset"]), return_value=learner.cfg.uses_critic,
                                     group_size=G, seed=self.seed)
        starts_rng = np.random.default_rng(self.seed)
        start_step = 0
        source = self._resume_source()
        if source is not None:
            start_step = ckpt.checkpoint_step(source)
            learner.load_state_dict(torch.load(source / "learner" / "learner.pt", weights_only=False))
            runner_state = json.loads((source / "runner" / "state.json").read_text())
            starts_rng.bit_generator.state = runner_state["starts_rng"]
            ckpt.load_rng(source / "runner")
            inference.weight_version = learner.version
            log.info("resumed from %s (step %d)", source, start_step)
        logger = self._logger(resume_step=start_step if source is not None else None)
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
                self._log_eval(logger, policy, 0)
            for step in range(start_step + 1, max_steps + 1):
                timings: dict[str, float] = {}
                t0 = time.perf_counter()
                # collect
                policy.eval()
                batches = []
                for epoch in range(int(cfg.rollout.rollout_epoch)):
                    starts = plan_starts(env_cfg, spec, collector.num_slots, G, starts_rng)
                    batches.append(collector.collect(starts, seed=self.seed + 1_000_003 * step + 7_919 * epoch))
                batch = D.concat(batches) if len(batches) > 1 else batches[0]
                timings["time/collect"] = time.perf_counter() - t0
                timings["time/env"] = collector.stats.env_s
                timings["time/inference"] = collector.stats.infer_s
                timings["time/channel_wait"] = collector.stats.wait_s
                metrics = rollout_metrics(batch, H, timings["time/collect"])
                metrics["train/dropped_episodes"] = float(collector.stats.recollected_rows)
                # advantages + update
                t1 = time.perf_counter()
                update_metrics = learner.step(batch)
                timings["time/update"] = time.perf_counter() - t1
                # sync weights: the inference policy is the learner's module here, so only the version moves
                t2 = time.perf_counter()
                version, _ = learner.publish_weights()
                inference.weight_version = version
                timings["time/sync_weights"] = time.perf_counter() - t2
                timings["time/step"] = time.perf_counter() - t0
                metrics.update({k: float(v) for k, v in update_metrics.items()})
                metrics.update(timings)
                logger.log(step, metrics)
                if progress is not None:
                    progress.update(1)
                if r.val_check_interval and step % int(r.val_check_interval) == 0:
                    self._log_eval(logger, policy, step)
                if r.save_interval and (step % int(r.save_interval) == 0 or step == max_steps):
                    self._save(step, learner, starts_rng)
        finally:
            if progress is not None:
                progress.close()
            logger.close()
            inference.close()
            for env in envs:
                env.close()

    def _log_eval(self, logger: MetricsLogger, policy, step: int) -> None:
        out_dir = self.out / "eval" / f"step_{step:06d}"
        info = self._evaluate(policy, step, out_dir)
        o = info["overall"]
        logger.log(step, {"eval/success_rate": o["success_rate"], "eval/return": o["avg_return"],
                          "eval/episode_length": o["avg_length"], "eval/episodes": o["n_episodes"],
                          "time/eval": o.get("eval_s", 0.0)})

    def _save(self, step: int, learner: Learner, starts_rng: np.random.Generator) -> Path:
        state = learner.state_dict()

        def write_learner(folder: Path) -> None:
            torch.save(state, folder / "learner.pt")

        def write_runner(folder: Path) -> None:
            (folder / "state.json").write_text(json.dumps({"step": step,
                                                           "starts_rng": starts_rng.bit_generator.state}))
            ckpt.save_rng(folder)

        def write_config(folder: Path) -> None:
            (folder / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))

        path = ckpt.save_checkpoint(self.out, step, {"learner": write_learner, "runner": write_runner,
                                                     "config": write_config})
        log.info("checkpoint: %s", path)
        return path


def run(cfg: DictConfig):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runner = Runner(cfg)
    if cfg.runner.only_eval:
        return runner.run_eval()
    return runner.run_train()
