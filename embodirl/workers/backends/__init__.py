"""Rollout backends by name (``rollout.backend``), imported lazily.

``huggingface`` is built in. A later engine (vLLM: GPU only) registers itself with :func:`register_backend` in its
own module and adds that module to the built-in table of ``BACKENDS`` (:mod:`embodirl.registry`); env workers,
inference workers and the runner stay unchanged (see :mod:`embodirl.workers.backends.base`).
"""

from __future__ import annotations

from collections.abc import Mapping

from embodirl.registry import BACKENDS

register_backend = BACKENDS.register
available_backends = BACKENDS.available


def get_backend(name: str, key: str = "rollout.backend") -> type:
    return BACKENDS.get(name, key)


def make_backend(name: str, model_cfg: Mapping, env_spec, **kwargs):
    """Build the backend ``name`` for ``model_cfg`` and the env's spec."""
    return get_backend(name)(model_cfg, env_spec, **kwargs)
