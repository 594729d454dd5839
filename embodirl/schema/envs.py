"""Typed env groups (``env.train``, ``env.eval``): the keys every simulator adapter shares, and each built-in
adapter's own. The adapters (``embodirl/envs/*``) still check the values only they know (task ids, suites,
cameras, assets); this module gives every key a type and a range and refuses keys no adapter reads.

An adapter registered by a user gets the common keys checked; its own keys are its ``check_config``'s.
"""

from dataclasses import dataclass
from typing import Any

from embodirl.errors import ConfigError
from embodirl.schema.fields import num, one_of, required, section
from embodirl.schema.sections import reward_types


def _adapters():
    from embodirl.envs.registry import available_adapters
    return available_adapters()


@dataclass
class Video:
    enabled: bool = required()
    env_ids: list[int] = required()
    fps: int = num(1)
    overlay: bool = required()


@dataclass
class CommonEnv:
    adapter: str = one_of(_adapters)
    num_envs: int = num(1)
    max_episode_steps: int = num(1)
    step_timeout_s: float | None = num(0, lo_open=True, null=True)    # null: wait for ever
    reward_coef: float = required()
    use_rel_reward: bool = required()
    reward_type: str = one_of(reward_types)
    auto_reset: bool = required()
    ignore_terminations: bool = required()
    use_fixed_reset_state_ids: bool = required()
    init_state_ids: list[int] | None = required()
    num_trials_per_task: int = num(1)
    video: Video = section(Video)


@dataclass
class ToyEnv(CommonEnv):
    name: str = required()
    num_tasks: int = num(1, 8)
    task_ids: list[int] | None = required()
    image_size: list[int] = required()
    cameras: list[str] = required()
    state_obs: bool = required()
    action_dim: int = num(2)
    step_size: float = num(0, lo_open=True)
    reward_mode: str = required()
    processes: bool = required()
    hang_at_step: int | None = num(1, null=True)
    hang_marker: str | None = required()
    crash_init_state: int | None = num(0, null=True)
    num_init_states: int = num(1)


@dataclass
class ManiSkillEnv(CommonEnv):
    task: str = required()
    obs_mode: str = required()
    control_mode: str | None = required()
    reward_mode: str = required()
    cameras: list[str] | None = required()
    image_size: list[int] = required()
    sim_backend: str = required()
    num_init_states: int | None = num(1, null=True)


@dataclass
class LiberoEnv(CommonEnv):
    suite: str = required()
    task_ids: list[int] | None = required()
    num_settle_steps: int = num(0)
    cameras: list[str] = required()
    image_size: list[int] = required()
    assets_path: str | None = required()
    max_cached_tasks: int = num(1)
    scene_seeding: str = required()


#: adapter name -> its schema (an adapter not listed is typed by :class:`CommonEnv`, its own keys left open)
ENV_SCHEMAS: dict[str, type] = {"toy": ToyEnv, "maniskill": ManiSkillEnv, "libero": LiberoEnv}


def env_schema(node: Any, key: str) -> tuple[type, bool]:
    """(schema, closed) for one env group: closed schemas refuse keys they do not declare."""
    adapter = node.get("adapter") if hasattr(node, "get") else None
    if not isinstance(adapter, str):
        raise ConfigError(f"{key}.adapter", "is missing; an env option names its simulator adapter")
    if adapter in ENV_SCHEMAS:
        return ENV_SCHEMAS[adapter], True
    return CommonEnv, False


def env_rules(cfg) -> None:
    """Rules between the env groups and the model: a chunk must fit in an episode, and evaluation drives the
    robot through the controller the policy was trained with (its action space)."""
    train_mode, eval_mode = cfg.env.train.get("control_mode"), cfg.env.eval.get("control_mode")
    if "control_mode" in cfg.env.train and "control_mode" in cfg.env.eval and train_mode != eval_mode:
        raise ConfigError("env.eval.control_mode", f"is {eval_mode} but env.train.control_mode is {train_mode}; the "
                                                   f"policy acts in the training action space, so set both "
                                                   f"(env.eval.control_mode={train_mode})")
    H = int(cfg.model.action_chunk)
    for env_key in ("env.train", "env.eval"):
        steps = int(cfg.env[env_key.split(".")[1]].max_episode_steps)
        if H > steps:
            raise ConfigError("model.action_chunk", f"the chunk of {H} actions is longer than {env_key}.max_episode_steps "
                                                    f"= {steps}")
