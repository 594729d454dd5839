"""``embodirl sft [overrides]``: compose and check (one sentence, exit 2, before anything starts), then train."""

from __future__ import annotations

from collections.abc import Sequence


def main(overrides: Sequence[str]) -> int:
    """The CLI entry; raises ConfigError for bad input (the caller prints it and exits 2)."""
    from embodirl import runtime
    from embodirl.config import validate
    from embodirl.demos.lerobot.layout import DatasetError
    from embodirl.demos.lerobot.reader import LeRobotDataset
    from embodirl.envs.registry import make_env
    from embodirl.errors import ConfigError
    from embodirl.schema.envs import action_conversion
    from embodirl.sft import compose as sft_compose

    cfg = sft_compose.compose(overrides)
    own = sft_compose.check(cfg)         # the typed sft and data sections
    run = validate(sft_compose.main_config(cfg))
    assert own.data.path is not None     # check refused an unset one
    try:
        dataset = LeRobotDataset(own.data.path, action_chunk=sft_compose.trained_chunk(cfg)[0])
    except DatasetError as exc:
        raise ConfigError("data.path", str(exc)) from None
    sft_compose.check_chunk(cfg, dataset)
    runtime.configure()
    runtime.set_torch_threads(cfg.runner.torch_threads)
    probe = make_env(cfg.env.train, num_envs=1, seed=cfg.runner.seed)   # the env split, converted to its typed config
    spec = probe.spec
    probe.close()
    camera_keys = sft_compose.check_dataset(cfg, dataset, spec)
    # the demos hold the env's own actions: the policy learns them in the convention it declares, the one its
    # rollouts are converted from (embodirl.envs.conventions)
    dataset.convert_actions(action_conversion(run, "env.train").from_env)
    from embodirl.sft import loop

    model_dir = loop.run(cfg, own, dataset, spec, camera_keys)
    if model_dir is None:     # resumed from another folder's checkpoint at or past runner.max_steps: nothing trained
        print(f"embodirl sft: nothing trained: the checkpoint resumed from is at or past runner.max_steps "
              f"({cfg.runner.max_steps}), and {cfg.runner.output_dir} holds no checkpoint", flush=True)
        return 0
    print(f"embodirl sft: checkpoint {model_dir} (embodirl train|eval model.path={model_dir})", flush=True)
    return 0
