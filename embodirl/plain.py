"""Plain containers from OmegaConf nodes, for the code that takes plain configs (workers, actor, adapters).

Kept apart from :mod:`embodirl.config` (composition and the schema), which imports the modules it
checks; a module that needs plain dicts imports this leaf instead, so no import cycle can form.
"""

from __future__ import annotations

from collections.abc import Mapping

from omegaconf import DictConfig, OmegaConf


def to_plain(cfg: Mapping) -> dict:
    """A DictConfig (resolved) or any mapping as nested plain dicts, for code that takes plain configs."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return {k: to_plain(v) if isinstance(v, Mapping) else v for k, v in dict(cfg).items()}
