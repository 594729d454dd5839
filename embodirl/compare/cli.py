"""``embodirl compare A B [overrides]``: prepare (every check, one sentence and exit 2 before any worker starts), then
run both sides and report."""

from __future__ import annotations

import logging
from collections.abc import Sequence


def main(args: Sequence[str]) -> int:
    """The CLI entry; raises ConfigError / PreflightFailed for bad input (the caller prints it and exits 2)."""
    from embodirl import runtime
    from embodirl.compare.compose import prepare
    from embodirl.compare.sweep import run

    job = prepare(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runtime.set_torch_threads(job.sides[0].cfg.runner.torch_threads)
    for side in job.sides:
        step = f" (step {side.step})" if side.step is not None else ""
        print(f"compare {side.label.upper()}: {side.path}{step}, weights sha256 {side.sha256[:16]}", flush=True)
    if job.sides[0].sha256 == job.sides[1].sha256:
        print("compare: A and B hold identical weights (the same sha256); expect no difference", flush=True)
    run(job)
    return 0
