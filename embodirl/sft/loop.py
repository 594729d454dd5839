"""The SFT run: dataset -> statistics -> the RL path's actor group, one ``sft_train`` call per step.

::

    dataset  = LeRobotDataset(data.path, action_chunk=model.action_chunk)
    stats    = dataset_statistics(dataset, unnorm_key)        # -> output_dir/dataset_statistics.json
    actors   = ActorGroup.local(cfg, spec); actors.set_statistics(stats)
    for step: metrics = actors.sft_train(make_batch(batch_indices(step)), options)   # Actor.sft_update
    every runner.save_interval steps and at the end: checkpoints/step_<n>/ with
        model/    the public OpenVLA-OFT/peft layout (`embodirl train|eval model.path=<it>`), marked
                  action_tokens_trained (autoconfig's RL-ready check)
        actor/  policy/  runner/  config/     as `embodirl train` writes them (resume)
    every runner.val_check_interval steps: the runner's evaluation (Runner.run_eval) of that step's model/

Resume: ``runner.resume_mode=auto`` continues from the latest complete checkpoint of ``runner.output_dir``
(actor state through ``ActorGroup.load``; the batches are a function of the step, see :mod:`.data`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from embodirl import checkpoint_layout as layout
from embodirl.atomic_folder import remove_stale
from embodirl.models.openvla_oft.hf_checkpoint import TOKENS_TRAINED
from embodirl.models.registry import SFT_TOKENS, policy_family
from embodirl.runner import checkpoint as ckpt
from embodirl.runner.checkpoint import load_actor_state
from embodirl.runner.loop import seed_everything
from embodirl.runner.metrics_logger import MetricsLogger
from embodirl.sft.data import BatchMaker, batch_indices, dataset_statistics
from embodirl.sft.section import SftSections

log = logging.getLogger(__name__)
MODEL = "model"
STATISTICS_FILE = "dataset_statistics.json"


def unnorm_key(cfg: DictConfig, spec) -> str:
    """The statistics entry's name: ``model.unnorm_key``, else the env's name - what the policy looks up when
    ``model.unnorm_key`` is null, so ``embodirl train|eval model.path=<checkpoint>`` in this env need no flag."""
    from embodirl.envs.registry import env_config
    from embodirl.models.registry import model_config

    # keys of OpenVLA-OFT's model and of ManiSkill's env config classes
    return str(getattr(model_config(cfg.model), "unnorm_key", None) or spec.name
               or getattr(env_config(cfg.env.train, "env.train"), "task", None) or "dataset")


def _evaluate(cfg: DictConfig, model_dir: Path, out_dir: Path) -> dict:
    """The runner's evaluation of the exported model (``embodirl eval model.path=<model_dir>``)."""
    from embodirl.runner.loop import Runner
    from embodirl.schema import run_config
    from embodirl.sft.compose import main_config

    eval_cfg = main_config(cfg)
    with open_dict(eval_cfg):
        eval_cfg.model.path = str(model_dir)
        eval_cfg.runner.only_eval = True
        eval_cfg.runner.output_dir = str(out_dir)
        eval_cfg.runner.resume_dir = None
        eval_cfg.runner.resume_mode = "disable"
        eval_cfg.runner.logger.tensorboard = False
        eval_cfg.runner.logger.wandb = False
    # an evaluation of this step by an attempt of this run that was cut short is done again (of the weights now there)
    (out_dir / "eval_info.json").unlink(missing_ok=True)
    return Runner(run_config(eval_cfg)).run_eval()


def run(cfg: DictConfig, own: SftSections, dataset, spec, camera_keys: list[str]) -> Path | None:
    """Train (``own``: the typed ``sft`` and ``data`` sections :func:`embodirl.sft.compose.check` returned); returns
    the last checkpoint's public model folder (None: resumed at or past ``runner.max_steps`` from a checkpoint of
    another folder, so this one has none)."""
    from embodirl.schema import run_config
    from embodirl.workers.actor_group import ActorGroup

    r, s = cfg.runner, own.sft
    out = Path(r.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for folder in (out / "eval").glob("step_*"):     # an evaluation's model export that a kill cut short
        remove_stale(folder)
    seed = int(r.seed)
    seed_everything(seed)
    key = unnorm_key(cfg, spec)
    statistics = dataset_statistics(dataset, key)
    make_batch = BatchMaker(dataset, statistics[key], camera_keys, use_state=dataset.state_key is not None
                            and bool(spec.state_dim), normalization=str(cfg.model.normalization))
    options = s.actor_options(policy_family(cfg.model.name).sft == SFT_TOKENS)
    actors = ActorGroup.local(run_config(cfg), spec)
    try:
        actors.set_statistics(statistics)
        start_step = 0
        source = ckpt.resume_source(r.resume_dir, r.resume_mode, out)
        if source is not None:
            start_step = ckpt.checkpoint_step(source)
            load_actor_state(actors, source, cfg)     # another model's checkpoint: one sentence, nothing overwritten
            log.info("resumed from %s (step %d)", source, start_step)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        (out / STATISTICS_FILE).write_text(json.dumps(statistics, indent=2))
        lc = r.logger
        container = OmegaConf.to_container(cfg)
        assert isinstance(container, dict)      # a DictConfig's container
        logger = MetricsLogger(out, console=lc.console, tensorboard=lc.tensorboard, wandb=lc.wandb,
                               wandb_mode=lc.wandb_mode, project=lc.project, run_name=f"sft_{r.experiment_name}",
                               config=container, resume_step=start_step)
        max_steps = int(r.max_steps)
        assert own.data.path is not None        # compose.check refused an unset one
        marker = {TOKENS_TRAINED: s.token_loss,
                  "sft": {"dataset": str(Path(own.data.path).resolve()), "unnorm_key": key,
                          "episodes": int(dataset.num_episodes), "frames": int(len(dataset))}}
        progress = None
        if r.progress_bar:
            from tqdm import tqdm

            progress = tqdm(total=max_steps, initial=start_step, desc="sft", unit="step", leave=False)
        last_model = None
        try:
            for step in range(start_step + 1, max_steps + 1):
                t0 = time.perf_counter()
                batch = make_batch(batch_indices(len(dataset), s.batch_size, step, seed))
                t1 = time.perf_counter()
                metrics = actors.sft_train(batch, options)
                t2 = time.perf_counter()
                metrics.update({"time/data": t1 - t0, "time/update": t2 - t1, "time/step": t2 - t0,
                                "sft/samples_per_s": s.batch_size / max(t2 - t0, 1e-9),
                                "sft/epoch": (step * s.batch_size) / len(dataset)})
                logger.log(step, metrics)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{metrics['sft/loss']:.3f}",
                                         acc=f"{metrics.get('sft/token_accuracy', float('nan')):.2f}")
                saving = step == max_steps or (r.save_interval and step % int(r.save_interval) == 0)
                evaluating = bool(r.val_check_interval) and step % int(r.val_check_interval) == 0
                if saving:
                    last_model = _save(cfg, actors, out, step, marker) / MODEL
                if evaluating:
                    _evaluate_step(cfg, actors, out, step, marker, logger, model=last_model if saving else None)
        finally:
            if progress is not None:
                progress.close()
            logger.close()
    finally:
        actors.close()
    if last_model is None:     # resumed at or past max_steps
        latest = ckpt.latest_checkpoint(out)
        last_model = latest / MODEL if latest is not None else None
    return last_model


def _evaluate_step(cfg: DictConfig, actors, out: Path, step: int, marker: dict, logger: MetricsLogger,
                   model: Path | None) -> None:
    """Evaluate step ``step``'s model, the export of its checkpoint (``model``) or, at a step without a checkpoint,
    one exported into the evaluation's folder; its success goes to the metrics and the console."""
    folder = out / "eval" / f"step_{step}"
    if model is None:
        model = folder / MODEL
        actors.export(model, step, marker)
    info = _evaluate(cfg, model, folder)
    o = info["overall"]
    logger.log(step, {"eval/success_rate": o["success_rate"], "eval/return": o["avg_return"],
                      "eval/episode_length": o["avg_length"], "eval/episodes": o["n_episodes"]})
    print(f"[sft eval step {step}] success {o['success_rate']:.2f} over {o['n_episodes']} episodes", flush=True)


def _save(cfg: DictConfig, actors, out: Path, step: int, marker: dict) -> Path:
    """``checkpoints/step_<step>``: the public model export plus what ``embodirl train`` writes to resume."""

    def write_model(folder: Path) -> None:
        actors.export(folder.resolve(), step, marker)

    def write_policy(folder: Path) -> None:
        """Written with the actor state below (one call to the ranks)."""

    def write_actor(folder: Path) -> None:
        actors.save(folder.resolve(), (folder.parent / layout.POLICY).resolve())

    def write_runner(folder: Path) -> None:
        (folder / "state.json").write_text(json.dumps({"step": step}))
        ckpt.save_rng(folder)

    def write_config(folder: Path) -> None:
        (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg))

    path = ckpt.save_checkpoint(out, step, {MODEL: write_model, layout.POLICY: write_policy, layout.ACTOR: write_actor,
                                            layout.RUNNER: write_runner, layout.CONFIG: write_config},
                                keep_last=cfg.runner.keep_last)
    log.info("checkpoint: %s", path)
    return path
