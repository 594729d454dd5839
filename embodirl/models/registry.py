"""Policies by name (``model.name`` in the config), imported lazily.

A policy builder is registered with :func:`register_policy` and called as
``builder(model_cfg: dict, env_spec: EnvSpec) -> Policy``; ``check_config(model_cfg)`` (optional
attribute of the builder) runs cheap checks before any worker starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from embodirl.errors import ConfigError

_POLICY_MODULES = {
    "openvla_oft": "embodirl.models.openvla_oft",
    "state_mlp": "embodirl.models.state_policy",
}
_POLICIES: dict[str, Any] = {}


def register_policy(name: str):
    def wrap(fn):
        _POLICIES[name] = fn
        return fn

    return wrap


def available_policies() -> list[str]:
    return sorted(set(_POLICY_MODULES) | set(_POLICIES))


def get_policy_builder(name: str, key: str = "model.name"):
    if name not in _POLICIES:
        module = _POLICY_MODULES.get(name)
        if module is None:
            raise ConfigError(key, f"unknown policy '{name}'; available: {', '.join(available_policies())}")
        importlib.import_module(module)
    return _POLICIES[name]


def make_policy(model_cfg: Mapping, env_spec):
    from embodirl.config import to_plain

    plain = to_plain(model_cfg)
    return get_policy_builder(plain["name"])(plain, env_spec)
