"""The single-controller loop: ``collect -> advantages -> update -> publish weights``, each timed, with
evaluation, checkpoints and logging around it.

Every worker belongs to one :class:`~embodirl.workers.groups.WorkerGroups`: env workers and inference workers, in
this process (the default job: simulators in sub-processes, pipeline stages overlapping through a background
inference thread) or as Ray workers with the shared-memory observation channel (``cluster.use_ray``), the
same classes either way, and the actor's :class:`~embodirl.workers.actor_group.ActorGroup`: one rank in this
process (whose module the inference worker acts with), or N FSDP2 ranks as Ray workers.

One step (the phases of :class:`~embodirl.runner.training.TrainingRun`, with the collapse guard, the moving average
and parking the actor as hooks around them: :mod:`~embodirl.runner.hooks`)::

    batch    = groups.collect(starts, seed=s)   # rollout.rollout_epoch times: env.train.num_envs slots -> [N, T]
    batch    = actors.with_ref_logprob(batch)   # only with a KL term (reference forward on the ranks)
    prepared = prepare_batch(batch)             # driver: KL penalty, group filter, advantages (whole batch)
    metrics  = actors.train(prepared)           # every rank its shard of whole groups: replay + update epochs
    groups.publish_weights()                    # rank 0 posts the changed tensors; inference workers read them

Every ``runner.train_video_interval`` steps the first rollout of the step is recorded to
``videos/train/step_<n>/`` (the envs of ``env.train.video.env_ids``).

The run holds its folder (:mod:`~embodirl.runner.run_folder`: a lock, and a folder holding another run is refused
before any worker starts). Resuming: ``runner.resume_mode=auto`` continues from the latest complete checkpoint of
``runner.output_dir`` when its saved config has the same hyper-parameters (or from ``runner.resume_dir``); the
actor ranks restore their state (from any number of ranks that wrote it), RNG states (the inference workers' too)
and the start-planning generator are restored, and the acting policy starts from the restored weights and version.
An actor rank that dies, or a Ray worker stuck past its deadline (``runner.worker_deadline``), ends the run with one
sentence, or with ``runner.max_restarts`` rebuilds the workers from the last complete checkpoint. SIGTERM or SIGUSR1
(preemption: :mod:`embodirl.runner.preemption`) ends the step under way, writes its checkpoint and stops the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from embodirl import checkpoint_layout as layout
from embodirl import data as D
from embodirl import runtime
from embodirl.calibration import report as prediction
from embodirl.envs.video import step_folder
from embodirl.errors import ConfigError, RunFailed
from embodirl.models.registry import make_policy
from embodirl.placement import use_ray
from embodirl.progress import Ticker
from embodirl.rollout.collector import RolloutStats
from embodirl.rollout.starts import plan_starts
from embodirl.runner import checkpoint as ckpt
from embodirl.runner import heldout
from embodirl.runner.checkpoint import load_policy_weights
from embodirl.runner.collection import InformativeGroups, remax_baseline
from embodirl.runner.eval_report import plot_learning_curve, plot_success, print_table, write_eval_info
from embodirl.runner.evaluation import eval_env_cfg, run_sweep
from embodirl.runner.guard import CollapseGuard
from embodirl.runner.metrics_logger import MetricsLogger, read_metrics
from embodirl.runner.preemption import Preempted
from embodirl.runner.run_folder import FolderLock, check_eval_folder, no_room, training_start
from embodirl.runner.training import TrainingRun
from embodirl.runner.weights import complete_record, describe, weights_record
from embodirl.schema import Config, EnvSplits, run_config
from embodirl.workers.groups import WorkerGroups

log = logging.getLogger(__name__)
#: evaluation videos per evaluation sent to TensorBoard / wandb (all of them stay on disk)
EVAL_VIDEOS_LOGGED = 2
#: the evaluation sweep's seeds start at runner.seed + this (apart from the training rollouts' seeds)
EVAL_SEED_OFFSET = 7919


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Runner:
    """Owns one run's components and its output folder (see module docstring)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg = run_config(cfg)        # the typed config (a composed one is converted here, once)
        self.algorithm = cfg.algorithm          # the typed section the algorithms run on
        self.out = Path(cfg.runner.output_dir)
        self.seed = cfg.runner.seed
        # the clock of the printed curve starts when the `embodirl` command's process did (interpreter start,
        # imports and config composition included); used as a library, when this object is made
        started = runtime.command_started
        self._t_start = time.perf_counter() - (max(0.0, time.time() - started) if started is not None else 0.0)
        self._elapsed_offset = 0.0
        self._curve: list[tuple[int, float, float]] = []
        self._restart_source: Path | None = None
        self._start_source: Path | None = None      # the checkpoint training starts from (run_folder.training_start)
        self.guard = CollapseGuard()

    # --- shared pieces -------------------------------------------------------------------------------
    def _write_config(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))   # the typed config as YAML

    def _logger(self, resume_step: int | None) -> MetricsLogger:
        lc = self.cfg.runner.logger
        return MetricsLogger(self.out, console=lc.console, tensorboard=lc.tensorboard, wandb=lc.wandb,
                             wandb_mode=lc.wandb_mode, project=lc.project, run_name=self.cfg.runner.experiment_name,
                             config=dataclasses.asdict(self.cfg), resume_step=resume_step)

    @property
    def eval_seed(self) -> int:
        """The evaluation sweep's base seed (episode ``j`` is reset with ``eval_seed + j``)."""
        return self.seed + EVAL_SEED_OFFSET

    def _evaluate(self, groups: WorkerGroups, step: int, out_dir: Path, weights: dict | None = None) -> dict:
        info = run_sweep(groups, self.cfg, out_dir=out_dir, seed=self.eval_seed)
        if weights is not None:
            info["weights"] = weights
        write_eval_info(info, out_dir)
        plot_success(info, out_dir / "eval_success.png")
        return info

    # --- evaluation only ---------------------------------------------------------------------------------
    def run_eval(self) -> dict:
        """``embodirl eval``: the weights the command names (:meth:`eval_source`) scored into this evaluation's own
        folder, which it holds for the whole run; ``eval_info.json`` and the console record the weights."""
        with FolderLock(self.out):
            weights = weights_record(self.cfg.model.path, self.eval_source(), self.seed)
            check_eval_folder(self.out, weights)
            print(describe(weights), flush=True)
            with self.eval_workers() as (groups, step):
                info = self._evaluate(groups, step=step, out_dir=self.out, weights=complete_record(weights))
        print_table(info)
        print(describe(info["weights"]))
        print(f"eval_info: {self.out / 'eval_info.json'}")
        return info

    def eval_source(self) -> Path | None:
        """The run checkpoint evaluation loads over ``model.path``: the one ``runner.resume_dir`` names, never one found
        by itself in ``runner.output_dir``. A model checkpoint named there becomes ``model.path`` (in ``self.cfg``)."""
        model_path = ckpt.eval_model_path(self.cfg.runner)
        if model_path is not None:
            # runner.resume_dir names a model checkpoint (e.g. a public OpenVLA-OFT one): load it as model.path
            self.cfg = dataclasses.replace(self.cfg, model=dataclasses.replace(self.cfg.model, path=model_path),
                                           runner=dataclasses.replace(self.cfg.runner, resume_dir=layout.DISABLE))
        resume_dir = self.cfg.runner.resume_dir
        return None if resume_dir in (None, "", "auto") else ckpt.resume_source(resume_dir, "auto", self.out)

    @contextlib.contextmanager
    def eval_workers(self):
        """The evaluation-only workers (``embodirl eval``; ``embodirl compare`` builds them once per side and part
        of the sweep), acting with the weights under evaluation: ``model.path``'s, or those of the checkpoint
        ``runner.resume_dir`` names (:meth:`eval_source`). Writes the evaluation's ``config.yaml``; yields ``(groups,
        step)``, the checkpoint's step (0 without one)."""
        source = self.eval_source()
        self._write_config()
        seed_everything(self.seed)
        with self._workers(train=False) as groups:
            if source is not None:
                load_policy_weights(groups.policy, source, self.cfg)
                groups.inference.publish_weights(groups.policy.trainable_state_dict(), version=0, full=True)
            yield groups, (ckpt.checkpoint_step(source) if source else 0)

    # --- training -------------------------------------------------------------------------------------------
    def _resume_source(self) -> Path | None:
        """The checkpoint training starts from (:func:`~embodirl.runner.run_folder.training_start`), or after a
        restart the latest one."""
        return self._restart_source if self._restart_source is not None else self._start_source

    def _workers(self, *, train: bool) -> WorkerGroups:
        """The run's workers. The driver holds a policy object in this process (the one the actor rank trains and
        the inference worker acts with) and for evaluation (the one a checkpoint's trained weights are loaded into);
        training on Ray it holds none: inference workers and actor ranks build the policy with the same seeded
        initialisation."""
        cfg = self.cfg
        driver_policy = None if use_ray(cfg) and train else (lambda spec: make_policy(cfg.model, spec))
        return WorkerGroups.from_config(worker_config(cfg), train=train, policy_for=driver_policy)

    def _write_placement(self, groups: WorkerGroups, actors) -> None:
        """``placement.json``: where every worker landed (component, rank, pid, Ray node)."""
        plan = groups.placement[0] if groups.placement is not None else None

        def slot(component: str, rank: int):
            """The device (accelerator or CPU slot) id placement gave this worker."""
            return plan.slot(component, rank).device if plan is not None else None

        where = {"actor": [{**{k: info.get(k) for k in ("rank", "pid", "node_id", "device", "fsdp")},
                            "slot": slot("actor", i)} for i, info in enumerate(actors.infos)]}
        where["rollout"] = [{"rank": i, "pid": info.get("pid"), "node_id": info.get("node_id"),
                             "slot": slot("rollout", i)} for i, info in enumerate(groups.serving.infos)]
        if groups.env is not None:
            where["env"] = [{"rank": i, "pid": info.get("pid"), "node_id": info.get("node_id"),
                             "slot": slot("env", i)} for i, info in enumerate(groups.env.infos)]
        # renamed into place: a reader polling it during a restart never sees a half-written file
        tmp = self.out / f".placement.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(where, indent=1))
        os.replace(tmp, self.out / "placement.json")

    def run_train(self) -> None:
        """Train in the run's folder, held for the whole run; the folder rules
        (:func:`~embodirl.runner.run_folder.training_start`) pick the checkpoint it starts from or refuse it before
        any worker starts. A write that finds the disk full ends the run in one sentence naming the last complete
        checkpoint."""
        with FolderLock(self.out):
            self._start_source = training_start(self.cfg, self.out)
            self._write_config()
            if self.cfg.runner.predict_step_time:      # this config's parts timed here, the step predicted
                prediction.write_prediction(self.cfg, self.out)
            try:
                self._train_attempts()
                prediction.record_measured(self.out)   # the run's phase times beside any prediction
            except (ConfigError, RunFailed, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:             # torch's CheckpointException is a BaseException
                reason = no_room(exc)
                if reason is None:
                    raise
                latest = ckpt.latest_checkpoint(self.out)
                kept = f"the last complete checkpoint, {latest}, is kept" if latest else "no checkpoint was written yet"
                raise RunFailed(f"no room left to write in {self.out} ({reason}); {kept}: free space or lower "
                                "runner.keep_last, then run the same command to resume") from None

    def _train_attempts(self) -> None:
        """Train; with ``runner.max_restarts > 0`` an actor rank that dies, or a worker stuck past its deadline
        (``runner.worker_deadline.action: restart``), rebuilds every worker group and the run goes on from its last
        complete checkpoint. A preemption signal ends it with :class:`~embodirl.runner.preemption.Preempted`."""
        from embodirl.workers.actor_group import ActorRankDied
        from embodirl.workers.deadlines import WorkerHung

        states = heldout.check_states(self.cfg, eval_env_cfg(self.cfg))
        if not states.disjoint:         # allowed on purpose (train_init_states: official); the report says so too
            log.warning("training and evaluation states meet: %s", states.detail)
        restarts = self.cfg.runner.max_restarts
        for attempt in range(restarts + 1):
            seed_everything(self.seed)
            preempted = None
            try:
                with self._workers(train=True) as groups:
                    try:
                        self._train(groups)
                    except Preempted as exc:      # a clean stop: the workers close as at the end of a run
                        preempted = exc
                if preempted is not None:
                    raise preempted
                return
            except (ActorRankDied, WorkerHung) as exc:
                latest = ckpt.latest_checkpoint(self.out)
                where = (f"the last complete checkpoint is {latest}" if latest is not None
                         else "no checkpoint was written yet")
                if isinstance(exc, WorkerHung) and self.cfg.runner.worker_deadline.action == "stop":
                    raise RunFailed(f"{exc}; {where} (runner.worker_deadline.action=stop)") from None
                if attempt == restarts:
                    hint = "" if restarts else "; set runner.max_restarts=1 to rebuild the workers and go on from it"
                    raise RunFailed(f"{exc}; {where}{hint}") from None
                print(f"embodirl: {exc}; restarting ({attempt + 1} of {restarts}) from "
                      f"{latest if latest is not None else 'the start'}", flush=True)
                self._t_start = time.perf_counter()     # the checkpoint brings the minutes before it
                self._restart_source = latest if latest is not None else self._resume_source()

    def _train(self, groups: WorkerGroups) -> None:
        """One attempt's training steps (:class:`~embodirl.runner.training.TrainingRun`: the phases and their hooks)."""
        TrainingRun(self, groups).run()

    def _collect(self, groups: WorkerGroups, step: int, starts_rng: np.random.Generator) -> tuple:
        """``rollout.rollout_epoch`` rollouts -> one batch ``[N, T]`` and their summed timings; the first
        is recorded when this step is a training-video step."""
        cfg = self.cfg
        interval = cfg.runner.train_video_interval
        video_dir = self.out / "videos" / "train" if interval and step % interval == 0 else None
        batches, stats = [], RolloutStats()
        # algorithm.filter_groups.resample: draw rollouts until the step has a full batch of informative groups
        keeper = InformativeGroups.from_config(self.algorithm, num_slots=groups.num_slots,
                                               rollout_epoch=cfg.rollout.rollout_epoch)
        greedy_baseline = self.algorithm.estimator.greedy_baseline
        epoch, ticker = 0, Ticker()
        while keeper is not None or epoch < cfg.rollout.rollout_epoch:
            if epoch and ticker.due():   # a step of many rollouts (the 7B recipe's 16) says where it is
                most = cfg.rollout.rollout_epoch if keeper is None else f"at most {keeper.max_rollouts}"
                log.info("[step %d] collecting rollout %d of %s, %.1f min so far", step, epoch + 1, most,
                         ticker.elapsed / 60)
            starts = plan_starts(cfg.env.train, groups.spec, groups.num_slots, self.algorithm.group_size, starts_rng)
            seed = self.seed + 1_000_003 * step + 7_919 * epoch
            batch = groups.collect(starts, seed=seed, video_dir=video_dir if epoch == 0 else None, step=step)
            for key in ("env_s", "infer_s", "wait_s", "recollected_rows", "shm_batches", "object_store_batches"):
                setattr(stats, key, getattr(stats, key) + getattr(groups.stats, key))
            if greedy_baseline:   # (ReMax) the greedy rollout from the same starts: its own phase
                batch, seconds = remax_baseline(groups, batch, seed=seed)
                stats.baseline_s += seconds
            epoch += 1
            if keeper is None:
                batches.append(batch)
            elif keeper.add(batch):
                batches = [keeper.batch()]
                stats.rollouts_drawn, stats.rollouts_kept = keeper.drawn, min(keeper.kept_rows, keeper.target_rows)
                break
        return (D.concat(batches) if len(batches) > 1 else batches[0]), stats

    def _log_eval(self, logger: MetricsLogger, groups: WorkerGroups, step: int) -> float:
        out_dir = self.out / "eval" / step_folder(step)            # step_<n>, as checkpoints/step_<n>
        info = self._evaluate(groups, step, out_dir)
        o = info["overall"]
        elapsed = self._elapsed_min()
        low, high = o["success_rate_ci95"]
        logger.log(step, {"eval/success_rate": o["success_rate"], "eval/return": o["avg_return"],
                          "eval/episode_length": o["avg_length"], "eval/episodes": o["n_episodes"],
                          "eval/success_rate_ci95_low": low, "eval/success_rate_ci95_high": high,
                          "time/eval": o.get("eval_s", 0.0), "time/elapsed_min": elapsed})
        if "training_states" in info:   # runner.eval_train_states_per_task: success on trained starts beside held-out
            logger.log(step, {"eval/train_states_success_rate": info["training_states"]["overall"]["success_rate"]})
        self._dashboards(logger, step, info, out_dir)
        # the success curve so far, one line per evaluation
        self._curve.append((step, elapsed, o["success_rate"]))
        curve = "  ".join(f"{m:.1f}min:{sr:.2f}" for _, m, sr in self._curve[-8:])
        print(f"[eval step {step}] success {o['success_rate']:.2f} over {o['n_episodes']} episodes "
              f"at {elapsed:.1f} min | curve {curve}", flush=True)
        return float(o["success_rate"])

    def _dashboards(self, logger: MetricsLogger, step: int, info: dict, out_dir: Path) -> None:
        """``learning_curve.png`` in the run folder, rewritten from every evaluation in ``metrics.jsonl`` (so
        a resumed run's curve goes back to its start), and to TensorBoard / wandb with the first evaluation
        videos."""
        points = [{"step": r["step"], "minutes": r["time/elapsed_min"], "success_rate": r["eval/success_rate"],
                   "success_rate_ci95": (r["eval/success_rate_ci95_low"], r["eval/success_rate_ci95_high"])}
                  for r in read_metrics(logger.path) if "eval/success_rate_ci95_low" in r]
        curve = plot_learning_curve(points, self.out / "learning_curve.png")
        logger.log_image("eval/learning_curve", curve, step)
        for i, video in enumerate(info["overall"]["video_paths"][:EVAL_VIDEOS_LOGGED]):
            logger.log_video(f"eval/video_{i}", out_dir / video, step, fps=float(self.cfg.env.eval.video.fps))

    def _elapsed_min(self) -> float:
        """Minutes of this run (across resumes) since the command started (see ``__init__``)."""
        return self._elapsed_offset + (time.perf_counter() - self._t_start) / 60.0

    def _save(self, step: int, actors, starts_rng: np.random.Generator, env_steps: float = 0.0, *,
              groups: WorkerGroups | None = None, kl_coef: float = 0.0) -> Path:
        """Checkpoint ``step_<step>`` in the layout of :mod:`embodirl.runner.checkpoint`: the actor
        ranks write their shards and rank 0 the policy export (``groups``: where Ray inference workers'
        RNG states come from)."""
        worker_rng = None if groups is None else groups.rng_states()

        def write_policy(folder: Path) -> None:
            """Written with the actor state below (one call to the ranks)."""

        def write_actor(folder: Path) -> None:
            actors.save(folder.resolve(), (folder.parent / layout.POLICY).resolve())

        def write_runner(folder: Path) -> None:
            (folder / "state.json").write_text(json.dumps({"step": step, "starts_rng": starts_rng.bit_generator.state,
                                                           "env_steps": env_steps, "elapsed_min": self._elapsed_min(),
                                                           "kl_coef": kl_coef, "guard": self.guard.state_dict()}))
            ckpt.save_rng(folder)
            ckpt.save_worker_rng(folder, worker_rng)

        def write_config(folder: Path) -> None:
            (folder / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))

        path = ckpt.save_checkpoint(self.out, step, {layout.POLICY: write_policy, layout.ACTOR: write_actor,
                                                     layout.RUNNER: write_runner, layout.CONFIG: write_config},
                                    keep_last=self.cfg.runner.keep_last, keep=[self.guard.state.best_checkpoint])
        log.info("checkpoint: %s", path)
        return path


def worker_config(cfg: Config) -> Config:
    """The typed config the worker groups are built from: ``env.train`` with the configured video envs selected
    when training videos are asked for (rendered only during a recorded rollout), ``env.eval`` as
    evaluation runs it (:func:`~embodirl.runner.evaluation.eval_env_cfg`). A composed config is converted first."""
    cfg = run_config(cfg)
    train = cfg.env.train
    if cfg.runner.train_video_interval > 0:
        train = dataclasses.replace(train, video=dataclasses.replace(train.video, enabled=True))
    return dataclasses.replace(cfg, env=EnvSplits(train=train, eval=eval_env_cfg(cfg)))


def run(cfg: Config):
    """Train or evaluate (``runner.only_eval``) with the typed config (a composed one is converted)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runner = Runner(cfg)
    if runner.cfg.runner.only_eval:
        return runner.run_eval()
    return runner.run_train()
