"""``embodirl doctor --bench [--gpus N] [overrides]``: calibrate the config's parts here and print the predicted step
(:mod:`embodirl.calibration.report`). The overrides are ``embodirl train``'s; the config is checked as a run's is."""

from __future__ import annotations

from embodirl.errors import ConfigError

FLAG = "--bench"


def parse(args: list[str]) -> tuple[list[str], int]:
    """(overrides, gpus) from the words after ``doctor``."""
    overrides, gpus, rest = [], 1, iter(args)
    for arg in rest:
        if arg == FLAG:
            continue
        if arg == "--gpus" or arg.startswith("--gpus="):
            value = arg.split("=", 1)[1] if "=" in arg else next(rest, "")
            if not value.isdigit() or int(value) < 1:
                raise ConfigError("", f"--gpus takes a number of devices (1 or more), got {value!r}")
            gpus = int(value)
        elif arg.startswith("-"):
            raise ConfigError("", f"embodirl doctor --bench takes Hydra overrides and --gpus N; {arg} is not one")
        else:
            overrides.append(arg)
    return overrides, gpus


def main(args: list[str]) -> int:
    from embodirl import runtime
    from embodirl.calibration.report import bench, format_table
    from embodirl.config import check_group_overrides, compose, validate

    overrides, gpus = parse(args)
    check_group_overrides(overrides)
    cfg = validate(compose(overrides))
    runtime.set_torch_threads(cfg.runner.torch_threads)
    print(format_table(bench(cfg, gpus=gpus)))
    return 0
