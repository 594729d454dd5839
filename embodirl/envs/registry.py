"""Simulator adapters by name, imported lazily (LIBERO is imported only when a LIBERO env is chosen).

An env config (one YAML under ``config/env/``) names its adapter with ``adapter: <name>``. An adapter
is a class registered with :func:`register_adapter` (with its config class) that provides, each taking the env split
as an instance of that class (:func:`env_config` converts a composed node once),

* ``check_config(cfg) -> None`` - cheap checks run before any worker starts (unknown task ids,
  suites, cameras, missing assets); raises :class:`embodirl.errors.ConfigError` /
  :class:`embodirl.errors.AssetsMissing` with one sentence;
* ``make(cfg, *, num_envs, seed, env_offset=0) -> ChunkVectorEnv`` - builds the batch of simulators;
* ``action_convention(cfg) -> ActionConvention`` - what the simulator consumes natively (its arm action space and
  gripper encoding, :mod:`embodirl.envs.conventions`), from the config alone: a run checks the policy's convention
  against it before any worker starts and converts the policy's chunks into it (:func:`make_env` records it in the
  batch's ``spec``).
"""

from __future__ import annotations

from typing import Any

from embodirl.registry import LazyRegistry

ADAPTERS = LazyRegistry("simulator adapter", "env.adapter", {
    "libero": "embodirl.envs.libero.simulator",
    "maniskill": "embodirl.envs.maniskill.adapter",
    "toy": "embodirl.envs.toy",
}, common="embodirl.envs.base.CommonEnvConfig")
register_adapter = ADAPTERS.register
available_adapters = ADAPTERS.available


def get_adapter(name: str, key: str = "env.adapter"):
    return ADAPTERS.get(name, key)


def env_config(node: Any, key: str = "env"):
    """An env split as its adapter's typed config (:class:`~embodirl.envs.base.CommonEnvConfig` or the subclass the
    adapter registered with), converted once; an instance passes through. The adapters and workers run on it."""
    return ADAPTERS.typed(node, key)


def check_env_config(cfg: Any, key: str = "env") -> None:
    env = env_config(cfg, key)
    get_adapter(env.adapter, f"{key}.adapter").check_config(env)


def env_convention(cfg: Any, key: str = "env"):
    """The :class:`~embodirl.envs.conventions.ActionConvention` an env split's adapter declares (None: it declares
    none)."""
    env = env_config(cfg, key)
    declare = getattr(get_adapter(env.adapter, f"{key}.adapter"), "action_convention", None)
    return declare(env) if declare is not None else None


def make_env(cfg: Any, *, num_envs: int | None = None, seed: int = 0, env_offset: int = 0):
    """Build the :class:`~embodirl.envs.base.ChunkVectorEnv` an env split (typed, or a mapping of it) describes; its
    ``spec`` carries the adapter's action convention."""
    import dataclasses

    env = env_config(cfg)
    venv = get_adapter(env.adapter).make(env, num_envs=num_envs or env.num_envs, seed=seed, env_offset=env_offset)
    venv.spec = dataclasses.replace(venv.spec, action_convention=env_convention(env))
    return venv
