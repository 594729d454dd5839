"""Benchmark the OpenVLA-OFT policy: parallel decoding vs autoregressive decoding, and decisions per second.

    .venv/bin/python scripts/bench/bench_policy.py [--preset openvla_oft_tiny] [--device cpu] [--rounds 20]

1. Parallel vs autoregressive: the same H*A action tokens decoded (a) in one bidirectional pass over
   ``prefix + empty slots + </s>`` (OpenVLA-OFT) and (b) one token at a time with a KV cache under a
   causal mask (original OpenVLA): prefix forward, then L-1 single-token steps feeding back each argmax
   token. Both include vision and projector. Timed interleaved (parallel, AR, parallel, ...) so both see
   the same machine load; the ratio of medians is printed. Target: >= 10x chunks/s (OFT paper: 26x on
   GPU for 7B).
2. Decisions per second of ``policy.act`` (image processing, prompt ids, forward, sampling,
   un-normalisation) at several batch sizes.

Weights are random (``path: null``) unless ``--path`` is given; speed does not depend on them. On a
small shared CPU, ``--threads 1`` avoids oversubscription (two threads on two busy cores make every
number meaningless). The full-size model on a GPU:
``--preset openvla_oft --device cuda --dtype bfloat16 --attn-implementation sdpa``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from embodirl.envs.base import EnvSpec
from embodirl.models.base import SamplingParams
from embodirl.models.openvla_oft import build_policy
from embodirl.models.openvla_oft.modeling import SequenceInputs
from embodirl.models.openvla_oft.resolve import load_preset

LIBERO_LIKE = EnvSpec(action_dim=7, max_episode_steps=520, task_descriptions=["put the bowl on the plate"],
                      camera_names=["agentview", "wrist"], image_size=(256, 256), state_dim=8, name="libero_10")
INSTRUCTION = "put both the alphabet soup and the tomato sauce in the basket"


def observation(batch: int, spec: EnvSpec, device=None) -> dict:
    """An observation batch as a run hands it to the policy: CPU tensors (the policy does its CPU-side work on them,
    then moves its inputs to its device)."""
    h, w = spec.image_size
    return {"images": torch.randint(0, 256, (batch, len(spec.camera_names), 3, h, w), dtype=torch.uint8),
            "state": torch.randn(batch, spec.state_dim), "instruction": [INSTRUCTION] * batch}


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def decode_parallel(core, inputs) -> torch.Tensor:
    """One bidirectional pass: greedy action indices ``[B, L]``."""
    return core(**inputs).action_logits.argmax(-1)


@torch.no_grad()
def decode_autoregressive(core, inputs) -> torch.Tensor:
    """Causal prefix pass, then one cached step per token: greedy action indices ``[B, L]``."""
    from transformers import DynamicCache

    prefix = core.embed_prefix(**inputs)
    B, T0, _ = prefix.embeds.shape
    L = core.cfg.tokens_per_decision
    device = prefix.embeds.device
    cache = DynamicCache(config=core.language_model.config)
    causal = torch.ones(T0, T0, dtype=torch.bool, device=device).tril()[None, None] & prefix.mask[:, None, None, :]
    last = core.decoder_hidden(prefix, attention_mask=causal, past_key_values=cache)[:, -1]   # (B, D)
    kv_mask, position = prefix.mask, prefix.position_ids[:, -1]
    embed = core.language_model.get_input_embeddings()
    ones = torch.ones(B, 1, dtype=torch.bool, device=device)
    indices = []
    for k in range(L):
        index = core.action_logits(last).argmax(-1)                                           # (B,)
        indices.append(index)
        if k == L - 1:
            break
        position = position + 1
        kv_mask = torch.cat([kv_mask, ones], dim=1)                                           # (B, T0 + k + 1)
        step = SequenceInputs(embed(core.action_tokenizer.index_to_ids(index))[:, None], ones, position[:, None])
        last = core.decoder_hidden(step, attention_mask=kv_mask[:, None, None, :], past_key_values=cache)[:, -1]
    return torch.stack(indices, dim=1)


#: a token the cached decode chose counts as a tie with the teacher-forced argmax when its forced logit lies within
#: this many units of the model dtype's last place (relative to the top logit) below the top one: in bfloat16 the two
#: passes round differently and near-equal logits swap (97.3 % exact agreement at batch 8 on an H200)
TIE_ULPS = 4


@torch.no_grad()
def check_autoregressive(core, inputs, indices) -> dict:
    """Teacher-forced causal pass over prefix + decoded tokens must reproduce the cached decode: every position
    agrees or is a tie within :data:`TIE_ULPS` of the dtype's precision. Returns the agreement and tie counts."""
    prefix = core.embed_prefix(**inputs)
    tokens = core.action_tokenizer.index_to_ids(indices)
    embeds = torch.cat([prefix.embeds, core.language_model.get_input_embeddings()(tokens[:, :-1])], dim=1)
    mask = torch.cat([prefix.mask, torch.ones_like(tokens[:, :-1], dtype=torch.bool)], dim=1)
    T = embeds.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=embeds.device).tril()[None, None] & mask[:, None, None, :]
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    hidden = core.decoder_hidden(SequenceInputs(embeds, mask, positions), attention_mask=causal)
    L = indices.shape[1]
    logits = core.action_logits(hidden[:, -L:])                                      # (B, L, bins) float32
    top = logits.max(-1).values                                                      # (B, L)
    chosen = logits.gather(-1, indices[..., None]).squeeze(-1)                       # (B, L)
    margin = TIE_ULPS * torch.finfo(core.dtype).eps * top.abs().clamp(min=1.0)
    agree = logits.argmax(-1) == indices
    tie = ~agree & (top - chosen <= margin)
    if not bool((agree | tie).all()):
        worst = float(((top - chosen) / top.abs().clamp(min=1.0))[~(agree | tie)].max())
        raise RuntimeError(f"KV-cached decode disagrees with the teacher-forced pass beyond a tie: "
                           f"{float(agree.float().mean()):.1%} agree, {int(tie.sum())} ties, a gap of {worst:.2e} of the "
                           f"top logit where {TIE_ULPS} units of {core.dtype}'s last place are allowed")
    return {"agree": float(agree.float().mean()), "ties": int(tie.sum())}


def timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def compare_decoding(policy, batch: int, rounds: int, device) -> dict:
    core = policy.core
    inputs = policy.prepare_inputs(observation(batch, LIBERO_LIKE, device))
    check = check_autoregressive(core, inputs, decode_autoregressive(core, inputs))
    for _ in range(2):  # warm-up
        decode_parallel(core, inputs)
        decode_autoregressive(core, inputs)
    par, ar = [], []
    for _ in range(rounds):
        par.append(timed(lambda: decode_parallel(core, inputs), device))
        ar.append(timed(lambda: decode_autoregressive(core, inputs), device))
    p, a = statistics.median(par), statistics.median(ar)
    return {"batch": batch, "parallel_chunks_per_s": batch / p, "autoregressive_chunks_per_s": batch / a,
            "speedup": a / p, "parallel_ms": 1e3 * p, "autoregressive_ms": 1e3 * a,
            "decode_agreement": check["agree"], "decode_ties": check["ties"]}


def decisions_per_second(policy, batch: int, rounds: int, device) -> dict:
    obs = observation(batch, LIBERO_LIKE, device)
    params = SamplingParams(temperature=1.0)
    for _ in range(2):
        policy.act(obs, params, return_value=True)
    times = [timed(lambda: policy.act(obs, params, return_value=True), device) for _ in range(rounds)]
    t = statistics.median(times)
    return {"batch": batch, "decisions_per_s": batch / t, "ms_per_call": 1e3 * t}


@torch.no_grad()
def profile_act(policy, batch: int, device) -> dict:
    """Where one ``policy.act`` call's time goes: input preparation (CPU image work, prompt ids, transfers) vs
    the network forward vs the rest (sampling, un-normalisation, values), then the profiler's top operations."""
    from torch.profiler import ProfilerActivity, profile

    obs = observation(batch, LIBERO_LIKE, device)
    params = SamplingParams(temperature=1.0)
    prepare = statistics.median(timed(lambda: policy.prepare_inputs(obs), device) for _ in range(3))
    inputs = policy.prepare_inputs(obs)
    forward = statistics.median(timed(lambda: policy.core(**inputs), device) for _ in range(3))
    whole = statistics.median(timed(lambda: policy.act(obs, params, return_value=True), device) for _ in range(3))
    # side by side, same process: the image resize on the CPU and the levels moved after it (before the change)
    images = policy.images
    on_device = images.uint8_levels
    images.uint8_levels = lambda frames, target=None: on_device(frames).to(target)
    try:
        prepare_before = statistics.median(timed(lambda: policy.prepare_inputs(obs), device) for _ in range(3))
        whole_before = statistics.median(timed(lambda: policy.act(obs, params, return_value=True), device)
                                         for _ in range(3))
    finally:
        del images.uint8_levels   # the method again
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        policy.act(obs, params, return_value=True)
        sync(device)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=60)
    launches = sum(e.count for e in prof.key_averages() if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    print(f"\nprofile of policy.act at batch {batch}: prepare_inputs {1e3 * prepare:.1f} ms, network forward "
          f"{1e3 * forward:.1f} ms, whole act {1e3 * whole:.1f} ms, {launches} kernel launches; with the resize "
          f"on the CPU (before): prepare_inputs {1e3 * prepare_before:.1f} ms, whole act {1e3 * whole_before:.1f} ms "
          f"({whole_before / whole:.2f}x)")
    print(table)
    return {"batch": batch, "prepare_inputs_ms": 1e3 * prepare, "forward_ms": 1e3 * forward, "act_ms": 1e3 * whole,
            "kernel_launches": launches, "cpu_resize_prepare_inputs_ms": 1e3 * prepare_before,
            "cpu_resize_act_ms": 1e3 * whole_before, "table": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="openvla_oft_tiny")
    parser.add_argument("--path", default=None, help="checkpoint to load instead of random weights")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="override the preset's dtype (e.g. bfloat16 on GPU)")
    parser.add_argument("--attn-implementation", default=None,
                        help="override the preset's attention (the autoregressive baseline needs eager or sdpa: "
                             "it passes 4-D causal masks)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--act-batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--merge-lora", action="store_true",
                        help="then measure policy.act again with the adapters folded into the weights (rollout.merge_lora)")
    parser.add_argument("--compile", action="store_true",
                        help="last, compile the transformer blocks (rollout.compile) and measure policy.act again")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--profile", action="store_true",
                        help="finally split policy.act at the largest batch into its CPU-side input preparation and the "
                             "network forward, and print torch.profiler's heaviest device operations")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_preset(args.preset)
    cfg.update(path=args.path, **({"dtype": args.dtype} if args.dtype else {}),
               **({"attn_implementation": args.attn_implementation} if args.attn_implementation else {}))
    start = time.perf_counter()
    policy = build_policy(cfg, LIBERO_LIKE, device=args.device).eval()
    build_s = time.perf_counter() - start
    n_params = sum(p.numel() for p in policy.parameters())
    print(f"preset {args.preset}: {n_params / 1e6:.1f} M parameters, {policy.tokens_per_decision} action tokens "
          f"per decision, device {args.device}, {torch.get_num_threads()} threads, built in {build_s:.1f} s")
    results = {"preset": args.preset, "device": args.device, "threads": torch.get_num_threads(),
               "parameters": n_params, "decode": [], "act": []}
    print("\nparallel decoding (one pass) vs autoregressive decoding (KV cache), same tokens, greedy")
    print(f"{'batch':>5} {'parallel chunks/s':>18} {'AR chunks/s':>12} {'speed-up':>9}")
    for batch in args.decode_batches:
        r = compare_decoding(policy, batch, args.rounds, args.device)
        results["decode"].append(r)
        print(f"{batch:>5} {r['parallel_chunks_per_s']:>18.1f} {r['autoregressive_chunks_per_s']:>12.1f} "
              f"{r['speedup']:>8.1f}x")
    print("\npolicy.act decisions per second (preprocessing + forward + sampling + values)")
    print(f"{'batch':>5} {'decisions/s':>12} {'ms/call':>9}")
    for batch in args.act_batches:
        r = decisions_per_second(policy, batch, max(3, args.rounds // 2), args.device)
        results["act"].append(r)
        print(f"{batch:>5} {r['decisions_per_s']:>12.1f} {r['ms_per_call']:>9.1f}")
    if args.merge_lora:
        policy.merge_adapters_()
        results["act_merged"] = []
        print("\npolicy.act decisions per second, LoRA merged into the weights (rollout.merge_lora=true)")
        print(f"{'batch':>5} {'decisions/s':>12} {'ms/call':>9} {'vs unmerged':>12}")
        for batch, unmerged in zip(args.act_batches, results["act"], strict=True):
            r = decisions_per_second(policy, batch, max(3, args.rounds // 2), args.device)
            r["speedup_over_unmerged"] = r["decisions_per_s"] / unmerged["decisions_per_s"]
            results["act_merged"].append(r)
            print(f"{batch:>5} {r['decisions_per_s']:>12.1f} {r['ms_per_call']:>9.1f} {r['speedup_over_unmerged']:>11.2f}x")
    if args.profile:
        results["profile"] = profile_act(policy, max(args.act_batches), args.device)
    if args.compile:
        start = time.perf_counter()
        regions = policy.compile_blocks_()   # as rollout.compile does
        results["act_compiled"] = []
        print(f"\npolicy.act decisions per second, {regions} transformer blocks compiled (torch.compile, one graph per "
              f"block class), after the rows above in the same process")
        print(f"{'batch':>5} {'decisions/s':>12} {'ms/call':>9} {'vs above':>9} {'warm-up s':>10}")
        before = results.get("act_merged") or results["act"]
        for batch, earlier in zip(args.act_batches, before, strict=True):
            warm = time.perf_counter()
            policy.act(observation(batch, LIBERO_LIKE), SamplingParams(temperature=1.0), return_value=True)
            warm = time.perf_counter() - warm
            r = decisions_per_second(policy, batch, max(3, args.rounds // 2), args.device)
            r.update(speedup=r["decisions_per_s"] / earlier["decisions_per_s"], warm_up_s=warm)
            results["act_compiled"].append(r)
            print(f"{batch:>5} {r['decisions_per_s']:>12.1f} {r['ms_per_call']:>9.1f} {r['speedup']:>8.2f}x {warm:>10.1f}")
        results["compile_s"] = time.perf_counter() - start
    if torch.device(args.device).type == "cuda":
        results["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        print(f"\npeak GPU memory {results['max_memory_gib']:.1f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
