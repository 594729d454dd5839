"""A full-size dry run on PyTorch's ``meta`` device: the policy a config describes is built without memory,
acts, scores its actions, takes one actor update and publishes its weights - the code paths a GPU run takes,
on a machine without a GPU.

Why the meta device: a tensor on the meta device has a shape and a dtype but no data, and PyTorch refuses to
mix it with a CPU tensor (``Tensor on device cpu is not on the expected device meta!``) exactly where it would
refuse to mix a CPU tensor into a CUDA computation. A normaliser, tokenizer, processor or loss that creates a
tensor on the CPU instead of on its module's device - the crash a 7B run would meet at its first action -
fails here, in CI, in seconds. The same run counts what a GPU would do:

* FLOPs per decision of ``act`` and of an update (forward and backward), counted twice: *model* FLOPs (what the
  update computes once: the basis of model-FLOP utilisation, MFU) and *hardware* FLOPs (model FLOPs plus gradient
  checkpointing's recomputed forwards, when ``actor.fsdp.gradient_checkpointing`` is on: the basis of HFU), by
  PyTorch's own per-operator formulas (:class:`MetaDryRun`; ``FlopCounterMode`` would do, but
  its module hooks keep recomputed activations alive and so falsify the bytes below);
* bytes of parameters, gradients, optimizer state and activations: the live bytes of every tensor the update
  allocates on the policy's device, tracked by storage with weak references (:class:`MetaDryRun` again) - what the
  caching allocator would have to hold at the peak, before fragmentation. Attention runs the memory-efficient
  SDPA kernel a GPU runs (:func:`gpu_attention`), not the math fallback that materialises the score matrix.

Code that reads a value back to the host (``.item()``, ``bool()``, a copy to the CPU) has nothing to read on the
meta device; :class:`MetaDryRun` answers such reads with plausible stand-ins (true, one, zeros, "all valid")
and lets every other operation run as it would. Those answers steer control flow only; nothing measured here
depends on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry as _FLOP_FORMULAS

from embodirl import data as D
from embodirl.actor.fsdp import recomputing
from embodirl.envs.base import EnvSpec

aten = torch.ops.aten
META = torch.device("meta")
#: a dry run's batch: two trajectories, so that an update takes two optimizer steps (the optimizer state
#: created by the first is alive during the second's backward, as in every later step of a real run)
DRY_RUN_TRAJECTORIES = 2
DRY_RUN_INSTRUCTION = "put both the alphabet soup and the tomato sauce in the basket"


class MetaDryRun(TorchDispatchMode):
    """Host reads of meta tensors get stand-in values (see module docstring): ``.item()`` / ``bool()`` /
    ``float()`` -> true or one, ``nonzero`` -> every index (an all-true mask), a copy to the CPU -> zeros of
    the same shape and dtype. Everything else runs unchanged, so a CPU tensor meeting a meta one still raises.

    ``count=True`` also measures, in the same dispatch (one mode, not three stacked: each stacked mode is another
    Python call per operator, and a full-size update runs a few hundred thousand of them):

    * ``flops``: the FLOPs of the operators run, by :data:`torch.utils.flop_counter.flop_registry`'s formulas
      (matrix products and attention, as ``FlopCounterMode`` counts them);
    * ``current`` / ``peak``: bytes of the meta storages the operators allocate, alive now and at most; a storage
      counts once however many views share it, and stops counting when its last tensor is freed."""

    def __init__(self, *, count: bool = False):
        super().__init__()
        self.count = count
        self.flops = 0
        self.recomputed_flops = 0     # of those, the FLOPs of checkpointed forwards recomputed in backward
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is not None and first.is_meta:
            if func is aten._local_scalar_dense.default:
                return True if first.dtype == torch.bool else (1.0 if first.is_floating_point() else 1)
            if func is aten.nonzero.default:
                return self._counted(func, args, kwargs, torch.empty((first.numel(), first.dim()), dtype=torch.int64,
                                                                      device=META))
            if func is aten._to_copy.default and torch.device(kwargs.get("device") or META).type == "cpu":
                return torch.zeros(first.shape, dtype=kwargs.get("dtype") or first.dtype)
        return self._counted(func, args, kwargs, func(*args, **kwargs))

    def _counted(self, func, args, kwargs, out):
        if not self.count:
            return out
        formula = _FLOP_FORMULAS.get(func._overloadpacket)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            self.flops += flops
            if recomputing():
                self.recomputed_flops += flops
        # a view or an in-place result shares an input's storage: only storages the op allocated are new
        outputs = [t for t in _tensors(out) if t.is_meta]
        if outputs:
            inputs = {t.untyped_storage()._cdata for t in _tensors(args) + _tensors(kwargs) if t.is_meta}
            for value in outputs:
                storage = value.untyped_storage()
                key = storage._cdata
                if key not in inputs and key not in self._live:
                    self._live[key] = storage.nbytes()
                    self.current += self._live[key]
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)


@contextlib.contextmanager
def gpu_attention():
    """``F.scaled_dot_product_attention`` on meta tensors runs the memory-efficient kernel (whose meta
    implementation has the GPU kernel's outputs and saved tensors) instead of the math fallback the meta device
    would pick, which upcasts to float32 and materialises the ``[B, heads, T, T]`` scores. The function is
    replaced for the duration (a function mode would not reach gradient checkpointing's recomputation, which
    runs inside ``backward``); other devices call the original."""
    original = F.scaled_dot_product_attention

    def sdpa(query, *args, **kwargs):
        return (_efficient_attention if query.is_meta else original)(query, *args, **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _efficient_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attn_mask, float("-inf"))
    if attn_mask is not None:
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale)[0]


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or result: nested tuples, lists and dicts (what ATen passes)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


@dataclass
class DryRunReport:
    """What :func:`dry_run` measured (bytes and FLOPs; ``decisions`` per forward of the update)."""

    params: int
    trainable: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    update_peak_bytes: int           # parameters + everything the update allocated, at its peak
    act_batch: int
    act_flops_per_decision: float
    update_decisions: int            # decisions in one micro-batch's forward/backward
    update_model_flops_per_decision: float      # forward and backward, each once (MFU's numerator per decision)
    update_hardware_flops_per_decision: float   # plus the recomputed forwards of gradient checkpointing (HFU's)
    gradient_checkpointing: bool     # actor.fsdp.gradient_checkpointing of the run described
    published_tensors: int
    published_bytes: int
    ema_bytes: int = 0               # the moving average evaluation acts with (actor.ema_decay), beside the weights
    seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def dry_run_spec(cfg) -> EnvSpec:
    """The env spec the dry run's policy is built for, from the typed config alone (no simulator is started):
    the training env's cameras and image size, the model's action and proprio sizes (each where the env's or the
    policy's config class declares it)."""
    from embodirl.tools.memory_plan import UNSET_IMAGE_SIZE, sizing_spec

    env, model = cfg.env.train, cfg.model
    size = getattr(env, "image_size", None) or [getattr(model, "image_size", None) or UNSET_IMAGE_SIZE] * 2
    return sizing_spec(model, env.max_episode_steps, DRY_RUN_INSTRUCTION, cameras=getattr(env, "cameras", None) or ["camera"],
                       image_size=tuple(size), name=str(getattr(env, "name", None) or "dry_run"))


def dry_run_batch(policy, spec: EnvSpec, trajectories: int, decisions: int) -> TensorDict:
    """A trajectory batch shaped like a rollout of ``policy`` on ``spec`` (zeros; every decision valid)."""
    N, T = trajectories, decisions
    H, A, L = policy.action_chunk, policy.action_dim, policy.tokens_per_decision
    fields = {D.TASK_ID: torch.zeros(N, dtype=torch.int64), D.ACTION_CHUNK: torch.zeros(N, T, H, A),
              D.LOGPROB_BEHAVIOR: torch.zeros(N, T, L), D.REWARD: torch.zeros(N, T),
              D.TERMINATED: torch.zeros(N, T, dtype=torch.bool), D.TRUNCATED: torch.zeros(N, T, dtype=torch.bool),
              D.VALID: torch.ones(N, T, dtype=torch.bool), D.SUCCESS: torch.zeros(N, T, dtype=torch.bool),
              D.GROUP_ID: torch.zeros(N, dtype=torch.int64), D.INIT_STATE_ID: torch.zeros(N, dtype=torch.int64),
              D.EXECUTED: torch.ones(N, T, H, dtype=torch.bool)}
    if spec.camera_names:
        assert spec.image_size is not None      # a spec with cameras says their size
        h, w = spec.image_size
        fields[D.IMAGES] = torch.zeros(N, T, len(spec.camera_names), 3, h, w, dtype=torch.uint8)
    if spec.state_dim:
        fields[D.STATE] = torch.zeros(N, T, spec.state_dim)
    if policy.action_field == D.ACTION_TOKENS:
        fields[D.ACTION_TOKENS] = torch.full((N, T, L), policy.action_tokenizer.first_id, dtype=torch.int64)
    elif policy.action_field == D.ACTION_CHAIN:
        fields[D.ACTION_CHAIN] = torch.zeros(N, T, policy.chain_width)
    else:
        fields[D.ACTION_SAMPLE] = torch.zeros(N, T, L)
    if policy.value_type is not None:
        value_shape = (N, T) if policy.value_type == D.CHUNK_LEVEL else (N, T, H)
        fields[D.VALUE] = torch.zeros(value_shape)
    return D.make_trajectory(fields)


def _observation(spec: EnvSpec, batch: int) -> dict:
    obs: dict = {D.TASK_ID: torch.zeros(batch, dtype=torch.int64), "instruction": [DRY_RUN_INSTRUCTION] * batch}
    if spec.camera_names:
        assert spec.image_size is not None      # a spec with cameras says their size
        h, w = spec.image_size
        obs[D.IMAGES] = torch.zeros(batch, len(spec.camera_names), 3, h, w, dtype=torch.uint8)
    if spec.state_dim:
        obs[D.STATE] = torch.zeros(batch, spec.state_dim)
    return obs


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def dry_run(cfg, *, act_batch: int | None = None) -> DryRunReport:
    """Build ``cfg.model`` on the meta device and run, as a GPU run would: ``act`` on a rollout batch, one
    actor update of :data:`DRY_RUN_TRAJECTORIES` trajectories in micro-batches of one
    (``actor.micro_batch_size``'s unit; each of ``rollout.max_decisions`` or the episode's decisions), and
    one full publication. ``act_batch``: default one env worker's share of ``env.train.num_envs``. ``cfg``: the typed
    config (a composed one is converted)."""
    from embodirl.actor.actor import Actor, prepare_batch
    from embodirl.actor.settings import ActorSettings
    from embodirl.models.registry import make_policy
    from embodirl.rollout.records import decisions_per_episode
    from embodirl.schema import run_config
    from embodirl.tools.memory_plan import meta_model
    from embodirl.workers.inference_worker import TRAIN, sampling_from_config

    cfg = run_config(cfg)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    spec = dry_run_spec(cfg)
    policy = make_policy(meta_model(cfg.model), spec)   # as a GPU run builds it: model.device names the device
    seconds["build"] = time.perf_counter() - t0
    act_batch = int(act_batch or max(1, cfg.env.train.num_envs // cfg.env_workers.num_workers))

    sampling = sampling_from_config(cfg.rollout)[TRAIN]    # as the inference workers sample in training
    t0 = time.perf_counter()
    flops = MetaDryRun(count=True)
    with gpu_attention(), flops:
        out = policy.act(_observation(spec, act_batch), sampling)
    act_flops = flops.flops / act_batch
    for key, value in out.items():
        if value.device != META:
            raise RuntimeError(f"act returned '{key}' on {value.device}, not on the policy's device (meta)")
    seconds["act"] = time.perf_counter() - t0

    T = decisions_per_episode(cfg)
    base = cfg.algorithm
    adv_type = "gae" if policy.value_type is not None else "grpo"
    algorithm = dataclasses.replace(base, adv_type=adv_type, update_epochs=1, early_stop_kl=None,
                                    group_size=DRY_RUN_TRAJECTORIES if adv_type == "grpo" else 1,
                                    filter_groups=dataclasses.replace(base.filter_groups, enable=False))
    actor = dataclasses.replace(cfg.actor, micro_batch_size=1, global_batch_size=1,
                                replay_buffer=dataclasses.replace(cfg.actor.replay_buffer, reuse_last_k=0))
    actor = Actor(policy, ActorSettings(algorithm=algorithm, actor=actor), task_table=spec.task_descriptions,
                      temperature=sampling.temperature, device=META)
    prepared, _ = prepare_batch(dry_run_batch(policy, spec, DRY_RUN_TRAJECTORIES, T), algorithm)
    params = list(policy.parameters())
    param_bytes = _nbytes(params) + _nbytes(policy.buffers())
    trainable = [p for p in params if p.requires_grad]

    t0 = time.perf_counter()
    live = MetaDryRun(count=True)
    with gpu_attention(), live:
        actor.update(prepared)
    seconds["update"] = time.perf_counter() - t0
    optimizer_bytes = _nbytes(v for state in actor.optimizer.state.values() for v in state.values()
                              if isinstance(v, torch.Tensor) and v.device == META)
    grad_bytes = _nbytes(trainable)
    hardware_flops = live.flops / (DRY_RUN_TRAJECTORIES * T)
    model_flops = (live.flops - live.recomputed_flops) / (DRY_RUN_TRAJECTORIES * T)

    t0 = time.perf_counter()
    with MetaDryRun():
        _, published = actor.publish_weights(full=True)
        if actor.swap_ema():   # actor.ema_decay: an evaluation's exchange of the weights with their average, and back
            actor.swap_ema()
    seconds["publish"] = time.perf_counter() - t0
    ema_bytes = _nbytes(actor.ema.values()) if actor.ema is not None else 0
    return DryRunReport(
        params=sum(p.numel() for p in params), trainable=sum(p.numel() for p in trainable), param_bytes=param_bytes,
        grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
        activation_bytes=max(0, live.peak - grad_bytes - optimizer_bytes),
        update_peak_bytes=param_bytes + ema_bytes + live.peak, ema_bytes=ema_bytes,
        act_batch=act_batch, act_flops_per_decision=float(act_flops), update_decisions=T,
        update_model_flops_per_decision=float(model_flops), update_hardware_flops_per_decision=float(hardware_flops),
        gradient_checkpointing=bool(cfg.actor.fsdp.gradient_checkpointing), published_tensors=len(published),
        published_bytes=_nbytes(published.values()), seconds=seconds)


def _si(value: float, unit: str) -> str:
    """``value`` with a decimal prefix: 8.84 TFLOP, 501 MB."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _bytes(value: float) -> str:
    for factor, unit in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {unit}"
    return f"{int(value)} B"


def format_report(report: DryRunReport | Mapping) -> str:
    """The report as a few lines of text."""
    r = report.as_dict() if isinstance(report, DryRunReport) else dict(report)
    return "\n".join([
        f"parameters: {_si(r['params'], '')} ({_si(r['trainable'], '')} trainable), {_bytes(r['param_bytes'])}",
        f"act: {_si(r['act_flops_per_decision'], 'FLOP')} per decision (batch {r['act_batch']})",
        f"update: {_si(r['update_model_flops_per_decision'], 'FLOP')} model FLOPs per decision (forward and "
        f"backward, {r['update_decisions']} decisions per micro-batch); "
        + (f"{_si(r['update_hardware_flops_per_decision'], 'FLOP')} hardware FLOPs with gradient checkpointing's "
           "recomputation" if r['gradient_checkpointing'] else "no gradient checkpointing: hardware FLOPs = model FLOPs"),
        f"actor bytes: gradients {_bytes(r['grad_bytes'])}, optimizer state {_bytes(r['optimizer_bytes'])}, "
        f"activations {_bytes(r['activation_bytes'])}"
        + (f", moving average {_bytes(r['ema_bytes'])}" if r.get("ema_bytes") else "")
        + f"; peak {_bytes(r['update_peak_bytes'])}",
        f"publication: {r['published_tensors']} tensors, {_bytes(r['published_bytes'])}",
    ])
