"""FSDP2 wrapping of a policy and the few torch.distributed helpers the actor needs.

:func:`wrap_policy` applies ``torch.distributed.fsdp.fully_shard`` to each *unit* of the policy
(transformer blocks) and then to the root, with a :class:`MixedPrecisionPolicy` (e.g. bf16 compute,
fp32 gradient reduction) and optionally :class:`CPUOffloadPolicy`. Units are the modules whose class
name appears in a ``_no_split_modules`` list of the policy or any of its submodules - transformers'
own declaration of its blocks (``LlamaDecoderLayer``, ``Dinov2Layer``, ``SiglipEncoderLayer``, ...);
a policy without one (a small MLP) is sharded as a single unit.

Gradients are *summed* across ranks (divide factor 1, SUM-only collectives, which gloo supports):
the loss aggregation already divides by global counts (:mod:`embodirl.algorithms.aggregation`), so
the sum of the rank gradients is the full-batch gradient.

Without an initialised process group nothing here is needed: the actor runs the plain module in
the calling process. Process groups are started by the caller (:func:`init_process_group`): gloo
on CPU, NCCL on GPU, any number of nodes. The actor ranks meet at a :func:`tcp_store` that rank 0 opens on a port
the kernel picks and keeps open (no free port looked up first and bound again later, which another process could
take in between).
"""

from __future__ import annotations

import logging
import os
import threading
import types
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

from embodirl.dtypes import DTYPES

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

#: methods of a policy that run its forward computation outside ``forward`` (FSDP2 must see them)
FORWARD_METHODS = ("score_actions", "act", "supervised")


# --- process group ------------------------------------------------------------------------------------
def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def collective_library(device: torch.device) -> str:
    """torch.distributed's communication library for ``device``'s tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def default_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` when a GPU is visible, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def tcp_store(host: str, port: int, world_size: int, *, is_master: bool, timeout_s: float = 1800.0) -> dist.TCPStore:
    """The rendezvous store of a process group: the master (rank 0) listens on ``port`` (0: a port the kernel picks,
    then ``.port``), the other ranks connect to ``host:port``."""
    import datetime

    return dist.TCPStore(host, int(port), int(world_size), is_master, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def init_process_group(*, rank: int, world_size: int, master_addr: str | None = None, master_port: int | None = None,
                       device: torch.device | None = None, timeout_s: float = 1800.0,
                       store: dist.Store | None = None) -> None:
    """Join the actor's process group (gloo on CPU, NCCL on GPU) through ``store`` (:func:`tcp_store`), or over
    TCP at ``master_addr:master_port``."""
    import datetime

    device = device or default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    where = {"store": store} if store is not None else {"init_method": f"tcp://{master_addr}:{master_port}"}
    dist.init_process_group(collective_library(device), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **where)


def host_device(device: torch.device) -> torch.device:
    """Where the actor keeps the small tensors its Python control flow reads (loss normalisers, metric
    sums, flags): the CPU in a single process, so that reading them never waits for the accelerator; the
    compute ``device`` when a process group reduces them (NCCL reduces device tensors only)."""
    return torch.device(device) if is_distributed() and world_size() > 1 else torch.device("cpu")


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce across the actor ranks (identity in a single process)."""
    if is_distributed() and world_size() > 1:
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor


def all_gather_ints(value: int, device: torch.device) -> list[int]:
    if not is_distributed() or world_size() == 1:
        return [int(value)]
    out = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(world_size())]
    dist.all_gather(out, torch.tensor(int(value), dtype=torch.int64, device=device))
    return [int(x) for x in out]


# --- wrapping -----------------------------------------------------------------------------------------
def shard_units(policy: nn.Module) -> list[nn.Module]:
    """The modules to shard individually (see module docstring), outermost first, root excluded."""
    names: set[str] = set()
    for module in policy.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    units, seen = [], set()
    for module in policy.modules():
        if module is policy or type(module).__name__ not in names:
            continue
        if any(id(parent) in seen for parent in _ancestors(policy, module)):
            continue  # a block inside a block is sharded with its parent
        seen.add(id(module))
        units.append(module)
    return units


def _ancestors(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    path: list[nn.Module] = []

    def visit(module: nn.Module) -> bool:
        for child in module.children():
            if child is target:
                return True
            path.append(child)
            if visit(child):
                return True
            path.pop()
        return False

    visit(root)
    return path


def compile_units(modules: Iterable[nn.Module]) -> int:
    """Compile each module's own ``forward`` in place with ``torch.compile`` (regional compilation,
    ``actor.compile``); returns how many were compiled. The graphs are built at the first call.

    Call it before :func:`enable_gradient_checkpointing` (the checkpoint then runs, and recomputes, the
    compiled forward) and before :func:`wrap_policy`: FSDP2's hooks stay outside the graphs, which is
    how per-block compilation composes with ``fully_shard``. Dynamo keeps its graphs per code object,
    and transformers wraps every block class's ``forward`` in one shared ``forward_with_checkpointing``
    (``GradientCheckpointingLayer``): compiling that wrapper would put all block classes into one cache
    of ``recompile_limit`` entries. So the class's own forward under the wrapper is compiled, one cache
    per block class, whose blocks share its graphs."""
    count = 0
    for module in modules:
        if "forward" in vars(module):
            raise RuntimeError(f"{type(module).__name__}.forward is already replaced (checkpointed or compiled); "
                               "compile the blocks first")
        if getattr(module, "gradient_checkpointing", False):
            # transformers' own checkpointing lives in the wrapper this skips
            raise RuntimeError(f"{type(module).__name__} has transformers' gradient checkpointing on "
                               "(model.gradient_checkpointing); use actor.fsdp.gradient_checkpointing with actor.compile")
        module.forward = torch.compile(types.MethodType(_own_forward(type(module)), module))
        count += 1
    return count


def _own_forward(cls: type[nn.Module]) -> Callable[..., Any]:
    """``cls.forward`` without transformers' ``forward_with_checkpointing`` wrapper(s)."""
    forward: Any = cls.forward       # a wrapper carries the function it wraps as __wrapped__
    while getattr(getattr(forward, "__code__", None), "co_name", None) == "forward_with_checkpointing":
        forward = forward.__wrapped__
    return forward


#: depth of checkpointed forwards being recomputed in backward now (read by the dry run's FLOP count, which counts
#: the recomputation as hardware FLOPs and not as model FLOPs)
_recomputing = threading.local()


def recomputing() -> bool:
    """Whether the operators running now recompute a checkpointed forward inside backward."""
    return getattr(_recomputing, "depth", 0) > 0


def _marking_recomputation(fn):
    """``fn`` that marks its calls from inside backward (the checkpoint's recomputation; the first call, in forward,
    runs with no autograd node current) for :func:`recomputing`."""
    def run(*args, **kwargs):
        if torch._C._current_autograd_node() is None:
            return fn(*args, **kwargs)
        _recomputing.depth = getattr(_recomputing, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _recomputing.depth -= 1
    return run


def enable_gradient_checkpointing(modules: Iterable[nn.Module]) -> int:
    """Recompute each module's activations in backward (``torch.utils.checkpoint``, non-reentrant).

    The module's ``forward`` is wrapped in place, so parameter names - which weight publishing and
    checkpoints rely on - do not change (``checkpoint_wrapper`` would insert a prefix). Composes with
    FSDP2: the unit's parameters are gathered again by its pre-backward hook before recomputation."""
    from torch.utils.checkpoint import checkpoint

    count = 0
    for module in modules:
        if getattr(module, "_embodirl_checkpointed", False):
            continue
        inner = module.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_marking_recomputation(_inner), *args, use_reentrant=False, **kwargs)

        module.forward = forward
        # nn.Module.__setattr__ is annotated for tensors and modules only; it stores any other value as a plain attribute
        module._embodirl_checkpointed = True  # type: ignore[assignment]
        count += 1
    return count


def upcast_trainable_(policy: nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """Keep trainable parameters (the optimizer's master weights) in ``dtype``; frozen ones keep theirs."""
    for param in policy.parameters():
        if param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)


def model_dtype(policy: nn.Module) -> torch.dtype:
    """The dtype the policy computes in: that of its frozen floating-point weights (else any)."""
    floating = [p for p in policy.parameters() if p.is_floating_point()]
    frozen = [p for p in floating if not p.requires_grad]
    return (frozen or floating)[0].dtype if floating else torch.float32


def wrap_policy(policy: nn.Module, *, device: torch.device, param_dtype: torch.dtype | None,
                reduce_dtype: torch.dtype | None, cpu_offload: bool) -> nn.Module:
    """Shard ``policy`` in place with FSDP2 over all ranks of the default process group.

    Compute runs in ``param_dtype`` (None: the model's own dtype, e.g. bf16 for OpenVLA-OFT); the
    trainable parameters - the sharded master weights the optimizer updates - are kept in fp32 and
    cast for forward/backward; gradients are reduced in ``reduce_dtype``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    if not is_distributed():
        raise RuntimeError("FSDP2 needs an initialised torch.distributed process group")
    compute_dtype = param_dtype or model_dtype(policy)
    if compute_dtype != torch.float32:
        param_dtype = compute_dtype
        upcast_trainable_(policy)
    mesh = init_device_mesh(device.type, (world_size(),))
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # pinned host memory needs an accelerator; on a CPU-only machine offloading is a plain CPU copy
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    units = shard_units(policy)
    # a unit whose parameters get gradients through something other than its outputs (π0's VLM layers: their keys and
    # values reach the action expert through the cache) stays gathered from its forward to its backward; FSDP2's
    # pre-backward hook, which would gather it again, fires only on gradients of the unit's outputs
    kept = getattr(policy, "fsdp_keeps_gathered", lambda unit: False)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=not kept(unit))
    fully_shard(policy, mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    for method in FORWARD_METHODS:
        if callable(getattr(policy, method, None)):
            register_fsdp_forward_method(policy, method)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    log.info("FSDP2: %d unit(s) + root over %d rank(s), param_dtype=%s reduce_dtype=%s cpu_offload=%s",
             len(units), world_size(), param_dtype, reduce_dtype, cpu_offload)
    return policy


def actor_compute_dtype(actor_fsdp, model_dtype: str) -> str | None:
    """The dtype actor ranks with a process group (the Ray actor group) compute the trainable tensors in:
    FSDP2's ``param_dtype`` (default: the model's dtype) when they shard with FSDP2, as
    :class:`~embodirl.actor.actor.Actor` decides it; else None (their float32 master weights compute
    themselves). FSDP2 is on with ``actor.fsdp.enabled: true``, and with ``auto`` for several ranks or a
    low-precision model - the rank count changes nothing here, since a float32 model then computes in float32."""
    enabled = actor_fsdp.enabled            # the typed actor.fsdp section
    low_precision = DTYPES.get(model_dtype, torch.float32) != torch.float32
    if enabled is True or (enabled == "auto" and low_precision):
        return actor_fsdp.param_dtype or model_dtype
    return None


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The un-sharded value of a (possibly FSDP2 DTensor) parameter; collective under FSDP."""
    data = param.detach()
    return data.full_tensor() if hasattr(data, "full_tensor") else data


def is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor (an FSDP2 shard), without importing torch.distributed.tensor."""
    return hasattr(tensor, "device_mesh")


def reshard(module: nn.Module) -> None:
    """Free the gathered parameters of an FSDP2-wrapped ``module`` (:func:`wrap_policy`), keeping this rank's shards."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        raise TypeError(f"{type(module).__name__} is not sharded with FSDP2")
    module.reshard()


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly FSDP2 DTensor) tensor, sharing its storage (in-place writes land in it)."""
    data = param.detach()
    return data.to_local() if hasattr(data, "to_local") else data
