"""Typed model groups (``model``): each policy declares its config class next to its code and registers with it
(``@register_policy(name, config=...)``, a subclass of :class:`~embodirl.models.base.CommonModelConfig`); this module
finds it and holds the rules between the model, the algorithm and the disk. The policies' own ``check_config`` (and
OpenVLA-OFT's checkpoint rules) still check what only they know. A policy registered without a config class has its
``name``, ``action_chunk`` and ``value_type`` typed and the rest left to its builder.
"""

import re
from pathlib import Path
from typing import Any

from embodirl.errors import ConfigError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_schema(node: Any) -> tuple[type, bool]:
    from embodirl.models.base import CommonModelConfig
    from embodirl.models.registry import POLICIES

    name = node.get("name") if hasattr(node, "get") else None
    if not isinstance(name, str):
        raise ConfigError("model.name", "is missing; a model option names its policy")
    declared = POLICIES.config_class(name)
    return (declared, True) if declared is not None else (CommonModelConfig, False)


def model_rules(cfg) -> None:
    """Rules between the model, the algorithm and the disk (``cfg``: the typed config)."""
    from embodirl.algorithms.estimators import uses_critic
    from embodirl.models.registry import policy_family

    adv_type, value_type = cfg.algorithm.adv_type, cfg.model.value_type
    critic = uses_critic(adv_type)
    if value_type is not None and not policy_family(cfg.model.name).value_head:
        raise ConfigError("model.value_type", f"is {value_type}, but {cfg.model.name} is registered without a value head; "
                                              "set model.value_type=null (and an estimator without a critic, e.g. "
                                              "algorithm=grpo)")
    if critic and value_type is None:
        raise ConfigError("model.value_type", f"adv_type={adv_type} needs a value head: set model.value_type to "
                                              "chunk_level or action_level")
    if cfg.algorithm.reward_type == "action_level" and value_type == "chunk_level" and critic:
        raise ConfigError("model.value_type", "action_level rewards with GAE need action_level values; set "
                                              "model.value_type=action_level")
    path = cfg.model.path
    if path:
        local = Path(str(path)).expanduser()
        if not local.exists() and (str(path).startswith((".", "/", "~")) or not _HUB_ID.match(str(path))):
            raise ConfigError("model.path", f"'{path}' does not exist; give a checkpoint directory or a hub id like "
                                            "org/name")
