"""Rollout backends by name (``rollout.backend``), imported lazily.

``huggingface`` is built in. A later engine (vLLM: GPU only) registers itself with
:func:`register_backend` in its own module and adds that module to ``_BACKEND_MODULES``; env workers,
rollout workers and the runner stay unchanged (see :mod:`embodirl.workers.backends.base`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from embodirl.errors import ConfigError

_BACKEND_MODULES = {
    "huggingface": "embodirl.workers.backends.huggingface",
}
_BACKENDS: dict[str, type] = {}


def register_backend(name: str):
    def wrap(cls):
        _BACKENDS[name] = cls
        return cls

    return wrap


def available_backends() -> list[str]:
    return sorted(set(_BACKEND_MODULES) | set(_BACKENDS))


def get_backend(name: str, key: str = "rollout.backend") -> type:
    if name not in _BACKENDS:
        module = _BACKEND_MODULES.get(name)
        if module is None:
            raise ConfigError(key, f"rollout backend '{name}' is not available here; available: "
                                   f"{', '.join(available_backends())}")
        importlib.import_module(module)
    return _BACKENDS[name]


def make_backend(name: str, model_cfg: Mapping, env_spec, **kwargs):
    """Build the backend ``name`` for ``model_cfg`` and the env's spec."""
    return get_backend(name)(model_cfg, env_spec, **kwargs)
