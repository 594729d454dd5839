"""Typed env splits (``env.train``, ``env.eval``): each adapter declares its config class next to its code and
registers with it (``@register_adapter(name, config=...)``, a subclass of
:class:`~embodirl.envs.base.CommonEnvConfig`); this module finds it and holds the rules between the env splits and
the model. The adapters still check the values only they know (task ids, suites, cameras, assets).

An adapter registered without a config class gets the common keys checked; its own keys are its ``check_config``'s.
"""

from typing import Any

from embodirl.errors import ConfigError


def env_schema(node: Any, key: str) -> tuple[type, bool]:
    """(schema, closed) for one env split: the config class its adapter registered with (closed: it refuses keys it
    does not declare), else :class:`~embodirl.envs.base.CommonEnvConfig` for the shared keys (open)."""
    from embodirl.envs.base import CommonEnvConfig
    from embodirl.envs.registry import ADAPTERS

    adapter = node.get("adapter") if hasattr(node, "get") else None
    if not isinstance(adapter, str):
        raise ConfigError(f"{key}.adapter", "is missing; an env option names its simulator adapter")
    declared = ADAPTERS.config_class(adapter)
    return (declared, True) if declared is not None else (CommonEnvConfig, False)


def env_rules(cfg) -> None:
    """Rules between the env splits and the model (``cfg``: the typed config): a chunk must fit in an episode,
    evaluation drives the robot through the controller the policy was trained with (its action space), where both
    splits' adapters have one (``control_mode``), and the policy's action convention converts to what each env split's
    adapter consumes (:func:`embodirl.envs.conventions.pairing`)."""
    for env_key, env in (("env.train", cfg.env.train), ("env.eval", cfg.env.eval)):
        action_conversion(cfg, env_key, env)
    train_mode = getattr(cfg.env.train, "control_mode", None)
    eval_mode = getattr(cfg.env.eval, "control_mode", None)
    both = hasattr(cfg.env.train, "control_mode") and hasattr(cfg.env.eval, "control_mode")
    if both and train_mode != eval_mode:
        raise ConfigError("env.eval.control_mode", f"is {eval_mode} but env.train.control_mode is {train_mode}; the "
                                                   f"policy acts in the training action space, so set both "
                                                   f"(env.eval.control_mode={train_mode})")
    H = cfg.model.action_chunk
    for env_key, env in (("env.train", cfg.env.train), ("env.eval", cfg.env.eval)):
        steps = env.max_episode_steps
        if H > steps:
            raise ConfigError("model.action_chunk", f"the chunk of {H} actions is longer than {env_key}.max_episode_steps "
                                                    f"= {steps}")


def action_conversion(cfg, env_key: str, env=None):
    """The :class:`~embodirl.envs.conventions.ActionConversion` from the configured policy's actions to what the env
    split ``env_key`` (``env.train`` / ``env.eval``) consumes; a ConfigError (one sentence naming the key) when either
    side declares none or they cannot be converted. ``cfg``: the typed config."""
    from embodirl.envs.conventions import pairing
    from embodirl.envs.registry import env_convention
    from embodirl.models.registry import policy_convention

    env = env if env is not None else (cfg.env.train if env_key == "env.train" else cfg.env.eval)
    return pairing(policy_convention(cfg.model), env_convention(env, env_key), model_name=cfg.model.name,
                   env_key=env_key, adapter=env.adapter)
