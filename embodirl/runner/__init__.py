"""The single-controller runner: collect -> advantages -> update -> publish weights, evaluation,
checkpoints and logging. Only this package and ``embodirl.workers`` import Ray."""


def run(cfg):
    """Run the job a validated config describes (training, or evaluation with runner.only_eval)."""
    from embodirl.runner.loop import run as _run

    return _run(cfg)
