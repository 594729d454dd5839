"""The full-size dry run on PyTorch's meta device (embodirl/tools/dry_run.py) for any config, and doctor's estimate beside it.

    .venv/bin/python scripts/dry_run.py env=libero_10 model=openvla_oft [--json out.json]

Builds the model a config names without memory, runs ``act``, one actor update and a full publication through the
real code (a tensor left on the CPU inside the policy raises, as on a GPU), and prints FLOPs per decision and the
bytes of parameters, gradients, optimizer state and activations, then ``embodirl doctor``'s memory estimate for
one actor rank with its ratio to the dry run's peak.
"""

from __future__ import annotations

import argparse
import json
import sys

from embodirl.config import compose
from embodirl.tools.dry_run import dry_run, format_report
from embodirl.tools.memory_plan import memory_plan, model_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="also write the report to this file")
    args, overrides = parser.parse_known_args(argv)
    cfg = compose(overrides)
    report = dry_run(cfg)
    print(format_report(report))
    doctor = memory_plan(cfg, model_size(cfg), "cpu")["actor"]
    print(f"doctor's estimate for one actor rank: {doctor / 1024**3:.2f} GiB "
          f"({doctor / report.update_peak_bytes:.2f} x the dry run's peak)")
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in report.seconds.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report.as_dict(), "doctor_actor_bytes": doctor}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
