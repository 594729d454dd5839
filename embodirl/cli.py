"""The ``embodirl`` command: ``embodirl train|eval|doctor [overrides]``, ``embodirl demos|sft [overrides]``
(expert demonstrations as a LeRobot dataset, action-token SFT on it: :mod:`embodirl.demos`, :mod:`embodirl.sft`), and
``embodirl compare A B [overrides]`` (two checkpoints on the same evaluation episodes: :mod:`embodirl.compare`).

Overrides use Hydra's syntax (``env=libero_10 model=openvla_oft actor.optim.lr=1e-5``); Hydra's own
flags work too (``--cfg job`` prints the composed config, ``-m`` runs a sweep). ``eval`` is ``train``
with ``runner.only_eval=true``. The configuration is composed and checked before anything starts: a
violation prints one sentence naming the key and exits with status 2, leaving the disk untouched.
"""

from __future__ import annotations

import sys
from typing import NoReturn

USAGE = """usage: embodirl {train,eval,doctor,demos,sft,compare} [hydra overrides] [--cfg job] [-m]

  embodirl train                                   the default job (see README)
  embodirl train env=libero_10 model=openvla_oft   choose a task family and a policy
  embodirl eval  env=libero_10 model=openvla_oft model.path=/ckpt   evaluation only
  embodirl train --cfg job env=libero_10           print the composed config
  embodirl train -m actor.optim.lr=1e-4,3e-4       a sweep (one output dir per job)
  embodirl doctor env=libero_10 model=openvla_oft  check the set-up for a config (exit 0: all pass)
  embodirl doctor --bench [--gpus N] [overrides]   time the parts here, predict the step and the run's wall-clock
  embodirl demos env=maniskill_pushcube_rgb num_episodes=50   expert demos as a LeRobot dataset (config/demos.yaml)
  embodirl sft env=maniskill_pushcube_rgb model=openvla_oft_tiny data.path=outputs/demos/maniskill_pushcube_rgb_50
                                                   action-token SFT on those demos (config/sft.yaml)
  embodirl compare /ckptA /ckptB env=libero_10 model=openvla_oft   both on the same episodes, paired tests
                                                   (config/compare.yaml)
"""
COMMANDS = ("train", "eval", "doctor", "demos", "sft", "compare")
# Hydra flags that take a value (the value is not an override).
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--experimental-rerun"}
EXIT_BAD_CONFIG = 2
EXIT_RUN_FAILED = 1
#: `embodirl train` into a folder already trained to runner.max_steps: nothing trained (a script must not take it for 0)
EXIT_ALREADY_TRAINED = 3
# 75 (embodirl.runner.preemption.EXIT_PREEMPTED, sysexits' EX_TEMPFAIL: try again): stopped on SIGTERM/SIGUSR1 after
# writing a checkpoint to resume from
#: `embodirl eval`'s folder when the command names none: its own, never a training run's outputs/<env>_<model>
EVAL_OUTPUT_DIR = "runner.output_dir=outputs/eval/${runner.experiment_name}"


def _split(args: list[str]) -> tuple[list[str], bool]:
    overrides, multirun, skip = [], False, False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in _FLAGS_WITH_VALUE:
            skip = True
        elif arg in ("-m", "--multirun"):
            multirun = True
        elif not arg.startswith("-"):
            overrides.append(arg)
    return overrides, multirun


#: commands that compose their own config without Hydra's runner (Hydra's flags mean the same for them, see below)
OWN_COMMANDS = ("demos", "sft", "doctor")
#: what ``--cfg`` prints for them: the job's config (they have no Hydra section of their own)
CFG_CHOICES = ("job", "all")


def _own_command_flags(command: str, rest: list[str], overrides: list[str]) -> None:
    """``embodirl demos|sft|doctor --cfg job [--resolve] [overrides]``: print the composed (and checked) config, as
    ``train --cfg job`` does, and write nothing. Other Hydra flags are refused in one sentence."""
    from omegaconf import OmegaConf

    from embodirl.errors import ConfigError

    flags = [a for a in rest if a.startswith("-")]
    unsupported = [f for f in flags if f not in ("--cfg", "-c", "--resolve")]
    if unsupported:
        raise ConfigError("", f"embodirl {command} takes Hydra overrides, --cfg job and --resolve; {unsupported[0]} "
                              "is for train and eval")
    at = next(i for i, a in enumerate(rest) if a in ("--cfg", "-c"))
    what = rest[at + 1] if at + 1 < len(rest) else None
    if what not in CFG_CHOICES:
        raise ConfigError("", f"--cfg takes one of {', '.join(CFG_CHOICES)} for embodirl {command}, got {what!r}")
    if command == "demos":
        from embodirl.demos import generate

        cfg = generate.compose(overrides)
        generate.validate(cfg)
    elif command == "sft":
        from embodirl.config import validate
        from embodirl.sft import compose as sft_compose

        cfg = sft_compose.compose(overrides)
        sft_compose.check(cfg)
        validate(sft_compose.main_config(cfg))
    else:
        from embodirl.config import check_group_overrides, compose, validate

        check_group_overrides(overrides)
        cfg = compose(overrides)
        validate(cfg, check_envs=False)
    print(OmegaConf.to_yaml(cfg, resolve="--resolve" in rest), end="")


def _fail(message: str) -> NoReturn:
    print(f"embodirl: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_CONFIG)


def _eval_args(rest: list[str]) -> list[str]:
    """``embodirl eval``'s arguments: ``runner.only_eval=true`` (and its own output folder unless the command names
    one) placed next to the user's overrides, where Hydra's parser takes them as one run (``eval a=1 --cfg job``,
    ``eval --cfg job a=1``)."""
    from embodirl.overrides import override_key

    overrides = _split(rest)[0]
    at = max((i for i, a in enumerate(rest) if overrides and a == overrides[-1]), default=len(rest) - 1) + 1
    named = {override_key(a) for a in overrides} & {"runner.output_dir", "runner.experiment_name"}
    return [*rest[:at], "runner.only_eval=true", *([] if named else [EVAL_OUTPUT_DIR]), *rest[at:]]


def _own_command(command: str, overrides: list[str]) -> None:
    """``embodirl demos|sft|doctor [overrides]``: the command's own entry point, its exit status the process's; a bad
    config is one sentence and status 2, a failed run status 1."""
    from embodirl.config import check_group_overrides
    from embodirl.errors import AssetsMissing, ConfigError

    if command == "demos":
        from embodirl.demos import generate

        try:
            code = generate.main(overrides)
        except (ConfigError, AssetsMissing) as exc:
            _fail(str(exc))
        sys.exit(code)
    if command == "sft":
        from embodirl.errors import RunFailed
        from embodirl.sft import cli as sft_cli
        from embodirl.workers.deadlines import WorkerHung

        try:
            code = sft_cli.main(overrides)
        except (ConfigError, AssetsMissing) as exc:
            _fail(str(exc))
        except (RunFailed, WorkerHung) as exc:      # WorkerHung: an actor rank stuck past its deadline
            print(f"embodirl: {exc}", file=sys.stderr)
            sys.exit(EXIT_RUN_FAILED)
        sys.exit(code)
    from embodirl.tools import doctor

    try:
        check_group_overrides(overrides)
        code = doctor.main(overrides)
    except ConfigError as exc:
        _fail(str(exc))
    sys.exit(code)


def _check_run(command: str, rest: list[str], overrides: list[str], multirun: bool) -> None:
    """``embodirl train|eval``: the composed config (every sweep job's) checked before Hydra's runner starts, and for a
    run (not ``--cfg``/``--info``) its rendering and memory too; a violation is one sentence and status 2."""
    from embodirl.config import check_group_overrides, compose, sweep_jobs, validate
    from embodirl.errors import AssetsMissing, ConfigError
    from embodirl.tools.doctor import PreflightFailed, preflight

    try:
        check_group_overrides(overrides)
        if not multirun:
            context: list = []
            typed = validate(compose(overrides), context=context)
            if not any(a.startswith("-") for a in rest):    # a run (not --cfg/--info): rendering and memory
                preflight(typed)                               # are checked before any worker starts
                if command == "train":                         # where each component runs, first
                    from embodirl.tools.run_plan import plan_lines

                    ctx = context[0]
                    print("\n".join(plan_lines(ctx, with_memory=ctx.placement.accelerator == "gpu")), flush=True)
        else:                                                  # every sweep job's types and rules, before the first
            for job in sweep_jobs(overrides):
                validate(compose(job), check_envs=False)
    except (ConfigError, AssetsMissing, PreflightFailed) as exc:
        _fail(str(exc))


def main(argv: list[str] | None = None) -> None:
    if argv is None:   # the real command: the run's minutes count from the process start (imports included)
        import psutil

        from embodirl import runtime

        runtime.command_started = psutil.Process().create_time()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        _fail(f"unknown command '{command}'; use one of: {', '.join(COMMANDS)}")
    if command == "eval":
        rest = _eval_args(rest)
    if command == "doctor" and "--bench" in rest:    # measure the parts here, predict the run (embodirl.calibration)
        _bench(rest)
    overrides, multirun = _split(rest)

    from embodirl.errors import AssetsMissing, ConfigError

    if command == "compare":
        _compare(rest)
    if command in OWN_COMMANDS and any(a.startswith("-") for a in rest):
        try:
            _own_command_flags(command, rest, overrides)
        except (ConfigError, AssetsMissing) as exc:
            _fail(str(exc))
        return
    if command in OWN_COMMANDS:
        _own_command(command, overrides)
    _check_run(command, rest, overrides, multirun)
    _hydra_main(rest)


def _bench(args: list[str]) -> None:
    """``embodirl doctor --bench [--gpus N] [overrides]``: this config's parts timed here and its step predicted
    (:mod:`embodirl.calibration`); a bad config is one sentence and status 2, and nothing is written."""
    from embodirl import runtime
    from embodirl.calibration.report import bench, bench_args, format_table
    from embodirl.config import check_group_overrides, compose, validate
    from embodirl.errors import AssetsMissing, ConfigError

    try:
        overrides, gpus = bench_args(args)
        check_group_overrides(overrides)
        cfg = validate(compose(overrides))
    except (ConfigError, AssetsMissing) as exc:
        _fail(str(exc))
    runtime.set_torch_threads(cfg.runner.torch_threads)
    print(format_table(bench(cfg, gpus=gpus)))
    sys.exit(0)


def _compare(args: list[str]) -> None:
    """``embodirl compare A B [overrides]`` (:mod:`embodirl.compare`): bad input is one sentence and status 2 before
    any worker starts."""
    from embodirl.compare import cli as compare_cli
    from embodirl.errors import AssetsMissing, ConfigError, RunFailed
    from embodirl.tools.doctor import PreflightFailed
    from embodirl.workers.deadlines import WorkerHung

    try:
        code = compare_cli.main(args)
    except (ConfigError, AssetsMissing, PreflightFailed) as exc:
        _fail(str(exc))
    except (RunFailed, WorkerHung) as exc:
        print(f"embodirl: {exc}", file=sys.stderr)
        sys.exit(EXIT_RUN_FAILED)
    sys.exit(code)


def _hydra_main(rest: list[str]) -> None:
    import hydra

    from embodirl.paths import config_dir

    @hydra.main(config_path=str(config_dir()), config_name="config", version_base=None)
    def _job(cfg) -> None:
        _run(cfg)

    sys.argv = [sys.argv[0], *rest]
    _job()


def _run(cfg) -> None:
    """One job: resolve, validate (again, for sweep jobs), then hand to the runner."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from embodirl.config import validate
    from embodirl.errors import AlreadyTrained, AssetsMissing, ConfigError

    hydra_cfg = HydraConfig.get()
    OmegaConf.resolve(cfg)                     # the ${hydra:...} interpolations too, while Hydra's config is at hand
    if hydra_cfg.mode == RunMode.MULTIRUN:
        cfg.runner.output_dir = f"{cfg.runner.output_dir}/{hydra_cfg.job.num}"
    try:
        cfg = validate(cfg)                    # the typed config the run goes on with
    except (ConfigError, AssetsMissing) as exc:
        _fail(str(exc))
    from embodirl import runtime
    from embodirl.runner import run

    runtime.set_torch_threads(cfg.runner.torch_threads)

    from embodirl.errors import RunFailed
    from embodirl.runner.preemption import EXIT_PREEMPTED, Preempted
    from embodirl.workers.deadlines import WorkerHung

    try:
        run(cfg)
    except (ConfigError, AssetsMissing) as exc:
        _fail(str(exc))
    except (RunFailed, WorkerHung) as exc:       # WorkerHung: an evaluation's worker stuck past its deadline
        print(f"embodirl: {exc}", file=sys.stderr)
        sys.exit(EXIT_RUN_FAILED)
    except AlreadyTrained as exc:
        print(f"embodirl: {exc}", file=sys.stderr)
        sys.exit(EXIT_ALREADY_TRAINED)
    except Preempted as exc:
        print(f"embodirl: {exc}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    except KeyboardInterrupt:
        # workers are closed by the runner's context managers; checkpoints written so far are kept
        print(f"embodirl: interrupted; completed checkpoints are in {cfg.runner.output_dir}/checkpoints "
              "(the same command resumes from the latest)", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
