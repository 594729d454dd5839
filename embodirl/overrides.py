"""Overrides of a command's own config sections (``embodirl sft``'s ``sft``/``data``, ``embodirl compare``'s
``compare``), which live in their own YAML file beside the main config and are not Hydra groups: each ``key=value`` is
set into the sections loaded from that file, and the file's ``runner`` values fill the keys the command line leaves
alone."""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from embodirl.errors import ConfigError


def override_key(override: str) -> str:
    """The key of a ``key=value`` override (Hydra's ``+``/``~`` prefixes dropped)."""
    return override.split("=", 1)[0].lstrip("+~")


def apply_section_overrides(sections: DictConfig, overrides: Sequence[str], file_name: str) -> None:
    """Set ``key=value`` overrides into a command's own sections (``sections``, loaded from ``config/<file_name>``),
    each value read as YAML (``8`` -> 8, ``true`` -> True, ``null`` -> None). A key the sections do not have, or an
    override without a value, is one ConfigError sentence naming it."""
    import yaml

    for override in overrides:
        if "=" not in override:
            raise ConfigError(override_key(override), "needs a value (key=value)")
        key, text = override.split("=", 1)
        key = key.lstrip("+")
        if OmegaConf.select(sections, key, default="__missing__") == "__missing__":
            raise ConfigError(key, f"is not one of the {key.split('.')[0]} keys in config/{file_name}")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        OmegaConf.update(sections, key, value, merge=False)


def apply_runner_defaults(cfg: DictConfig, runner_defaults, overrides: Sequence[str]) -> None:
    """Set a command's own ``runner`` values (``runner_defaults``, from its config file) into ``cfg`` where the command
    line (``overrides``) leaves the key alone; ``output_dir`` may name ``{experiment_name}``."""
    given = {override_key(o) for o in overrides}
    OmegaConf.set_struct(cfg, False)
    for key, value in runner_defaults.items():
        if f"runner.{key}" not in given:
            if key == "output_dir":
                value = str(value).format(experiment_name=cfg.runner.experiment_name)
            cfg.runner[key] = value
    OmegaConf.set_struct(cfg, True)
