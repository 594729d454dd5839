"""``embodirl demos [overrides]``: scripted-expert demonstrations of a ManiSkill task as a LeRobot dataset.

The primary config is ``config/demos.yaml`` (its ``env`` group is the tree ``embodirl train`` uses). Each attempt
``k`` resets the adapter's own simulator (:class:`~embodirl.envs.maniskill.simulator.ManiSkillSimEnv`) to init state
``seed + k`` (ManiSkill episode seed; by default ``seed`` is the env's first training state, held out from the
evaluation's seeds), lets the task's expert (:mod:`embodirl.demos.experts`) act one control
step at a time, and records the adapter's observation before each step (camera images, the flattened
state as proprio) with the action taken and the env's instruction. Successful episodes are written with
:class:`~embodirl.demos.lerobot.writer.LeRobotWriter` (``meta/episodes.jsonl`` keeps each episode's
``init_state_id``, so that its actions replay in the adapter from the same seed); failed attempts are dropped.
A summary (attempts, expert success rate, demos per minute, dataset size) goes to ``meta/generation.json``
and the console.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from embodirl.config_fields import num, one_of, required
from embodirl.demos.lerobot.layout import VIDEO_CODECS
from embodirl.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)
CONFIG_NAME = "demos"


@dataclass
class DemosConfig:
    """``config/demos.yaml`` as the object generation runs on: each key's type and range declared once here
    (:mod:`embodirl.config_fields`), its value in the YAML. ``env``: the ManiSkill env split's ``train`` options as the
    adapter's typed config (:func:`validate` fills it in)."""

    num_episodes: int = num(1)
    seed: int | None = num(0, null=True)   # None: the env's first training state (validate)
    max_attempts: int | None = num(1, null=True)       # and at least num_episodes (validate)
    stop_at_success: bool = required()
    output_dir: str = required()
    overwrite: bool = required()
    video_codec: str = one_of(VIDEO_CODECS)
    progress_bar: bool = required()
    env: Any = None


def compose(overrides: Sequence[str] = ()):
    """``config/demos.yaml`` composed with Hydra ``overrides``; Hydra errors become one-sentence ConfigErrors."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    from embodirl.config import check_group_overrides
    from embodirl.paths import config_dir

    check_group_overrides(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = hydra_compose(CONFIG_NAME, overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            cfg.pop("hydra", None)
        OmegaConf.resolve(cfg)                 # ${hydra:...} too, while Hydra's config is at hand
    except (HydraException, OmegaConfBaseException) as exc:
        text = " ".join(str(exc).split()).split(" full_key:")[0].rstrip(".")
        raise ConfigError("", f"{text}.") from None
    finally:
        GlobalHydra.instance().clear()
    return cfg


def validate(cfg: DictConfig) -> DemosConfig:
    """The composed demos config as the typed :class:`DemosConfig`, its keys checked in one sentence each and its env
    group checked by the ManiSkill adapter (converted once to the adapter's config class)."""
    from omegaconf import OmegaConf

    from embodirl.demos.experts import CONTROL_MODES, EXPERTS
    from embodirl.envs.maniskill.simulator import check_config, first_training_seed
    from embodirl.envs.registry import env_config
    from embodirl.schema import to_object

    keys = [f.name for f in dataclasses.fields(DemosConfig) if f.name != "env"]
    unknown = sorted(set(cfg) - {*keys, "env"})
    if unknown:
        raise ConfigError(unknown[0], f"is not a demos key; config/demos.yaml lists them ({', '.join(keys)})")
    demos = to_object(DemosConfig, OmegaConf.masked_copy(cfg, keys))    # types and ranges, one sentence
    if demos.max_attempts is not None and demos.max_attempts < demos.num_episodes:
        raise ConfigError("max_attempts", f"must be null or an integer >= num_episodes ({demos.num_episodes}), "
                          f"got {demos.max_attempts}")
    env = env_config(cfg.env.train, "env")
    if env.adapter != "maniskill":
        raise ConfigError("env", f"demos are generated for ManiSkill env options only; '{env.adapter}' is not one")
    if env.task not in EXPERTS:
        raise ConfigError("env.task", f"no demonstration expert for {env.task}; experts exist for {', '.join(EXPERTS)}")
    if env.control_mode not in CONTROL_MODES:
        raise ConfigError("env.control_mode", f"the experts act in {', '.join(CONTROL_MODES)}, not "
                          f"'{env.control_mode}'; use env.control_mode={CONTROL_MODES[0]}")
    demos.env = check_config(env)
    if demos.seed is None:
        # the training states' seeds: held out from the evaluation's (2**30 on), or its own with official
        demos.seed = first_training_seed(demos.env)
    out = Path(demos.output_dir)
    if out.exists() and any(out.iterdir()):
        from embodirl.demos.lerobot.layout import INFO_PATH
        from embodirl.demos.lerobot.writer import is_dataset

        if not demos.overwrite:
            raise ConfigError("output_dir", f"{out} already exists and is not empty; choose another output_dir or "
                                            "overwrite=true")
        if not is_dataset(out):
            raise ConfigError("output_dir", f"{out} is not a LeRobot dataset (no {INFO_PATH}), and overwrite=true "
                                            "replaces only a dataset; choose another output_dir")
    return demos


def _folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def generate(demos: DemosConfig) -> dict:
    """Run the expert until ``num_episodes`` successes (or ``max_attempts``); write the dataset. Returns the summary.
    ``demos``: the validated config (:func:`validate`)."""
    from tqdm import tqdm

    from embodirl.demos.experts import EXPERTS
    from embodirl.demos.lerobot.writer import LeRobotWriter
    from embodirl.envs.maniskill.simulator import ManiSkillSimEnv

    assert demos.seed is not None       # validate resolves the default
    n_target, seed0 = demos.num_episodes, demos.seed
    max_attempts = demos.max_attempts if demos.max_attempts is not None else 2 * n_target + 10
    # attempts name their init state themselves
    env_cfg = dataclasses.replace(demos.env, num_init_states=None)
    out = Path(demos.output_dir)
    start = time.time()
    env = ManiSkillSimEnv(env_cfg, seed=seed0)
    spec, base = env.spec, env.unwrapped
    rgb = env.settings.obs_mode == "rgb"
    cameras: dict[str, tuple[int, int]] = {}
    if rgb:
        size = spec.image_size
        assert size is not None         # an rgb env's spec has its cameras' image size
        cameras = {c: size for c in spec.camera_names}
    writer = LeRobotWriter(out, fps=int(base.control_freq), cameras=cameras, action_dim=spec.action_dim,
                           state_dim=spec.state_dim, robot_type=str(base.robot_uids), video_codec=demos.video_codec,
                           overwrite=demos.overwrite)
    instruction = spec.task_descriptions[0]
    attempts = 0
    lengths: list[int] = []
    bar = tqdm(total=n_target, desc=f"demos {spec.name}", unit="demo", disable=not demos.progress_bar)
    try:
        while len(lengths) < n_target and attempts < max_attempts:
            init_state = seed0 + attempts
            attempts += 1
            obs = env.reset(init_state_id=init_state)
            expert = EXPERTS[spec.name](base)
            frames, states, actions, success = [], [], [], False
            for _ in range(spec.max_episode_steps):
                action = expert(base)
                frames.append(obs.get("images"))
                states.append(obs["state"])
                actions.append(action)
                result = env.step_chunk(action[None])
                obs, success = result.obs, success or result.success
                if (success and demos.stop_at_success) or result.truncated or (result.terminated and not success):
                    break
            if not success:
                continue
            images = {}
            if rgb:
                stacked = np.stack(cast(list[np.ndarray], frames))           # (T, V, 3, h, w): rgb obs have images
                images = {c: np.ascontiguousarray(stacked[:, v].transpose(0, 2, 3, 1)) for v, c in enumerate(cameras)}
            writer.add_episode(images=images, actions=np.stack(actions), states=np.stack(states), task=instruction,
                               extra={"init_state_id": init_state})
            lengths.append(len(actions))
            bar.update(1)
            bar.set_postfix(success_rate=f"{len(lengths) / attempts:.2f}", mean_len=f"{np.mean(lengths):.1f}")
    except BaseException:
        writer.abort()             # a dataset being replaced stays as it was
        raise
    finally:
        bar.close()
        env.close()
    writer.close()
    minutes = (time.time() - start) / 60
    summary = {"task": spec.name, "instruction": instruction, "episodes": len(lengths), "attempts": attempts,
               "expert_success_rate": len(lengths) / max(attempts, 1), "frames": int(sum(lengths)),
               "mean_episode_length": float(np.mean(lengths)) if lengths else 0.0, "minutes": minutes,
               "demos_per_minute": len(lengths) / minutes if minutes > 0 else 0.0,
               "cameras": list(cameras), "image_size": list(spec.image_size) if rgb and spec.image_size else None,
               "control_mode": env.settings.control_mode, "video_codec": demos.video_codec,
               "dataset_bytes": _folder_bytes(out), "seed": seed0}
    (out / "meta" / "generation.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(overrides: Sequence[str]) -> int:
    """The CLI entry: compose, validate (ConfigError before any simulator starts), generate. Exit status."""
    demos = validate(compose(overrides))
    from embodirl import runtime

    runtime.configure()
    summary = generate(demos)
    print(f"embodirl demos: {summary['episodes']} demos of {summary['task']} in {summary['attempts']} attempts "
          f"(expert success {summary['expert_success_rate']:.0%}), {summary['frames']} frames, "
          f"{summary['demos_per_minute']:.1f} demos/min, {summary['dataset_bytes'] / 1e6:.1f} MB -> {demos.output_dir}")
    if summary["episodes"] < demos.num_episodes:
        print(f"embodirl demos: only {summary['episodes']} of {demos.num_episodes} episodes succeeded within "
              f"{summary['attempts']} attempts (max_attempts)")
        return 1
    return 0
