"""Policies by name (``model.name`` in the config), imported lazily.

A policy builder is registered with :func:`register_policy` and called as
``builder(model, env_spec: EnvSpec) -> Policy`` with ``model`` an instance of the config class it registered with
(:func:`model_config` converts a composed node once); ``check_config(model)`` (optional attribute of the builder)
runs cheap checks before any worker starts, and ``check_spec(model, env_spec)`` (optional too) the checks against the
env's spec, in the driver, once the first env worker has reported it (:func:`check_policy_spec`): a Ray worker that
built the policy would otherwise die with the sentence inside a traceback.
"""

from __future__ import annotations

from typing import Any

from embodirl.registry import LazyRegistry

POLICIES = LazyRegistry("policy", "model.name", {
    "openvla_oft": "embodirl.models.openvla_oft",
    "pi0": "embodirl.models.pi0",
    "state_mlp": "embodirl.models.state_policy",
}, common="embodirl.models.base.CommonModelConfig")
register_policy = POLICIES.register
available_policies = POLICIES.available


def get_policy_builder(name: str, key: str = "model.name"):
    return POLICIES.get(name, key)


def model_config(node: Any):
    """The ``model`` group as its policy's typed config (:class:`~embodirl.models.base.CommonModelConfig` or the
    subclass the policy registered with), converted once; an instance passes through."""
    return POLICIES.typed(node, "model")


def make_policy(model_cfg: Any, env_spec):
    model = model_config(model_cfg)
    return get_policy_builder(model.name)(model, env_spec)


def check_policy_spec(model_cfg: Any, env_spec) -> None:
    """The policy's cheap checks against ``env_spec`` (its builder's ``check_spec``; a :class:`ConfigError`), run
    where the driver learns the spec, before any inference worker or actor rank builds the policy."""
    model = model_config(model_cfg)
    check = getattr(get_policy_builder(model.name), "check_spec", None)
    if check is not None:
        check(model, env_spec)
