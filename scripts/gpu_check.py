"""Check the whole GPU path in one command and write one JSON report (run it through ``scripts/gpu_check.sh``).

    scripts/gpu_check.sh --out $OUT            # a GPU machine: the full-size OpenVLA-OFT, bf16, CUDA
    scripts/gpu_check.sh --cpu --out /tmp/gc   # the same steps with the tiny preset on the CPU (CI runs this)

Steps, in order; the first that fails ends the check (exit status 1) with its error in the report:

1. ``environment``: torch, transformers, peft, the device and its memory;
2. ``dry_run``: the preset on the meta device (:mod:`embodirl.tools.dry_run`): FLOPs per decision of ``act`` and of
   an update, and the actor's bytes (the compute bound below comes from it);
3. ``train``: the real CLI, the in-process path (``cluster.use_ray=false model.device=<device>``) with the preset
   on ``env=toy_reach`` and GRPO, 3 training steps with an evaluation and a checkpoint at the third;
4. ``eval``: ``embodirl eval`` from that checkpoint;
5. ``policy``: ``scripts/bench/bench_policy.py`` - parallel vs autoregressive decoding and ``policy.act`` decisions/s
   at several batch sizes;
6. ``actor``: ``scripts/bench/bench_actor.py --preset full`` - one FSDP2 actor rank in this process: one update,
   publication, offload and onload, peak memory;
7. ``pi0``: the second VLA family at full size (``pi0``: 3.6 B parameters, bf16; ``pi0_tiny`` on the CPU):
   ``scripts/bench/bench_pi0.py`` - ``act`` decisions/s and FLOPs per decision at several batch sizes - and
   ``scripts/bench/bench_actor.py --preset full --model pi0`` - one FSDP2 update with gradient checkpointing, peak memory.

The report (``<out>/gpu_check.json``, rewritten after every step) also holds ``targets``: the numbers the GPU
issue sets goals for, each beside its goal. Logs of each step go to ``<out>/gpu_check.log``. At most 8 files are
written to ``<out>`` (what a lent GPU machine sends back).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: dense bf16 tensor-core peaks (NVIDIA's data sheets, without sparsity), TFLOP/s, by device-name fragment
BF16_PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "L4": 121.0}
MODES = {
    "gpu": {"preset": "openvla_oft", "device": "cuda", "dtype": "bfloat16",
            "policy": ["--rounds", "3", "--decode-batches", "1", "8", "--act-batches", "1", "8", "32", "64",
                       "--attn-implementation", "sdpa", "--merge-lora", "--compile"],
            # the measured setting: N16 x T8, micro-batch 8 (64 decisions per forward)
            "actor": ["--trajectories", "16", "--decisions", "8", "--micro-batch", "8", "--repeats", "2"],
            "pi0": "pi0", "pi0_policy": ["--batches", "1", "8", "32", "64", "--rounds", "3"],
            "pi0_actor": ["--trajectories", "8", "--decisions", "8", "--micro-batch", "2", "--repeats", "2"]},
    # the same paths at their smallest: two act batches (the compiled blocks meet a second size, as on the GPU), one
    # timed decoding round; the CLI runs train on one GRPO group of 4 in 2 micro-batches, on episodes of 2 decisions
    # (the evaluation keeps its 32 episodes: 4 tasks x 8 trials)
    "cpu": {"preset": "openvla_oft_tiny", "device": "cpu", "dtype": "bfloat16",
            "policy": ["--rounds", "1", "--decode-batches", "1", "--act-batches", "1", "2", "--threads", "1",
                       "--merge-lora", "--compile"],
            "actor": ["--trajectories", "4", "--decisions", "2", "--micro-batch", "2", "--repeats", "1"],
            "pi0": "pi0_tiny", "pi0_policy": ["--batches", "1", "4", "--rounds", "1", "--threads", "1"],
            "pi0_actor": ["--trajectories", "4", "--decisions", "2", "--micro-batch", "2", "--repeats", "1"],
            "cli": {"env.train.num_envs": "4", "actor.global_batch_size": "4", "env.train.max_episode_steps": "16",
                    "env.eval.max_episode_steps": "16"}},
}
TRAIN_STEPS = 3
#: the GPU issue's goals
ACT_TARGET_DECISIONS_PER_S = 50.0           # policy.act at batch 64 on an H200
ACT_TARGET_FRACTION_OF_BOUND = 0.55
LEARNER_TARGET_MFU = 0.50   # the learner's model-FLOP utilisation with gradient checkpointing
OFFLOAD_ONLOAD_TARGET_S = 2.0


class Report:
    """The JSON report, rewritten after every step."""

    def __init__(self, out: Path, mode: str):
        self.out = out
        self.path = out / "gpu_check.json"
        self.log = out / "gpu_check.log"
        self.data = {"mode": mode, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": _commit(), "steps": {},
                     "targets": {}}
        self.log.write_text("")

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def append_log(self, text: str) -> None:
        with open(self.log, "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def step(self, name: str, fn):
        print(f"=== {name}", flush=True)
        self.append_log(f"=== {name}")
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:
            seconds = time.perf_counter() - start
            self.data["steps"][name] = {"ok": False, "seconds": seconds, "error": _one_line(exc)}
            self.append_log(traceback.format_exc())
            self.data["failed"] = name
            self.write()
            print(f"gpu_check: step {name} failed after {seconds:.0f} s: {_one_line(exc)} (log: {self.log})",
                  file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        seconds = time.perf_counter() - start
        self.data["steps"][name] = {"ok": True, "seconds": seconds, "result": result}
        self.write()
        print(f"    ok in {seconds:.0f} s", flush=True)
        return result


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def _commit() -> str | None:
    """The checked-out commit; ``EMBODIRL_COMMIT`` where the tree travelled without its git folder (a lent GPU
    machine gets the working tree only: name the commit in the run's command)."""
    try:
        found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except Exception:
        found = ""
    return found or os.environ.get("EMBODIRL_COMMIT") or None


def run(report: Report, args: list[str], timeout_s: float, cwd: Path = ROOT) -> str:
    """A subprocess with this Python; its output goes to the log; a non-zero exit raises naming its last line."""
    command = [sys.executable, *args]
    report.append_log("$ " + " ".join(command))
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output = proc.stdout + proc.stderr
    report.append_log(output)
    if proc.returncode != 0:
        lines = [line for line in output.splitlines() if line.strip()]
        raise RuntimeError(f"{' '.join(args[:2])} exited with {proc.returncode}: {lines[-1] if lines else ''}")
    return output


# --- steps ---------------------------------------------------------------------------------------------------
def environment(device: str) -> dict:
    import peft
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "cpus": os.cpu_count()}
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("GPU mode needs CUDA (torch.cuda.is_available() is false); use --cpu on a CPU machine")
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda,
                    bf16_peak_tflops=bf16_peak(props.name))
    return info


def bf16_peak(name: str) -> float | None:
    override = os.environ.get("GPU_BF16_PEAK_TFLOPS")
    if override:
        return float(override)
    return next((peak for key, peak in BF16_PEAK_TFLOPS.items() if key in name), None)


def checkpointing_of(bench_args: list[str]) -> bool:
    """The gradient checkpointing a ``bench_actor.py`` call runs with (its ``--gradient-checkpointing``, default on)."""
    flag = "--gradient-checkpointing"
    return (bench_args[bench_args.index(flag) + 1] if flag in bench_args else "on") == "on"


def dry_run_step(preset: str, checkpointing: bool) -> dict:
    """The FLOPs and bytes of the preset with the gradient checkpointing of the update it describes (model FLOPs
    never count the recomputation; hardware FLOPs do when it is on)."""
    from embodirl.config import compose
    from embodirl.tools.dry_run import dry_run, format_report

    report = dry_run(compose(["env=libero_10", f"model={preset}",
                              f"actor.fsdp.gradient_checkpointing={str(checkpointing).lower()}"]))
    print(format_report(report), flush=True)
    return report.as_dict()


def policy_step(report: Report, mode: dict) -> dict:
    out = report.out / "policy.json"
    args = ["scripts/bench/bench_policy.py", "--preset", mode["preset"], "--device", mode["device"],
            "--dtype", mode["dtype"], *mode["policy"], "--json", str(out)]
    print(run(report, args, timeout_s=900)[-1500:], flush=True)
    return json.loads(out.read_text())


def actor_step(report: Report, mode: dict) -> dict:
    out = report.out / "actor.json"
    args = ["scripts/bench/bench_actor.py", "--preset", "full", "--device", mode["device"], "--model", mode["preset"],
            "--param-dtype", mode["dtype"], *mode["actor"], "--json", str(out)]
    print(run(report, args, timeout_s=900)[-2500:], flush=True)
    return json.loads(out.read_text())


def pi0_step(report: Report, mode: dict) -> dict:
    policy_out, actor_out = report.out / "pi0_policy.json", report.out / "pi0_actor.json"
    dtype = mode["dtype"] if mode["device"] == "cuda" else "float32"
    run(report, ["scripts/bench/bench_pi0.py", "--preset", mode["pi0"], "--device", mode["device"], "--dtype", dtype,
                 *mode["pi0_policy"], "--json", str(policy_out)], timeout_s=900)
    print(run(report, ["scripts/bench/bench_actor.py", "--preset", "full", "--device", mode["device"], "--model", mode["pi0"],
                       "--param-dtype", dtype, *mode["pi0_actor"], "--json", str(actor_out)], timeout_s=900)[-1500:],
          flush=True)
    from embodirl.config import compose
    from embodirl.tools.dry_run import dry_run

    checkpointing = checkpointing_of(mode["pi0_actor"])
    dry = dry_run(compose(["env=libero_10", f"model={mode['pi0']}",
                           f"actor.fsdp.gradient_checkpointing={str(checkpointing).lower()}"]))
    return {"policy": json.loads(policy_out.read_text()), "actor": json.loads(actor_out.read_text()),
            "dry_run": {k: getattr(dry, k) for k in ("update_model_flops_per_decision",
                                                      "update_hardware_flops_per_decision", "gradient_checkpointing")}}


def utilisation(decisions_per_s: float, dry: dict, bench: dict, peak: float | None) -> dict:
    """Model-FLOP (MFU) and hardware-FLOP (HFU) utilisation of a measured update, from the dry run of the same
    gradient checkpointing: a mismatch is refused, since it would count the recomputation the bench did not run,
    or leave out the one it did."""
    if bool(dry["gradient_checkpointing"]) != bool(bench["gradient_checkpointing"]):
        raise ValueError(f"the dry run counted FLOPs with gradient checkpointing {dry['gradient_checkpointing']} but the "
                         f"update was timed with {bench['gradient_checkpointing']}: run both with the same "
                         "actor.fsdp.gradient_checkpointing")
    model = decisions_per_s * dry["update_model_flops_per_decision"] / 1e12
    hardware = decisions_per_s * dry["update_hardware_flops_per_decision"] / 1e12
    return {"gradient_checkpointing": bool(bench["gradient_checkpointing"]), "model_tflops": model,
            "hardware_tflops": hardware, "mfu": model / peak if peak else None,
            "hfu": hardware / peak if peak else None}


def cli_overrides(mode: dict) -> list[str]:
    """The preset on the toy task, GRPO, in this process, small enough for a check (the mode's ``cli`` values replace
    the defaults' in place)."""
    overrides = dict(item.split("=", 1) for item in [
        "env=toy_reach", f"model={mode['preset']}", f"model.dtype={mode['dtype']}", "algorithm=grpo",
        "algorithm.group_size=4", "algorithm.filter_groups.enable=false", "env.train.use_fixed_reset_state_ids=true",
        "env.train.num_envs=8", "env.eval.num_envs=8", "rollout.rollout_epoch=1", "actor.global_batch_size=8",
        "actor.micro_batch_size=2", "cluster.use_ray=false", f"model.device={mode['device']}",
        "runner.progress_bar=false", "runner.logger.tensorboard=false", "runner.eval_num_videos=1"])
    overrides.update(mode.get("cli", {}))
    return [f"{key}={value}" for key, value in overrides.items()]


def train_step(report: Report, mode: dict, work: Path) -> dict:
    from embodirl.runner.metrics_logger import read_metrics

    run_dir = work / "train"
    run(report, ["-m", "embodirl.cli", "train", *cli_overrides(mode), f"runner.max_steps={TRAIN_STEPS}",
                 f"runner.val_check_interval={TRAIN_STEPS}", f"runner.save_interval={TRAIN_STEPS}",
                 f"runner.output_dir={run_dir}"], timeout_s=1800, cwd=work)
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if "time/step" in r]
    evals = [r for r in records if "eval/success_rate" in r]
    checkpoint = run_dir / "checkpoints" / f"step_{TRAIN_STEPS}"
    if len(steps) != TRAIN_STEPS or not evals or not (checkpoint / "COMPLETE").is_file():
        raise RuntimeError(f"the run ended with {len(steps)} steps, {len(evals)} evaluations and "
                           f"{'a' if checkpoint.is_dir() else 'no'} checkpoint at step {TRAIN_STEPS}")
    keys = ("time/step", "time/collect", "time/update", "time/publish_weights", "actor/first_step_ratio_error",
            "actor/clip_fraction", "train/success_rate", "actor/decisions")
    return {"steps": [{k: r.get(k) for k in ("step", *keys)} for r in steps],
            "eval": {k: evals[-1].get(k) for k in ("step", "eval/success_rate", "eval/episodes", "time/eval")},
            "checkpoint": str(checkpoint)}


def eval_step(report: Report, mode: dict, work: Path, checkpoint: str) -> dict:
    out = work / "eval"
    run(report, ["-m", "embodirl.cli", "eval", *cli_overrides(mode), f"runner.resume_dir={checkpoint}",
                 f"runner.output_dir={out}"], timeout_s=900, cwd=work)
    info = json.loads((out / "eval_info.json").read_text())["overall"]
    return {k: info.get(k) for k in ("n_episodes", "success_rate", "eval_s", "video_paths")}


# --- targets -------------------------------------------------------------------------------------------------
def targets(data: dict) -> dict:
    """The GPU issue's goals beside the measured numbers (None where this mode cannot measure them)."""
    steps = {name: step.get("result") or {} for name, step in data["steps"].items()}
    dry, policy, actor = steps.get("dry_run", {}), steps.get("policy", {}), steps.get("actor", {})
    peak = steps.get("environment", {}).get("bf16_peak_tflops")
    # the rollout acts with the adapters merged (rollout.merge_lora) and its blocks compiled (rollout.compile) when
    # those are on: the act goal is on the fastest of the measured settings
    fastest = policy.get("act_compiled") or policy.get("act_merged") or policy.get("act", [])
    act = {r["batch"]: r["decisions_per_s"] for r in fastest}
    unmerged = {r["batch"]: r["decisions_per_s"] for r in policy.get("act", [])}
    merged = {r["batch"]: r["decisions_per_s"] for r in policy.get("act_merged", [])}
    out = {}
    if act:
        batch = max(act)
        achieved = act[batch] * dry.get("act_flops_per_decision", 0) / 1e12
        out["act"] = {"batch": batch, "decisions_per_s": act[batch], "goal_decisions_per_s": ACT_TARGET_DECISIONS_PER_S,
                      "unmerged_decisions_per_s": unmerged.get(batch), "merged": bool(policy.get("act_merged")),
                      "merged_decisions_per_s": merged.get(batch), "compiled": bool(policy.get("act_compiled")),
                      "tflops": achieved, "fraction_of_peak": achieved / peak if peak else None,
                      "goal_fraction_of_peak": ACT_TARGET_FRACTION_OF_BOUND}
    if actor:
        seconds = actor.get("seconds", {})
        moves = seconds.get("offload()", 0.0) + seconds.get("onload()", 0.0)     # reused buffers (every later step)
        first = seconds.get("offload() #1", 0.0) + seconds.get("onload() #1", 0.0)
        before = seconds.get("plain .to() offload (before)", 0.0) + seconds.get("plain .to() onload (before)", 0.0)
        out["actor"] = {"decisions_per_s": actor["decisions_per_s"],
                          **utilisation(actor["decisions_per_s"], dry, actor, peak),
                          "goal_mfu": LEARNER_TARGET_MFU,
                          "offload_plus_onload_s": moves, "goal_offload_plus_onload_s": OFFLOAD_ONLOAD_TARGET_S,
                          "first_offload_plus_onload_s": first, "plain_to_offload_plus_onload_s": before or None,
                          "speedup_over_plain_to": before / moves if before and moves else None,
                          "train_peak_gib": (actor.get("train_peak_bytes") or 0) / 2**30 or None,
                          "dry_run_peak_gib": dry.get("update_peak_bytes", 0) / 2**30}
    pi0 = steps.get("pi0", {})
    if pi0:
        rows = pi0["policy"]["act"]
        out["pi0"] = {"act": {r["batch"]: {k: r.get(k) for k in ("decisions_per_s", "greedy_decisions_per_s",
                                                                  "fraction_of_bf16_peak", "peak_gib")} for r in rows},
                      "update_decisions_per_s": pi0["actor"]["decisions_per_s"],
                      "update": utilisation(pi0["actor"]["decisions_per_s"], pi0["dry_run"], pi0["actor"], peak),
                      "update_peak_gib": (pi0["actor"].get("train_peak_bytes") or 0) / 2**30 or None}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the tiny preset on the CPU (CI)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "outputs/gpu_check"),
                        help="folder of the report (default $OUT, else outputs/gpu_check)")
    parser.add_argument("--work", type=Path, default=None, help="folder of the runs (default <out>/../gpu_check_runs)")
    args = parser.parse_args(argv)
    mode_name = "cpu" if args.cpu else "gpu"
    mode = MODES[mode_name]
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_check_runs_{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    report = Report(args.out, mode_name)
    report.data["preset"] = mode["preset"]
    report.step("environment", lambda: environment(mode["device"]))
    report.step("dry_run", lambda: dry_run_step(mode["preset"], checkpointing_of(mode["actor"])))
    # the end-to-end path first: a lent machine's call is time-limited, and a report cut short still says whether
    # the CLI trained, evaluated and checkpointed on the device
    trained = report.step("train", lambda: train_step(report, mode, work))
    report.step("eval", lambda: eval_step(report, mode, work, trained["checkpoint"]))
    report.step("policy", lambda: policy_step(report, mode))
    report.step("actor", lambda: actor_step(report, mode))
    report.step("pi0", lambda: pi0_step(report, mode))
    report.data["targets"] = targets(report.data)
    report.data["ok"] = True
    report.write()
    print(json.dumps(report.data["targets"], indent=1))
    print(f"gpu_check: every step passed; report {report.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
