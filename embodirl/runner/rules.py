"""The config rules that need the runner's knowledge (how evaluation protocols seed their scenes, what a checkpoint
folder holds on disk): run by :func:`embodirl.config.validate` after the schema's, before anything starts. They
live here, not in :mod:`embodirl.schema`, so that the schema depends on nothing above it."""

from __future__ import annotations

from embodirl.runner import heldout
from embodirl.runner.checkpoint import eval_model_path, resume_source
from embodirl.runner.evaluation import check_eval_episodes, check_eval_num_envs, check_eval_protocol, eval_env_cfg


def check(cfg) -> None:
    """Raise :class:`~embodirl.errors.ConfigError` (one sentence naming the key) on the first violation; ``cfg``: the
    typed config (:func:`embodirl.schema.run_config`)."""
    check_eval_protocol(cfg.runner, cfg.env.eval)
    check_eval_episodes(cfg.runner)
    check_eval_num_envs(cfg.runner)
    heldout.check(cfg, eval_env_cfg(cfg))          # training starts apart from the evaluation's, unless on purpose
    # an explicit runner.resume_dir must hold a complete checkpoint (raises naming it; reads only); evaluation may
    # also name a model checkpoint there (loaded as model.path)
    if eval_model_path(cfg.runner) is None:
        resume_source(cfg.runner.resume_dir, cfg.runner.resume_mode, cfg.runner.output_dir)
