"""Simulator adapters by name, imported lazily (LIBERO is imported only when a LIBERO env is chosen).

An env config (one YAML under ``config/env/``) names its adapter with ``adapter: <name>``. An adapter
is a class registered with :func:`register_adapter` that provides

* ``check_config(cfg) -> None`` - cheap checks run before any worker starts (unknown task ids,
  suites, cameras, missing assets); raises :class:`embodirl.errors.ConfigError` /
  :class:`embodirl.errors.AssetsMissing` with one sentence;
* ``make(cfg, *, num_envs, seed, env_offset=0) -> ChunkVectorEnv`` - builds the batch of simulators.
"""

from __future__ import annotations

from collections.abc import Mapping

from embodirl.plain import to_plain
from embodirl.registry import LazyRegistry

ADAPTERS = LazyRegistry("simulator adapter", "env.adapter", {
    "libero": "embodirl.envs.libero.simulator",
    "maniskill": "embodirl.envs.maniskill.adapter",
    "toy": "embodirl.envs.toy",
})
register_adapter = ADAPTERS.register
available_adapters = ADAPTERS.available


def get_adapter(name: str, key: str = "env.adapter"):
    return ADAPTERS.get(name, key)


def check_env_config(cfg: Mapping, key: str = "env") -> None:
    adapter = get_adapter(cfg.get("adapter"), f"{key}.adapter")
    adapter.check_config(to_plain(cfg))


def make_env(cfg: Mapping, *, num_envs: int | None = None, seed: int = 0, env_offset: int = 0):
    """Build the :class:`~embodirl.envs.base.ChunkVectorEnv` an env config describes."""
    plain = to_plain(cfg)
    adapter = get_adapter(plain.get("adapter"))
    return adapter.make(plain, num_envs=num_envs or plain["num_envs"], seed=seed, env_offset=env_offset)
