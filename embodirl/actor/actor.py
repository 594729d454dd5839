"""The actor: turns prepared trajectory batches into policy updates, and publishes the new weights.

One training step, as the runner drives it::

    batch = actor.compute_ref_logprob(batch)          # only when a KL term is on (reference forward)
    batch, m = prepare_batch(batch, cfg.algorithm,       # driver side, on the WHOLE rollout batch:
                             kl_coef=actor.kl_coef)     #   KL reward penalty, group filter, advantages
    metrics = actor.update(shard)                       # every rank, its shard of rows
    version, tensors = actor.publish_weights()          # every rank (FSDP gathers); rank 0 sends

:meth:`Actor.step` does all of it in one process (with the replay buffer) for the plain in-process
path and tests.

Inside :meth:`Actor.update`, for ``update_epochs`` epochs the rows are shuffled and cut into
optimizer steps of ``global_batch_size / world_size`` rows per rank, each run as micro-batches of
``micro_batch_size`` rows with gradient accumulation (the update stops early after an optimizer step
whose approximate KL to the behaviour policy exceeds ``algorithm.early_stop_kl``). Only valid decisions go through the policy
(their outputs are scattered back to ``[n, T, ...]``); the loss normalisers are counted on the whole
optimizer step over all ranks before any forward pass, so the summed gradient equals the full-batch
gradient (:mod:`embodirl.algorithms.aggregation`). The actor works with or without
torch.distributed: with more than one rank the policy is sharded with FSDP2 (:mod:`.fsdp`).

Beside the update: the batch preparation and checks (:mod:`.batch`), the whole-batch metrics (:mod:`.metrics`),
the optimizer and its non-finite guard (:mod:`.optim`), the moving average of the weights (:mod:`.ema`) and the
supervised step (:mod:`.sft`).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from embodirl import data as D
from embodirl.actor import fsdp, sft
from embodirl.actor.batch import check_batch, prepare_batch  # prepare_batch: imported from here by the driver side
from embodirl.actor.ema import MovingAverage, stepped
from embodirl.actor.metrics import batch_metrics, gap_metrics, measured_kl
from embodirl.actor.optim import (
    build_optimizer,
    check_finite,
    clip_grad_norm,
    lr_schedule,
    refresh_lr,
    trainable_named_parameters,
)
from embodirl.actor.replay_buffer import ReplayBuffer, row_versions
from embodirl.actor.settings import ActorSettings, HasActorSections
from embodirl.algorithms import behaviour_gap, losses
from embodirl.dtypes import parse_dtype
from embodirl.errors import ConfigError
from embodirl.models.base import Policy, scoring_temperature
from embodirl.progress import Ticker

log = logging.getLogger(__name__)

#: truncation of the replay importance weight pi_prox / pi_behaviour (V-trace's rho-bar, Espeholt et al. 2018)
REPLAY_MAX_IMPORTANCE_WEIGHT = 1.0


@dataclass
class _Rows:
    """One update's rows on this rank (on the CPU) and what each of its optimizer steps reads with them."""
    batch: TensorDict
    old_logprob: torch.Tensor              # (N, T, L): the log-probs the ratio is taken to
    is_weight: torch.Tensor | None         # (N, T, L') truncated importance weights, when the loss applies them
    is_cap: float | None                   # ... and the cap they were truncated at
    L: int                                 # per-decision log-prob entries (tokens, dims)
    action_dim: int
    value_dims: int
    kl_coef: float                         # the KL loss term's coefficient (0: no KL loss)


@dataclass
class _Progress:
    """How far one update got: its optimizer steps' metrics, the steps it skipped (no valid decision on any rank),
    whether KL early stopping ended it, and what its first optimizer step measured (max |ratio - 1| on this rank,
    the behaviour/learner log-prob gap statistics of its tokens)."""
    first_ratio_error: torch.Tensor
    step_metrics: list[dict[str, torch.Tensor]] = field(default_factory=list)
    skipped: int = 0
    stopped: bool = False
    gap_stats: torch.Tensor | None = None

    @property
    def first_step(self) -> bool:
        """Whether the optimizer step under way is the update's first (on-policy rows: its ratio is 1)."""
        return not self.step_metrics and not self.skipped

    def record_first_step(self, logprob: torch.Tensor, old: torch.Tensor, fields: TensorDict, rows: _Rows) -> None:
        """Add a micro-batch of the first optimizer step: the learner's ``logprob`` against the ratio's ``old``
        and against the behaviour log-probs in ``fields`` (on the device)."""
        executed = fields.get(D.EXECUTED) if D.EXECUTED in fields.keys() else None
        self.first_ratio_error = torch.maximum(self.first_ratio_error, losses.max_ratio_error(
            logprob, old, fields.get(D.VALID), action_dim=rows.action_dim, executed=executed))
        self.gap_stats = behaviour_gap.merge(self.gap_stats, behaviour_gap.statistics(
            logprob, fields.get(D.LOGPROB_BEHAVIOR),
            behaviour_gap.token_mask(fields.get(D.VALID), rows.L, action_dim=rows.action_dim, executed=executed)))


class Actor:
    """Trainable policy + optimizer on this rank (see module docstring).

    ``cfg`` holds the ``algorithm`` and ``actor`` nodes (DictConfig or dict). ``task_table`` maps
    ``task_id`` to instructions; ``temperature`` must be the rollout's sampling temperature so that
    recomputed log-probs refer to the behaviour distribution. ``device`` defaults to this rank's GPU,
    else the CPU. Call collectively on every rank when torch.distributed is initialised.
    """

    def __init__(self, policy: Policy, cfg: Mapping | HasActorSections, *, task_table: Sequence[str], temperature: float = 1.0,
                 device: torch.device | str | None = None):
        self.cfg = ActorSettings.from_config(cfg)
        self.world_size, self.rank = fsdp.world_size(), fsdp.rank()
        self.cfg.check(self.world_size)
        self.device = torch.device(device) if device is not None else fsdp.default_device()
        self.host = fsdp.host_device(self.device)   # where the control flow's small tensors live
        self.task_table = list(task_table)
        # greedy rollouts (rollout.temperature=0) were scored at temperature 1: recompute them there
        self.temperature = scoring_temperature(temperature)
        alg, act = self.cfg.algorithm, self.cfg.actor
        if alg.uses_critic and policy.value_type is None:
            from embodirl.algorithms.estimators import ESTIMATORS, uses_critic

            without = "/".join(n for n in ESTIMATORS.available() if not uses_critic(n))
            raise ConfigError("algorithm.adv_type", f"{alg.adv_type} needs a value head but "
                                                    f"{type(policy).__name__} has none; use {without}")
        if act.fsdp.full_finetune:
            policy.requires_grad_(True)
        policy.to(self.device)
        low_precision = fsdp.model_dtype(policy) != torch.float32
        # auto: FSDP2 for several ranks, and for a low-precision model whenever a process group exists
        # (its mixed-precision policy keeps fp32 master weights and computes in the model's dtype)
        self.use_fsdp = act.fsdp.enabled is True or (
            act.fsdp.enabled == "auto" and (self.world_size > 1 or (low_precision and fsdp.is_distributed())))
        if self.world_size > 1 and not self.use_fsdp:
            raise ConfigError("actor.fsdp.enabled", f"{self.world_size} actor ranks need FSDP2; set it to auto or true")
        if self.use_fsdp and not fsdp.is_distributed():
            raise ConfigError("actor.fsdp.enabled", "FSDP2 needs the actor group's process group; run the actor "
                                                    "through the actor group or set actor.fsdp.enabled=auto")
        units = fsdp.shard_units(policy)
        if act.compile:   # before checkpointing and sharding wrap the blocks (fsdp.compile_units)
            if fsdp.compile_units(units):
                log.info("actor.compile: %d blocks of %s compile at their first call", len(units), type(policy).__name__)
            else:
                log.warning("actor.compile: %s declares no blocks (_no_split_modules); nothing to compile",
                            type(policy).__name__)
        if act.fsdp.gradient_checkpointing:
            if not fsdp.enable_gradient_checkpointing(units):
                log.warning("gradient checkpointing: %s declares no blocks (_no_split_modules); nothing to "
                            "checkpoint", type(policy).__name__)
        if self.use_fsdp:
            fsdp.wrap_policy(policy, device=self.device, param_dtype=parse_dtype(act.fsdp.param_dtype),
                             reduce_dtype=parse_dtype(act.fsdp.reduce_dtype), cpu_offload=act.fsdp.cpu_offload)
        else:
            if act.fsdp.param_dtype is not None or act.fsdp.cpu_offload:
                log.info("single-process actor without FSDP: actor.fsdp.param_dtype/cpu_offload do not apply")
            # fp32 master weights here too: the trainable modules (peft LoRA layers, the value head)
            # cast their inputs to their own dtype, the frozen base keeps computing in its dtype
            fsdp.upcast_trainable_(policy)
        self.policy = policy
        self.optimizer = build_optimizer(policy, act.optim)
        self.version = 0          # policy version: +1 per update() call (the LR decay's clock)
        self.scheduler = lr_schedule(self.optimizer, act.optim, lambda: self.version)
        self.kl_ctrl = alg.kl_controller()
        self.replay = ReplayBuffer.from_config(act.replay_buffer)
        self._trainable = trainable_named_parameters(policy)
        self._changed: set[str] = set()
        self.optimizer_steps = 0
        self._steps_before_update = 0
        # actor.ema_decay > 0: evaluation acts with an exponential moving average of the trainable tensors (one
        # average per update), a copy of each on the tensor's own device (FSDP2: this rank's shard)
        self.ema_decay = float(act.ema_decay)
        self._ema = MovingAverage(self._trainable, self.optimizer, self.ema_decay) if self.ema_decay > 0 else None

    # --- public API ----------------------------------------------------------------------------------
    @property
    def kl_coef(self) -> float:
        return self.kl_ctrl.value

    @property
    def ema(self) -> dict[str, torch.Tensor] | None:
        """The moving average (``actor.ema_decay > 0``) of each trainable tensor by name, on its device (FSDP2: this
        rank's shard); None without one."""
        return None if self._ema is None else self._ema.tensors

    @property
    def ema_swapped(self) -> bool:
        """Whether the module holds the moving average now (between the two :meth:`swap_ema` calls)."""
        return self._ema is not None and self._ema.swapped

    def compute_ref_logprob(self, batch: TensorDict) -> TensorDict:
        """``logprob_ref`` of the behaviour actions under the reference policy (adapter disabled)."""
        # peft switches adapters off and on by toggling requires_grad on whatever parameters the
        # modules hold at that moment. Under FSDP2 the root keeps its gathered parameters after a
        # forward, so both toggles must happen while the modules hold the sharded parameters (the
        # optimizer's); otherwise the root's trainable tensors silently stop receiving gradients.
        self._reshard()
        try:
            with self.policy.reference_mode():
                ref = self._logprob_no_grad(batch)
                self._reshard()
        except NotImplementedError as exc:
            raise ConfigError("algorithm.kl_beta", f"{exc}; set algorithm.kl_beta=0") from None
        out = batch.copy()
        out.set(D.LOGPROB_REF, ref)
        return out

    def prepare(self, batch: TensorDict) -> tuple[TensorDict, dict[str, torch.Tensor]]:
        """Single-process preparation of a whole rollout: reference log-probs when a KL term is on,
        then :func:`prepare_batch`."""
        if self.cfg.algorithm.kl_active and D.LOGPROB_REF not in batch.keys():
            batch = self.compute_ref_logprob(batch)
        return prepare_batch(batch, self.cfg.algorithm, kl_coef=self.kl_coef)

    def step(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """prepare -> replay buffer -> update, in one process (the plain in-process path)."""
        prepared, metrics = self.prepare(batch)
        metrics.update(self.train(prepared))
        return metrics

    def train(self, prepared: TensorDict) -> dict[str, torch.Tensor]:
        """This rank's prepared rows -> replay buffer -> update (what an actor rank runs each step)."""
        self.replay.add(prepared, version=self.version)
        metrics = self.update(self.replay.sample(self.version))
        observe = getattr(self.policy, "observe_batch", None)
        if observe is not None:
            # statistics the policy keeps of its training inputs (the state normaliser), from this step's fresh
            # rows only (rows the replay buffer reuses are counted once): updated after the update, so the
            # batch was scored with the statistics it was collected with; published with the changed weights
            self._changed.update(observe(prepared))
        metrics.update(self.replay.stats())
        metrics["actor/world_size"] = torch.tensor(float(self.world_size))
        return metrics

    def update(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """Train on this rank's prepared rows for ``update_epochs``; returns detached metrics
        (global over ranks, averaged over optimizer steps). Bumps :attr:`version`."""
        check_batch(batch, self.cfg.algorithm, action_field=self.policy.action_field, kl_coef=self.kl_coef)
        batch = batch.cpu()   # rows are selected and observations gathered on the CPU; each micro-batch moves once
        N = batch.batch_size[0]
        sizes = fsdp.all_gather_ints(N, self.device)
        if len(set(sizes)) > 1:
            raise ValueError(f"actor ranks received different numbers of trajectories {sizes}; shard the batch evenly")
        rows_per_step = self.cfg.actor.global_batch_size // self.world_size
        generator = torch.Generator().manual_seed(self.cfg.actor.seed * 1_000_003 + self.version)
        orders = [torch.randperm(N, generator=generator) for _ in range(self.cfg.algorithm.update_epochs)]
        rows = self._rows(batch, first_epoch=self._steps(orders[0], rows_per_step))
        self._start_update()
        progress = _Progress(first_ratio_error=torch.zeros((), device=self.device))
        steps_per_epoch = math.ceil(N / rows_per_step)
        ticker, total_steps = Ticker(), len(orders) * steps_per_epoch
        for epoch, order in enumerate(orders):
            for step_rows in self._steps(order, rows_per_step):
                if ticker.due() and self.rank == 0:   # a long update (a 7B model) says where it is
                    log.info("update: optimizer step %d of %d (epoch %d of %d), %.0f s",
                             len(progress.step_metrics) + progress.skipped + 1, total_steps, epoch + 1, len(orders),
                             ticker.elapsed)
                self._train_step(rows, step_rows, progress)
                if progress.stopped:
                    break
            if progress.stopped:
                break
        self.version += 1
        if self._ema is not None:
            self._ema.update()
        epochs_done = (len(progress.step_metrics) + progress.skipped) / steps_per_epoch
        metrics = self._update_metrics(rows, progress, epochs_done)
        self.kl_ctrl.update(measured_kl(metrics, self.cfg.algorithm), N * self.world_size)
        metrics["actor/kl_coef"] = torch.tensor(self.kl_coef)
        metrics["actor/version"] = torch.tensor(float(self.version))
        return metrics

    def sft_update(self, batch: Mapping, *, micro_batch_size: int, token_loss: bool = True, stop_token: bool = True,
                   l1_head: bool = False) -> dict[str, torch.Tensor]:
        """One supervised optimizer step (``embodirl sft``) on this rank's samples, through the same optimizer,
        gradient clipping, LR schedule and FSDP2 wrapping as :meth:`update`: :func:`.sft.sft_update`. Bumps
        :attr:`version`; metrics are global over ranks."""
        return sft.sft_update(self, batch, micro_batch_size=micro_batch_size, token_loss=token_loss,
                              stop_token=stop_token, l1_head=l1_head)

    def set_lr_scale(self, scale: float) -> None:
        """Learning rates from now on: every parameter group's configured rate times ``scale`` (the collapse guard's
        rollback); the schedule's warm-up and decay apply on top, and checkpoints keep the scaled rates."""
        for i, group in enumerate(self.optimizer.param_groups):
            self.scheduler.base_lrs[i] = float(group["initial_lr"]) * float(scale)
        refresh_lr(self.scheduler)

    def publish_weights(self, *, full: bool = False) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, tensors)``: the trainable tensors changed since the last call (all trainable
        tensors with ``full``), un-sharded, on CPU, by parameter name. Collective under FSDP."""
        state = {}
        for name, param in self._trainable:
            if full or name in self._changed:
                state[name] = fsdp.full_tensor(param).to("cpu", copy=True)
        self._changed.clear()
        return self.version, state

    def gather_trainable(self, *, evaluated: bool = False) -> dict[str, torch.Tensor]:
        """Every trainable tensor, un-sharded, on CPU (collective under FSDP; publication unaffected); with
        ``evaluated``, the weights evaluation acts with (the moving average under ``actor.ema_decay``)."""
        if evaluated and self._ema is not None and not self._ema.swapped:
            return self._ema.evaluated()
        return {name: fsdp.full_tensor(p).to("cpu", copy=True) for name, p in self._trainable}

    def swap_ema(self) -> bool:
        """Exchange the averaged tensors with their moving average (``actor.ema_decay``): called once before an
        evaluation, so the module acts with the average, and once after it; returns whether the average is now in
        the module (False without an average). The exchanged tensors count as changed for the next publication."""
        if self._ema is None:
            return False
        self._changed.update(self._ema.swap())
        return self._ema.swapped

    def reset_ema(self, values: Mapping[str, torch.Tensor] | None = None) -> None:
        """Set the moving average (``actor.ema_decay``) to ``values`` (full tensors by name), or to the weights."""
        if self._ema is not None:
            self._ema.reset(values)

    def state_dict(self) -> dict:
        """Resumable actor state with full (un-sharded) CPU tensors: ``trainable`` (by parameter
        name), ``optimizer``, ``scheduler``, ``kl_ctrl``, ``replay`` (the held rollouts) and the
        ``version`` / ``optimizer_steps`` counters. Collective under FSDP, where the optimizer state
        is gathered on rank 0 only (the other ranks' entry is empty): save rank 0's copy."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "version": self.version, "optimizer_steps": self.optimizer_steps, "kl_ctrl": self.kl_ctrl.state_dict(),
            "scheduler": self.scheduler.state_dict(), "replay": self.replay.state_dict(),
            "trainable": {name: fsdp.full_tensor(p).to("cpu", copy=True) for name, p in self._trainable},
            # deep copies: the returned state must not alias the live optimizer's moment tensors
            "optimizer": copy.deepcopy(get_optimizer_state_dict(self.policy, self.optimizer, options=options)),
            "ema": None if self._ema is None else self._ema.state_dict(),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` (on every rank; under FSDP rank 0's optimizer state is
        broadcast, so the other ranks may pass a copy without it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        params = dict(self._trainable)
        with torch.no_grad():
            for name, value in state["trainable"].items():
                param = params[name]
                if fsdp.is_dtensor(param):  # FSDP2 DTensor: take this rank's shard of the full value
                    from torch.distributed.tensor import distribute_tensor

                    value = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh,
                                              param.placements)
                    param.to_local().copy_(value.to_local())
                else:
                    param.copy_(value.to(param.device, param.dtype))
        # not strict: trainable tensors that were never updated (GRPO's idle value head) have no state
        set_optimizer_state_dict(self.policy, self.optimizer, copy.deepcopy(state["optimizer"]),
                                 options=StateDictOptions(full_state_dict=True, strict=False,
                                                          broadcast_from_rank0=fsdp.is_distributed()))
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.replay.load_state_dict(state["replay"])
        self.version, self.optimizer_steps = int(state["version"]), int(state["optimizer_steps"])
        if self.ema is not None:
            self.reset_ema(state.get("ema"))

    # --- internals: the update's steps ---------------------------------------------------------------
    def _start_update(self) -> None:
        """Before an update's first optimizer step: training mode, the learning rates of this training step."""
        self.policy.train()
        refresh_lr(self.scheduler)  # the decay follows the training step
        self._steps_before_update = self.optimizer_steps

    def _rows(self, batch: TensorDict, first_epoch: list[torch.Tensor]) -> _Rows:
        """The update's rows with the log-probs its ratio is taken to (:meth:`_old_logprob`; ``first_epoch``: the
        first epoch's optimizer steps' rows) and the sizes its loss reads."""
        params = self.cfg.algorithm
        L = batch.get(D.LOGPROB_BEHAVIOR).shape[-1]        # per-decision log-prob entries (tokens, dims)
        value_dims = batch.get(D.VALUE).dim() if params.uses_critic else 2
        old_logprob, is_weight, is_cap = self._old_logprob(batch, first_epoch=first_epoch)
        return _Rows(batch, old_logprob, is_weight, is_cap, L=L, action_dim=self.policy.action_dim,
                     value_dims=value_dims, kl_coef=self.kl_coef if params.use_kl_loss else 0.0)

    def _train_step(self, rows: _Rows, step_rows: torch.Tensor, progress: _Progress) -> None:
        """One optimizer step on this rank's ``step_rows`` of ``rows``, in micro-batches with gradient accumulation;
        skipped when no rank has a valid decision in it; stops the update (``progress.stopped``) when its approximate
        KL exceeds ``algorithm.early_stop_kl``."""
        params = self.cfg.algorithm
        batch = rows.batch
        norms = fsdp.all_reduce_(losses.normalisers(
            batch.get(D.VALID)[step_rows], params, L=rows.L, action_dim=rows.action_dim, value_dims=rows.value_dims,
            executed=batch.get(D.EXECUTED)[step_rows] if D.EXECUTED in batch.keys() else None,
        ).to(self.host))
        if float(norms[losses.NORMALISER_KEYS.index("token_units")]) == 0:
            # no valid decision on any rank (e.g. every group filtered): an applied step would
            # still move the weights by Adam's momentum and weight decay. The count is global,
            # so every rank skips the same step and the collectives stay matched.
            progress.skipped += 1
            return
        sums: dict[str, torch.Tensor] = {}
        device_norms = norms.to(self.device)
        for micro_rows in step_rows.split(self.cfg.actor.micro_batch_size):
            self._micro_step(rows, micro_rows, device_norms, progress, sums)
        progress.step_metrics.append(self._optimizer_step(sums))
        # KL early stopping (the global approx_kl, so every rank stops at the same step)
        early_stop_kl = params.early_stop_kl
        if early_stop_kl is not None and float(progress.step_metrics[-1]["actor/approx_kl"]) > early_stop_kl:
            progress.stopped = True

    def _micro_step(self, rows: _Rows, micro_rows: torch.Tensor, norms: torch.Tensor, progress: _Progress,
                    sums: dict[str, torch.Tensor]) -> None:
        """Forward and backward of one micro-batch (``norms``: the optimizer step's global loss normalisers, on the
        device); its metric contributions are added to ``sums``."""
        micro = rows.batch[micro_rows]                                       # (n, T) on the CPU
        out = self._forward(micro, return_value=self.cfg.algorithm.uses_critic, return_entropy=True)
        fields = micro.exclude(D.IMAGES).to(self.device)
        old = rows.old_logprob[micro_rows].to(self.device)
        loss, micro_metrics = losses.compute_loss(
            out, fields, old_logprob=old, algorithm=self.cfg.algorithm, norms=norms, action_dim=rows.action_dim,
            kl_coef=rows.kl_coef,
            is_weight=None if rows.is_weight is None else rows.is_weight[micro_rows].to(self.device))
        if progress.first_step:   # the update's first optimizer step: on-policy, ratio 1
            progress.record_first_step(out[losses.LOGPROB], old, fields, rows)
        loss.backward()
        for key, value in micro_metrics.items():
            sums[key] = sums.get(key, 0.0) + value

    def _update_metrics(self, rows: _Rows, progress: _Progress, epochs_done: float) -> dict[str, torch.Tensor]:
        """The update's metrics, global over ranks: its optimizer steps' averages, the whole batch's
        (:func:`~.metrics.batch_metrics`), its progress, and the first optimizer step's measurements."""
        step_metrics = progress.step_metrics
        metrics = {key: torch.stack([m[key] for m in step_metrics]).mean() for key in
                   (step_metrics[0] if step_metrics else ())}
        metrics.update(batch_metrics(rows.batch, self.cfg.algorithm, L=rows.L, epochs=epochs_done, host=self.host))
        metrics["actor/optimizer_steps"] = torch.tensor(float(len(step_metrics)))
        metrics["actor/early_stopped"] = torch.tensor(float(progress.stopped))
        metrics["actor/skipped_empty_steps"] = torch.tensor(float(progress.skipped))
        # max |ratio - 1| over the first optimizer step's tokens: the rollout's and the actor's forwards disagree by
        # this much (numerics only, when the rows are on-policy; see algorithm.recompute_old_logprob)
        metrics["actor/first_step_ratio_error"] = fsdp.all_reduce_(progress.first_ratio_error.to(self.host), "max").cpu()
        metrics.update(gap_metrics(progress.gap_stats, rows.is_weight, rows.is_cap, rows.batch, host=self.host))
        return metrics

    def _optimizer_step(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Reduce the step's metric sums over the ranks, clip the gradient and step - unless a loss term or the
        gradient is not finite: then :class:`NonFiniteUpdate` names the term, before the weights change (every rank
        sees the same reduced values and the same global norm, so all ranks raise together)."""
        lrs = {f"actor/lr_{g.get('name', 'group')}": torch.tensor(float(g["lr"])) for g in self.optimizer.param_groups}
        keys = sorted(sums)
        stacked = fsdp.all_reduce_(torch.stack([torch.as_tensor(sums[k]).float().to(self.host) for k in keys]))
        metrics = {k: v.detach().cpu() for k, v in zip(keys, stacked.unbind(0))}
        grad_norm = clip_grad_norm([p for _, p in self._trainable], self.cfg.actor.optim.clip_grad)
        check_finite(metrics, grad_norm, self.optimizer, self._trainable, step=self.version + 1,
                     within=self.optimizer_steps - self._steps_before_update + 1)
        self._changed.update(name for name, p in self._trainable if p.grad is not None)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        metrics["actor/grad_norm"] = grad_norm.detach().float().cpu()
        metrics.update(lrs)  # the learning rates this step used
        return metrics

    def _averaged(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The tensors a moving average covers (:func:`.ema.stepped`)."""
        return stepped(self._trainable, self.optimizer)

    # --- internals: scoring --------------------------------------------------------------------------
    def _obs(self, micro: TensorDict, idx_n: torch.Tensor, idx_t: torch.Tensor) -> dict:
        """Observation dict of the selected decisions ``B`` (see :mod:`embodirl.models.base`)."""
        obs: dict = {}
        for key in (D.IMAGES, D.STATE):
            if key in micro.keys():
                obs[key] = micro.get(key)[idx_n, idx_t]  # (B, ...)
        task_id = micro.get(D.TASK_ID)[idx_n, idx_t]  # (B,)
        obs[D.TASK_ID] = task_id
        if self.task_table:
            obs["instruction"] = [self.task_table[int(i)] for i in task_id.tolist()]
        return obs

    def _forward(self, micro: TensorDict, *, return_value: bool, return_entropy: bool) -> dict[str, torch.Tensor]:
        """Evaluate the valid decisions of ``micro`` ``[n, T]`` (on the CPU: the valid decisions are found
        and their observations gathered there, and the policy moves its inputs to its device once) and
        scatter the outputs back to ``(n, T, ...)`` on the device (zeros elsewhere). A micro-batch without
        valid decisions still runs one (masked) decision, so that every rank takes part in the same FSDP
        collectives."""
        valid = micro.get(D.VALID)  # (n, T)
        n, T = valid.shape
        idx_n, idx_t = valid.nonzero(as_tuple=True)  # (B,), (B,)
        if idx_n.numel() == 0:
            idx_n = idx_t = torch.zeros(1, dtype=torch.long, device=valid.device)
        obs = self._obs(micro, idx_n, idx_t)
        actions = micro.get(self.policy.action_field)[idx_n, idx_t]  # (B, L)
        out = self.policy.score_actions(obs, actions, temperature=self.temperature, return_value=return_value,
                                   return_entropy=return_entropy)
        scattered = {}
        for key in (losses.LOGPROB, losses.ENTROPY, D.VALUE):
            if key in out and out[key] is not None:
                x = out[key]  # (B, ...)
                where = (idx_n.to(x.device), idx_t.to(x.device))
                scattered[key] = x.new_zeros((n, T, *x.shape[1:])).index_put(where, x)
        return scattered

    def _reshard(self) -> None:
        if self.use_fsdp:
            fsdp.reshard(self.policy)

    @torch.no_grad()
    def _logprob_no_grad(self, batch: TensorDict, micro_batches: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Log-probs ``(N, T, L)`` of the batch's actions under the current weights (CPU float32), computed in
        ``micro_batches`` (row indices covering every row once; default: ``micro_batch_size`` rows in order)."""
        self.policy.eval()
        N = batch.batch_size[0]
        micro_batches = micro_batches or list(torch.arange(N).split(self.cfg.actor.micro_batch_size))
        out = None
        for rows in micro_batches:
            logprob = self._forward(batch[rows].cpu(), return_value=False, return_entropy=False)[losses.LOGPROB]
            if out is None:
                out = torch.zeros((N, *logprob.shape[1:]), dtype=torch.float32)
            out[rows] = logprob.float().cpu()
        assert out is not None, "an empty batch has no log-probs"    # the micro-batches cover the N > 0 rows
        return out

    @staticmethod
    def _steps(order: torch.Tensor, rows_per_step: int) -> list[torch.Tensor]:
        """An epoch's row order cut into optimizer steps."""
        return list(order.split(rows_per_step))

    def _old_logprob(self, batch: TensorDict, first_epoch: list[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
        """Behaviour log-probs for on-policy rows - or, with ``algorithm.recompute_old_logprob``, this actor's
        own log-probs of them, computed in the micro-batches of the first epoch (``first_epoch``: its optimizer
        steps' rows), so that the first optimizer step's ratio is 1 up to the difference between a forward with and
        without autograd, plus the truncated importance weights pi_prox / pi_behaviour capped at
        ``algorithm.behaviour_is_cap`` (none when it is null); for replayed (stale) rows the current "proximal"
        log-probs plus truncated importance weights (decoupled PPO; see :mod:`.replay_buffer`). The third value is
        the cap the weights were truncated at."""
        behaviour = batch.get(D.LOGPROB_BEHAVIOR)
        stale = torch.tensor(float((row_versions(batch, self.version) < self.version).any()), device=self.host)
        if not fsdp.all_reduce_(stale, "max").item():
            if self.cfg.algorithm.recompute_old_logprob:
                micro = [m for rows in first_epoch for m in rows.split(self.cfg.actor.micro_batch_size)]
                prox = self._logprob_no_grad(batch, micro)
                cap = self.cfg.algorithm.behaviour_is_cap
                if cap is None:     # the ratio is taken to the actor's own log-probs, the rollout's are dropped
                    return prox, None, None
                # decoupled PPO: the clipped ratio is pi / pi_prox, and each unit's loss is weighted by the
                # truncated pi_prox / pi_behaviour that the rollout copy's numerics (merged bf16 weights) open
                return prox, losses.importance_weight(
                    prox, behaviour, batch.get(D.VALID), logprob_type=self.cfg.algorithm.logprob_type,
                    action_dim=self.policy.action_dim, max_weight=cap,
                    executed=batch.get(D.EXECUTED) if D.EXECUTED in batch.keys() else None), cap
            return behaviour, None, None
        prox = self._logprob_no_grad(batch)
        weight = losses.importance_weight(prox, behaviour, batch.get(D.VALID), logprob_type=self.cfg.algorithm.logprob_type,
                                          action_dim=self.policy.action_dim, max_weight=REPLAY_MAX_IMPORTANCE_WEIGHT)
        return prox, weight, REPLAY_MAX_IMPORTANCE_WEIGHT
