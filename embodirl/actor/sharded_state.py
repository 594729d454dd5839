"""The actor's resumable state on disk: written by every rank at once, read by any number of ranks.

A checkpoint's ``actor/`` folder holds::

    tensors/shard-<rank>-model-00001-of-00001.safetensors   trainable parameters and AdamW moments:
                                                            each rank writes its own FSDP2 shards
    state.json                                              counters, LR schedule, KL controller, the
                                                            optimizer's per-group settings, world size
    replay_rank<r>.safetensors / .json                      a rank's held rollouts (replay buffer on)

The tensors go through ``torch.distributed.checkpoint`` with its safetensors storage: no rank
gathers the full state, shard offsets are kept in the files' JSON metadata, and loading into another
number of ranks (2 -> 1, 1 -> 2) reshards on read. Nothing here is pickled, so a checkpoint someone
shares cannot run code on the machine that resumes it (DCP's default storage pickles its metadata).

Only trainable parameters are saved (``ignore_frozen_params``): the frozen base comes from
``model.path`` (or the seeded initialisation) and the policy export beside this folder.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from embodirl.actor import fsdp

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType

log = logging.getLogger(__name__)

TENSORS = "tensors"
STATE = "state.json"
_MODEL, _OPTIM, _EMA = "model.", "optim.", "ema."


def is_sharded_state(folder: str | Path) -> bool:
    return (Path(folder) / STATE).is_file()


def _options(*, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=True, strict=strict)


def _tensor_state(actor) -> tuple[dict[str, ValueType], dict[str, Any]]:
    """(tensors keyed ``model.<fqn>`` / ``optim.<key>``, the optimizer's non-tensor entries)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(actor.policy, actor.optimizer, options=_options())
    tensors: dict[str, ValueType] = {_MODEL + k: v for k, v in model_sd.items()}
    settings: dict[str, Any] = {}
    for key, value in optim_sd.items():
        if isinstance(value, torch.Tensor):
            tensors[_OPTIM + key] = value
        else:
            settings[key] = value
    return tensors, settings


def save_actor(actor, folder: str | Path) -> None:
    """Write ``actor``'s state into ``folder`` (collective: every rank calls it with the same folder)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    folder = Path(folder)
    rank = fsdp.rank()
    # before the first optimizer step AdamW has no state; torch's state-dict API creates it by a zero-learning-rate
    # step (its _init_optim_state), which would start Adam's step counters at 1 and change the run: put it back
    fresh = not actor.optimizer.state
    tensors, settings = _tensor_state(actor)
    if fresh:
        actor.optimizer.state.clear()
    if actor.ema is not None:   # actor.ema_decay: the moving average evaluation acts with, sharded as its tensors
        if actor.ema_swapped:
            raise RuntimeError("saving while the module holds the moving average; swap it back first")
        tensors.update({_EMA + name: value for name, value in actor.ema.items()})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(folder / TENSORS), save_distributed=True))
    rollouts = actor.replay.state_dict()
    if rollouts["rollouts"]:
        _save_replay(folder, rank, rollouts)
    if rank == 0:
        state = {"version": actor.version, "optimizer_steps": actor.optimizer_steps, "world_size": fsdp.world_size(),
                 "kl_ctrl": actor.kl_ctrl.state_dict(), "scheduler": actor.scheduler.state_dict(),
                 "optimizer_settings": settings, "replay_dropped_rows": rollouts["dropped_rows"],
                 "replay_ranks": bool(rollouts["rollouts"]), "fresh_optimizer": fresh}
        (folder / STATE).write_text(json.dumps(state, indent=1))


def load_actor(actor, folder: str | Path) -> None:
    """Restore what :func:`save_actor` wrote, whatever number of ranks wrote it (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import set_state_dict

    folder = Path(folder)
    state = json.loads((folder / STATE).read_text())
    tensors, _ = _tensor_state(actor)        # the layout to read into (fresh AdamW moments included)
    saved = _saved_keys(folder / TENSORS)
    # moments of tensors that never received a gradient (GRPO's idle value head) were never created
    missing = [k for k in tensors if k not in saved]
    if any(k.startswith(_MODEL) for k in missing):
        raise ValueError(f"the checkpoint's actor state lacks trainable tensor(s) {missing[:3]}: it was written "
                         "for another model or LoRA configuration")
    for key in missing:
        tensors.pop(key)
    # the moving average (actor.ema_decay), read in place; a checkpoint written without one starts it at the weights
    ema_saved = actor.ema is not None and all(_EMA + name in saved for name in actor.ema)
    if ema_saved:
        tensors.update({_EMA + name: value for name, value in actor.ema.items()})
    # ... and must not exist after loading either: reading the layout above gave every trainable tensor fresh
    # moments, which torch's unflattening would then look for in the checkpoint (and fill with empty dicts)
    params = dict(actor.policy.named_parameters())
    state_prefix = _OPTIM + "state."
    for key in missing:
        if key.startswith(state_prefix):
            param = params.get(key[len(state_prefix):].rsplit(".", 1)[0])
            if param is not None:
                actor.optimizer.state.pop(param, None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(folder / TENSORS)),
                 planner=DefaultLoadPlanner(allow_partial_load=True))
    model_sd = {k[len(_MODEL):]: v for k, v in tensors.items() if k.startswith(_MODEL)}
    # flattened (flatten_optimizer_state_dict): one level of dotted keys to tensors and group settings, which torch's
    # annotation of an optimizer state (nested per-parameter dicts) does not describe
    optim_sd: dict[str, Any] = {k[len(_OPTIM):]: v for k, v in tensors.items() if k.startswith(_OPTIM)}
    if actor.ema is not None and not ema_saved:
        log.info("the checkpoint %s holds no moving average of the weights (actor.ema_decay): it starts at them", folder)
    # the settings of groups whose moments exist; settings are JSON (betas come back as lists)
    for key, value in state["optimizer_settings"].items():
        optim_sd[key] = tuple(value) if key.endswith(".betas") else value
    set_state_dict(actor.policy, actor.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=_options(strict=False))
    if state.get("fresh_optimizer"):      # saved before any optimizer step: no AdamW state, as then
        actor.optimizer.state.clear()
    actor.scheduler.load_state_dict(state["scheduler"])
    actor.kl_ctrl.load_state_dict(state["kl_ctrl"])
    actor.version, actor.optimizer_steps = int(state["version"]), int(state["optimizer_steps"])
    actor.replay.load_state_dict(_load_replay(folder, state))
    if actor.ema is not None and not ema_saved:
        actor.reset_ema()


def _saved_keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            keys.update(handle.keys())
    return keys


def _save_replay(folder: Path, rank: int, rollouts: dict) -> None:
    from safetensors.torch import save_file

    flat, sizes = {}, []
    for i, rollout in enumerate(rollouts["rollouts"]):
        td = TensorDict(rollout["data"], batch_size=rollout["batch_size"]).flatten_keys(".")
        flat.update({f"{i}/{k}": td.get(k).contiguous() for k in td.keys()})
        sizes.append(rollout["batch_size"])
    save_file(flat, str(folder / f"replay_rank{rank}.safetensors"))
    (folder / f"replay_rank{rank}.json").write_text(json.dumps({"batch_sizes": sizes}))


def _load_replay(folder: Path, state: dict) -> dict:
    """This rank's held rollouts; none (with a warning) when the number of ranks changed."""
    empty = {"rollouts": [], "dropped_rows": int(state.get("replay_dropped_rows", 0))}
    if not state.get("replay_ranks"):
        return empty
    if int(state["world_size"]) != fsdp.world_size():
        log.warning("the checkpoint's replay buffer was split over %d actor ranks, this run has %d: training "
                    "resumes with an empty replay buffer", state["world_size"], fsdp.world_size())
        return empty
    from safetensors.torch import load_file

    rank = fsdp.rank()
    sizes = json.loads((folder / f"replay_rank{rank}.json").read_text())["batch_sizes"]
    flat = load_file(str(folder / f"replay_rank{rank}.safetensors"))
    rollouts = []
    for i, size in enumerate(sizes):
        fields = {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith(f"{i}/")}
        rollouts.append({"batch_size": size, "data": TensorDict(fields, batch_size=size).unflatten_keys(".").to_dict()})
    return {**empty, "rollouts": rollouts}
