"""The plan of a run, in a few lines: which component runs on which devices, how much of the batch each worker holds,
and the memory each device needs - what ``embodirl doctor`` shows and what a training run prints first.

It reads the checked config and its devices (:func:`embodirl.schema.check`'s context: the parsed
``cluster.component_placement``, the resolved worker counts, Ray or one process), lays the workers on the devices as
the worker layer will (:func:`embodirl.workers.placement_groups.plan_placement`: worker ``r`` of a component on its
``r``-th device, round robin) and sums the memory estimate of every worker on a device
(:func:`embodirl.tools.memory_plan.memory_plan`; with parking - ``actor.enable_offload`` / ``rollout.enable_offload`` - the
collocated phases take turns, so the larger of them counts).
"""

from __future__ import annotations

from collections import defaultdict

GIB = 1024**3


def _ids(devices) -> str:
    """``(0, 1, 2, 3, 5)`` as ``0-3,5``."""
    devices, out = sorted(devices), []
    start: int | None = None
    prev: int | None = None
    for d in devices + [None]:
        if start is not None and prev is not None and d == prev + 1:    # (prev is set whenever start is)
            prev = d
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = d
    return ",".join(out) or "-"


def plan_lines(ctx, *, with_memory: bool = True) -> list[str]:
    """The plan of the run ``ctx`` (a :class:`embodirl.schema.Context`) describes, one line per component and one for
    the memory of the busiest device."""
    from embodirl.workers.placement_groups import plan_placement

    cfg, placement = ctx.config, ctx.placement
    kind = placement.accelerator.upper()
    K, R, S = cfg.env_workers.num_workers, cfg.rollout.num_workers, cfg.rollout.pipeline_stage_num
    N = cfg.env.train.num_envs
    if not ctx.use_ray:
        return [f"plan: one process on this machine ({placement.num_devices} {kind} slot(s)): the actor's policy acts; "
                f"{N} simulators in sub-processes; {cfg.actor.global_batch_size} trajectories per optimizer step in "
                f"micro-batches of {cfg.actor.micro_batch_size}"]
    workers = {"actor": ctx.dp, "rollout": R, "env": K}
    plan = plan_placement(placement, workers, num_nodes=cfg.cluster.num_nodes)
    on = {c: [slot.device for slot in plan.slots.get(c, [])] for c in workers}
    lines = [f"plan: {placement.num_devices} {kind} device(s) through Ray",
             f"  actor: {ctx.dp} rank(s) on {kind} {_ids(on['actor'])}"
             + (" (FSDP2)" if ctx.dp > 1 else "")
             + f"; {cfg.actor.global_batch_size // max(ctx.dp, 1)} trajectories per rank per optimizer step, micro-batches "
               f"of {cfg.actor.micro_batch_size}",
             f"  inference: {R} worker(s) on {kind} {_ids(on['rollout'])}; about {-(-N // R)} observations per worker "
             f"per decision" + (", merged" if cfg.rollout.merge_lora else "") + (", compiled" if cfg.rollout.compile else ""),
             f"  env: {K} worker(s) on {kind} {_ids(on['env'])}; {S} stage(s) x {N // max(K * S, 1)} simulators each"]
    if with_memory:
        lines.append(memory_line(cfg, placement, on))
    return lines


def memory_line(cfg, placement, on: dict[str, list[int]]) -> str:
    """The estimated peak bytes of the busiest device (GPU; on CPU slots: the host, all workers together)."""
    from embodirl.tools.memory_plan import memory_plan, model_size

    per_worker = memory_plan(cfg, model_size(cfg), placement.accelerator)
    if placement.accelerator == "cpu":
        total = sum(per_worker[c] * len(on[c]) for c in on)
        return f"  memory: {total / GIB:.1f} GiB of host memory for every worker together"
    device_need: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for component, devices in on.items():
        for device in devices:
            device_need[device][component] += per_worker[component]
    parked = cfg.actor.enable_offload or cfg.rollout.enable_offload

    def need(parts) -> int:       # parked phases take turns on the device; otherwise everything is resident
        return max(parts["actor"], parts["rollout"] + parts["env"]) if parked else sum(parts.values())

    busiest = max(device_need, key=lambda d: need(device_need[d]))
    parts = device_need[busiest]
    detail = ", ".join(f"{c} {parts[c] / GIB:.1f}" for c in ("actor", "rollout", "env") if parts[c])
    return (f"  memory: {need(parts) / GIB:.1f} GiB on the busiest GPU ({busiest}: {detail} GiB"
            + ("; the parked phases take turns" if parked else "") + ")")
