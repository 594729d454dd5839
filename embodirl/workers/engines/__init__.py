"""Inference engines by name (``rollout.backend``), imported lazily.

``huggingface`` is built in. A later engine (vLLM: GPU only) registers itself with :func:`register_engine` in its
own module and adds that module to the built-in table of ``ENGINES`` (:mod:`embodirl.registry`); env workers,
inference workers and the runner stay unchanged (see :mod:`embodirl.workers.engines.base`).
"""

from __future__ import annotations

from collections.abc import Mapping

from embodirl.registry import ENGINES

register_engine = ENGINES.register
available_engines = ENGINES.available


def get_engine(name: str, key: str = "rollout.backend") -> type:
    return ENGINES.get(name, key)


def make_engine(name: str, model_cfg: Mapping, env_spec, **kwargs):
    """Build the engine ``name`` for ``model_cfg`` and the env's spec."""
    return get_engine(name)(model_cfg, env_spec, **kwargs)
