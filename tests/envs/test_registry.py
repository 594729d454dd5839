"""Adding an environment is one YAML file naming a registered adapter: no code change."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from omegaconf import OmegaConf

from embodirl import schema
from embodirl.config import compose
from embodirl.envs.registry import available_adapters, check_env_config, get_adapter, make_env
from embodirl.errors import ConfigError
from embodirl.paths import config_dir

# a new task family written from scratch: two colours, state only, another action size and reward
STANDALONE = textwrap.dedent("""
    # @package env.train
    # Two-colour toy reach with state observations (a test's new environment).
    adapter: toy
    name: toy_two_state
    num_envs: 3
    max_episode_steps: 12
    num_tasks: 2
    task_ids: [1]
    image_size: [32, 32]
    cameras: []
    state_obs: true
    action_dim: 4
    step_size: 0.1
    reward_mode: dense
    processes: false
    step_timeout_s: 60
    hang_at_step: null
    hang_marker: null
    crash_init_state: null
    reward_coef: 0.5
    use_rel_reward: false
    reward_type: action_level
    auto_reset: true
    ignore_terminations: false
    use_fixed_reset_state_ids: false
    init_state_ids: null
    num_init_states: 5
    num_trials_per_task: 2
    video: {enabled: false, env_ids: [0], fps: 10, overlay: true}
""")

# a variant of an existing option: inherit toy_reach, change a few keys
DERIVED = textwrap.dedent("""
    # @package env.train
    # toy_reach with eight colours on 96x96 images.
    defaults:
      - toy_reach@_here_
      - _self_

    name: toy_eight
    num_tasks: 8
    image_size: [96, 96]
""")


@pytest.fixture
def config_copy(tmp_path):
    root = tmp_path / "config"
    shutil.copytree(config_dir(), root)
    (root / "env" / "toy_two_state.yaml").write_text(STANDALONE)
    (root / "env" / "toy_eight.yaml").write_text(DERIVED)
    return root


def test_new_yaml_builds_an_env_without_code(config_copy):
    cfg = compose(["env=toy_two_state"], config_path=config_copy)
    env_cfg = cfg.env.train
    assert OmegaConf.select(cfg, "env.eval.name") == "toy_two_state"
    schema.check_types(cfg)   # the file gives every key the adapter's config class declares
    check_env_config(env_cfg)
    with make_env(env_cfg, seed=0) as venv:
        assert venv.num_envs == 3
        spec = venv.spec
        assert (spec.action_dim, spec.max_episode_steps, spec.state_dim, spec.camera_names) == (4, 12, 4, [])
        assert spec.task_descriptions == ["move to the red square", "move to the green square"]
        obs, info = venv.reset(seed=0)
        assert set(obs) == {"state", "task_id"} and (obs["task_id"] == 1).all()   # task_ids: [1]
        assert (info["init_state_id"] < 5).all()
        obs, reward, terminated, truncated, info = venv.step(np.zeros((3, 6, 4), np.float32))
        assert reward.shape == (3, 6)                                            # action_level
        np.testing.assert_array_equal(info["steps"], [6, 6, 6])
        obs, reward, terminated, truncated, info = venv.step(np.zeros((3, 6, 4), np.float32))
        assert truncated.all() and info["_final_obs"].all()                     # auto_reset at 12 steps


def test_derived_yaml_changes_settings(config_copy):
    cfg = compose(["env=toy_eight", "env.train.num_envs=2"], config_path=config_copy)
    with make_env(cfg.env.train, seed=0) as venv:
        assert venv.num_envs == 2 and venv.spec.name == "toy_eight"
        assert len(venv.spec.task_descriptions) == 8 and venv.spec.image_size == (96, 96)
        obs, _ = venv.reset(task_ids=[7, 6])
        assert obs["images"].shape == (2, 1, 3, 96, 96)


def test_unknown_adapter_is_one_sentence(config_copy):
    (config_copy / "env" / "bad.yaml").write_text("# @package env.train\nadapter: gazebo\nnum_envs: 1\n"
                                                 "max_episode_steps: 10\n")
    cfg = compose(["env=bad"], config_path=config_copy)
    with pytest.raises(ConfigError, match="env.train.adapter: unknown simulator adapter 'gazebo'; available: "
                                          "libero, maniskill, toy"):
        check_env_config(cfg.env.train, key="env.train")
    assert {"libero", "maniskill", "toy"} <= set(available_adapters())
    assert get_adapter("toy").__name__ == "ToyAdapter"


def test_adapters_are_imported_lazily():
    # choosing the toy task must not import LIBERO's or ManiSkill's simulators
    code = textwrap.dedent("""
        import sys
        from embodirl.config import compose
        from embodirl.envs.registry import make_env
        venv = make_env(compose(["env=toy_reach"]).env.train, num_envs=2)
        venv.reset(seed=0)
        venv.close()
        heavy = sorted(m for m in ("robosuite", "libero", "mani_skill", "sapien", "mujoco") if m in sys.modules)
        print(",".join(heavy))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"imported {out.stdout.strip()}"
