"""Policies by name (``model.name`` in the config), imported lazily.

A policy builder is registered with :func:`register_policy` and called as
``builder(model_cfg: dict, env_spec: EnvSpec) -> Policy``; ``check_config(model_cfg)`` (optional
attribute of the builder) runs cheap checks before any worker starts.
"""

from __future__ import annotations

from collections.abc import Mapping

from embodirl.registry import LazyRegistry

POLICIES = LazyRegistry("policy", "model.name", {
    "openvla_oft": "embodirl.models.openvla_oft",
    "pi0": "embodirl.models.pi0",
    "state_mlp": "embodirl.models.state_policy",
})
register_policy = POLICIES.register
available_policies = POLICIES.available


def get_policy_builder(name: str, key: str = "model.name"):
    return POLICIES.get(name, key)


def make_policy(model_cfg: Mapping, env_spec):
    from embodirl.plain import to_plain

    plain = to_plain(model_cfg)
    return get_policy_builder(plain["name"])(plain, env_spec)
