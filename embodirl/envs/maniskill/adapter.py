"""``adapter: maniskill``: checks a ManiSkill env split and builds its simulators, one process per scene
(:mod:`embodirl.envs.maniskill.simulator`) or one batched GPU scene (:mod:`embodirl.envs.maniskill.gpu`).

Kept apart from both, which it chooses between, so that neither imports the other's chooser.
"""

from __future__ import annotations

import functools

from embodirl.envs.base import TrainingStates
from embodirl.envs.conventions import ActionConvention
from embodirl.envs.maniskill import simulator
from embodirl.envs.maniskill.simulator import GPU_BACKEND, ManiSkillEnvConfig, check_config, make_sim_env, resolve_sim_backend
from embodirl.envs.registry import register_adapter


@register_adapter("maniskill", config=ManiSkillEnvConfig)
class ManiSkillAdapter:
    """``adapter: maniskill`` (config/env/_maniskill_base.yaml)."""

    @staticmethod
    def check_config(cfg) -> None:
        """Unknown task id (with close matches), unsupported obs/reward/control mode or camera (with
        the choices), the GPU simulator without CUDA: :class:`ConfigError`; missing downloadable data:
        :class:`~embodirl.errors.AssetsMissing` with the command that fetches it."""
        check_config(cfg)

    @staticmethod
    def eval_schedule(cfg) -> list[tuple[int, int]]:
        """Ordered ``(task_id, init_state_id)`` pairs of an evaluation sweep (:func:`.simulator.eval_schedule`)."""
        return simulator.eval_schedule(simulator.settings_of(cfg))

    @staticmethod
    def training_states(train_cfg, eval_cfg) -> TrainingStates:
        """Where ``train_cfg``'s episodes start beside ``eval_cfg``'s sweep (:func:`.simulator.training_states`)."""
        return simulator.training_states(simulator.settings_of(train_cfg), simulator.settings_of(eval_cfg))

    @staticmethod
    def action_convention(cfg) -> ActionConvention:
        """The controller's own actions (:func:`.simulator.action_convention`)."""
        return simulator.action_convention(simulator.settings_of(cfg))

    @staticmethod
    def make(cfg, *, num_envs: int, seed: int, env_offset: int = 0):
        """``num_envs`` ManiSkill scenes; sub-env ``i`` draws random init states with seed
        ``seed + env_offset + i``."""
        settings = check_config(cfg)
        if resolve_sim_backend(settings.sim_backend) == GPU_BACKEND:
            from embodirl.envs.maniskill.gpu import ManiSkillGPUEnv

            return ManiSkillGPUEnv(settings, num_envs=num_envs, seed=seed + env_offset, env_offset=env_offset)
        from embodirl.envs.vector.vector_env import ProcessVectorEnv

        factories = [functools.partial(make_sim_env, settings, seed + env_offset + i) for i in range(num_envs)]
        return ProcessVectorEnv.from_config(factories, settings, env_offset=env_offset,
                                            preload=("embodirl.envs.maniskill.preload",))
