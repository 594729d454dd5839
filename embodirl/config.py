"""Composing and checking the configuration before anything starts.

:func:`compose` builds the config from ``config/`` with Hydra overrides (the same tree the CLI
uses) on top of the typed schema (:mod:`embodirl.schema`, registered in Hydra's ConfigStore on import);
:func:`validate` checks types, ranges, choices and the cross-field rules of a composed config and raises
:class:`~embodirl.errors.ConfigError` with one sentence naming the key and the fix. Nothing here
creates files or starts workers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from embodirl import schema
from embodirl.errors import AssetsMissing, ConfigError
from embodirl.paths import config_dir

GROUPS = ("env", "model", "algorithm")
schema.register()     # config.yaml lists the schema first; hydra.main (the CLI) composes after this import


def available_options(group: str, root: Path | None = None) -> list[str]:
    """Option names of a config group (files starting with ``_`` are shared bases, not options)."""
    folder = (root or config_dir()) / group
    return sorted(p.stem for p in folder.glob("*.yaml") if not p.stem.startswith("_"))


def check_group_overrides(overrides: Sequence[str], root: Path | None = None) -> None:
    """Reject ``env=nope`` style choices (also inside sweeps ``env=a,b``) listing the available options."""
    for override in overrides:
        match = re.match(r"^(?:\+|\+\+|~)?(env|model|algorithm)(@[\w.]+)?=(.*)$", override.strip())
        if not match:
            continue
        group, value = match.group(1), match.group(3)
        value = re.sub(r"^(choice|glob)\((.*)\)$", r"\2", value)
        options = available_options(group, root)
        for choice in (v.strip().strip("'\"") for v in value.split(",")):
            if choice and "*" not in choice and choice not in options:
                raise ConfigError(group, f"unknown {group} '{choice}'; available: {', '.join(options)}")


def compose(overrides: Sequence[str] = (), *, config_path: Path | None = None, with_hydra: bool = False) -> DictConfig:
    """Compose ``config.yaml`` with ``overrides`` (Hydra syntax) and return it resolved-able.

    Hydra errors (unknown keys, bad syntax) become a one-sentence :class:`ConfigError`.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    root = Path(config_path) if config_path else config_dir()
    check_group_overrides(overrides, root)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(root), version_base=None):
            cfg = hydra_compose("config", overrides=list(overrides), return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as exc:
        raise _composition_error(exc) from None
    finally:
        GlobalHydra.instance().clear()
    # Resolve the ${hydra:...} interpolations now, while the Hydra config is at hand.
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)
    if not with_hydra:
        cfg = _without_hydra(cfg)
    return cfg


def sweep_jobs(overrides: Sequence[str], limit: int = 256) -> list[list[str]]:
    """The override lists of a ``-m`` sweep's jobs (``a=1,2 b=x,y``: four), so that every job's config is
    composed and checked before the first one starts; at most ``limit`` of them (the first ones)."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    choices: list[list[str]] = []
    for o in parsed:
        if o.is_sweep_override():
            choices.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            assert o.input_line is not None     # the parser keeps every override's own text
            choices.append([o.input_line])
    return [list(job) for job in itertools.islice(itertools.product(*choices), limit)]


def _without_hydra(cfg: DictConfig) -> DictConfig:
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)          # a DictConfig's container
    container.pop("hydra", None)
    out = OmegaConf.create(container)
    OmegaConf.set_struct(out, True)
    return out


def _composition_error(exc: Exception) -> ConfigError:
    """Hydra's composition errors as one sentence naming the key: a value the schema refuses (the OmegaConf
    error under Hydra's), a key that does not exist, or else Hydra's own first sentence."""
    from omegaconf.errors import OmegaConfBaseException

    cause: BaseException | None = exc
    while cause is not None and not (isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None)):
        cause = cause.__cause__
    if isinstance(cause, OmegaConfBaseException):     # the loop stopped on one (else: None)
        return schema.error(cause)
    text = " ".join(str(exc).split())
    missing = re.match(r"Could not override '([\w.]+)'", text)
    if missing:
        return schema.unknown_key(missing.group(1))
    return ConfigError("", text.split(" full_key:")[0].split(". ")[0].rstrip(".") + ".")


def validate(cfg: DictConfig, *, check_envs: bool = True, num_devices: int | None = None,
             accelerator: str | None = None, context: list | None = None) -> schema.Config:
    """Check types, ranges, choices and every cross-field rule (:func:`embodirl.schema.check`); raise
    :class:`ConfigError` on the first violation. Returns the typed config (:func:`embodirl.schema.run_config`), the
    object the run goes on with.

    ``check_envs`` also runs the simulator adapters' and policy's own checks (task ids, assets, model
    path), which may import the simulator packages. ``context``: a list that receives the check's
    :class:`embodirl.schema.Context` (the devices and the placement the run's plan is drawn from).
    """
    ctx = schema.check(cfg, num_devices=num_devices, accelerator=accelerator)
    run = ctx.config   # the typed config
    from embodirl.runner import rules as runner_rules

    runner_rules.check(run)

    if check_envs:
        from embodirl.envs.registry import check_env_config
        from embodirl.models.registry import get_policy_builder
        from embodirl.runner.checkpoint import eval_model_path

        for env_key, env in (("env.train", run.env.train), ("env.eval", run.env.eval)):
            try:
                check_env_config(env, env_key)
            except ConfigError as exc:
                if not exc.key.startswith("env."):
                    raise ConfigError(f"{env_key}.{exc.key}" if exc.key else env_key, str(exc).split(": ", 1)[-1]) from None
                raise
            except AssetsMissing:
                raise
        builder = get_policy_builder(run.model.name)
        if getattr(builder, "check_run", None) is not None:  # rules between the checkpoint and the run
            builder.check_run(run, eval_model_path(run.runner) or run.model.path)
        check = getattr(builder, "check_config", None)
        if check is not None:
            check(run.model)
    if context is not None:
        context.append(ctx)
    return run

