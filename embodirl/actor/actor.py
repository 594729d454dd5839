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
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDict
from torch.optim.swa_utils import get_ema_multi_avg_fn

from embodirl import data as D
from embodirl.actor import fsdp
from embodirl.actor.optim import build_optimizer, clip_grad_norm, lr_schedule, refresh_lr, trainable_named_parameters
from embodirl.actor.replay_buffer import ReplayBuffer, row_versions
from embodirl.actor.settings import ActorSettings
from embodirl.algorithms import behaviour_gap, losses
from embodirl.algorithms import kl as kl_mod
from embodirl.algorithms.advantages import compute_advantages
from embodirl.algorithms.filtering import drop_filtered, group_composition
from embodirl.algorithms.section import AlgorithmSection, algorithm_of
from embodirl.dtypes import parse_dtype
from embodirl.errors import ConfigError, NonFiniteUpdate
from embodirl.models.base import Policy, scoring_temperature
from embodirl.progress import Ticker

log = logging.getLogger(__name__)

#: truncation of the replay importance weight pi_prox / pi_behaviour (V-trace's rho-bar, Espeholt et al. 2018)
REPLAY_MAX_IMPORTANCE_WEIGHT = 1.0


def _take(value, rows: torch.Tensor):
    """Rows of a batch field: a list (instructions) or an array/tensor."""
    if isinstance(value, (list, tuple)):
        return [value[i] for i in rows.tolist()]
    return torch.as_tensor(value)[rows]


def prepare_batch(batch: TensorDict, algorithm: AlgorithmSection, *, kl_coef: float = 0.0
                  ) -> tuple[TensorDict, dict[str, torch.Tensor]]:
    """Driver-side preparation of a whole rollout batch (before it is cut into actor shards):
    the KL reward penalty (``use_kl_loss: false``; needs ``logprob_ref``), group filtering
    (``filter_groups.enable``) and advantages/returns (:func:`compute_advantages`). For a group-relative
    estimator it reports the groups' composition (:func:`group_composition`), before any filtering."""
    algorithm = algorithm_of(algorithm)
    metrics: dict[str, torch.Tensor] = {}
    if kl_coef > 0 and not algorithm.use_kl_loss:
        if D.LOGPROB_REF not in batch.keys():
            raise ValueError("the KL reward penalty needs 'logprob_ref': call Actor.compute_ref_logprob first")
        reward, mean_kl = kl_mod.apply_kl_reward_penalty(
            batch.get(D.REWARD), batch.get(D.LOGPROB_BEHAVIOR), batch.get(D.LOGPROB_REF), batch.get(D.VALID),
            coef=kl_coef, kind=algorithm.kl_penalty,
            executed=batch.get(D.EXECUTED) if D.EXECUTED in batch.keys() else None)
        batch = batch.copy()
        batch.set(D.REWARD, reward.float())
        metrics["kl/reward_penalty_kl"] = mean_kl
    group_size, kept = algorithm.group_size, algorithm.filter_groups
    if algorithm.estimator.groups and D.SUCCESS in batch.keys() and group_size > 1:
        metrics.update(group_composition(batch.get(D.SUCCESS), batch.get(D.VALID), group_size=group_size))
    if kept.enable:
        batch, filter_metrics = drop_filtered(batch, group_size=group_size, min_success=kept.min_success,
                                              max_success=kept.max_success)
        metrics.update(filter_metrics)
    return compute_advantages(batch, algorithm), metrics


class Actor:
    """Trainable policy + optimizer on this rank (see module docstring).

    ``cfg`` holds the ``algorithm`` and ``actor`` nodes (DictConfig or dict). ``task_table`` maps
    ``task_id`` to instructions; ``temperature`` must be the rollout's sampling temperature so that
    recomputed log-probs refer to the behaviour distribution. ``device`` defaults to this rank's GPU,
    else the CPU. Call collectively on every rank when torch.distributed is initialised.
    """

    def __init__(self, policy: Policy, cfg: Mapping, *, task_table: Sequence[str], temperature: float = 1.0,
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
        self.ema: dict[str, torch.Tensor] | None = (
            {name: p.detach().clone() for name, p in self._trainable} if self.ema_decay > 0 else None)
        self._ema_fn = get_ema_multi_avg_fn(self.ema_decay) if self.ema is not None else None
        self.ema_swapped = False

    # --- public API ----------------------------------------------------------------------------------
    @property
    def kl_coef(self) -> float:
        return self.kl_ctrl.value

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
        self._check_batch(batch)
        batch = batch.cpu()   # rows are selected and observations gathered on the CPU; each micro-batch moves once
        N = batch.batch_size[0]
        sizes = fsdp.all_gather_ints(N, self.device)
        if len(set(sizes)) > 1:
            raise ValueError(f"actor ranks received different numbers of trajectories {sizes}; shard the batch evenly")
        rows_per_step = self.cfg.actor.global_batch_size // self.world_size
        action_dim = self.policy.action_dim
        L = batch.get(D.LOGPROB_BEHAVIOR).shape[-1]        # per-decision log-prob entries (tokens, dims)
        value_dims = batch.get(D.VALUE).dim() if self.cfg.algorithm.uses_critic else 2
        params = self.cfg.algorithm
        generator = torch.Generator().manual_seed(self.cfg.actor.seed * 1_000_003 + self.version)
        orders = [torch.randperm(N, generator=generator) for _ in range(self.cfg.algorithm.update_epochs)]
        old_logprob, is_weight, is_cap = self._old_logprob(batch, first_epoch=self._steps(orders[0], rows_per_step))
        kl_coef = self.kl_coef if params.use_kl_loss else 0.0

        self.policy.train()
        refresh_lr(self.scheduler)  # the decay follows the training step
        early_stop_kl = self.cfg.algorithm.early_stop_kl
        step_metrics: list[dict[str, torch.Tensor]] = []
        steps_per_epoch = math.ceil(N / rows_per_step)
        stopped = False
        skipped = 0
        first_ratio_error = torch.zeros((), device=self.device)
        gap_stats = None        # |learner - behaviour| log-prob statistics of the first optimizer step's tokens
        self._steps_before_update = self.optimizer_steps
        ticker, total_steps = Ticker(), len(orders) * steps_per_epoch
        for epoch, order in enumerate(orders):
            if stopped:
                break
            for rows in self._steps(order, rows_per_step):
                if ticker.due() and self.rank == 0:   # a long update (a 7B model) says where it is
                    log.info("update: optimizer step %d of %d (epoch %d of %d), %.0f s", len(step_metrics) + skipped + 1,
                             total_steps, epoch + 1, len(orders), ticker.elapsed)
                norms = fsdp.all_reduce_(losses.normalisers(
                    batch.get(D.VALID)[rows], params, L=L, action_dim=action_dim, value_dims=value_dims,
                    executed=batch.get(D.EXECUTED)[rows] if D.EXECUTED in batch.keys() else None,
                ).to(self.host))
                if float(norms[losses.NORMALISER_KEYS.index("token_units")]) == 0:
                    # no valid decision on any rank (e.g. every group filtered): an applied step would
                    # still move the weights by Adam's momentum and weight decay. The count is global,
                    # so every rank skips the same step and the collectives stay matched.
                    skipped += 1
                    continue
                sums: dict[str, torch.Tensor] = {}
                device_norms = norms.to(self.device)
                for micro_rows in rows.split(self.cfg.actor.micro_batch_size):
                    micro = batch[micro_rows]                                       # (n, T) on the CPU
                    out = self._forward(micro, return_value=self.cfg.algorithm.uses_critic, return_entropy=True)
                    fields = micro.exclude(D.IMAGES).to(self.device)
                    old = old_logprob[micro_rows].to(self.device)
                    loss, micro_metrics = losses.compute_loss(
                        out, fields, old_logprob=old, algorithm=params, norms=device_norms, action_dim=action_dim,
                        kl_coef=kl_coef, is_weight=None if is_weight is None else is_weight[micro_rows].to(self.device))
                    if not step_metrics and not skipped:   # the update's first optimizer step: on-policy, ratio 1
                        executed = fields.get(D.EXECUTED) if D.EXECUTED in fields.keys() else None
                        first_ratio_error = torch.maximum(first_ratio_error, losses.max_ratio_error(
                            out[losses.LOGPROB], old, fields.get(D.VALID), action_dim=action_dim, executed=executed))
                        gap_stats = behaviour_gap.merge(gap_stats, behaviour_gap.statistics(
                            out[losses.LOGPROB], fields.get(D.LOGPROB_BEHAVIOR),
                            behaviour_gap.token_mask(fields.get(D.VALID), L, action_dim=action_dim, executed=executed)))
                    loss.backward()
                    for key, value in micro_metrics.items():
                        sums[key] = sums.get(key, 0.0) + value
                step_metrics.append(self._optimizer_step(sums))
                # KL early stopping (the global approx_kl, so every rank stops at the same step)
                if early_stop_kl is not None and float(step_metrics[-1]["actor/approx_kl"]) > early_stop_kl:
                    stopped = True
                    break
        self.version += 1
        self._update_ema()
        metrics = {key: torch.stack([m[key] for m in step_metrics]).mean() for key in
                   (step_metrics[0] if step_metrics else ())}
        epochs_done = (len(step_metrics) + skipped) / steps_per_epoch
        metrics.update(self._batch_metrics(batch, L, epochs_done))
        metrics["actor/optimizer_steps"] = torch.tensor(float(len(step_metrics)))
        metrics["actor/early_stopped"] = torch.tensor(float(stopped))
        metrics["actor/skipped_empty_steps"] = torch.tensor(float(skipped))
        # max |ratio - 1| over the first optimizer step's tokens: the rollout's and the actor's forwards disagree by
        # this much (numerics only, when the rows are on-policy; see algorithm.recompute_old_logprob)
        metrics["actor/first_step_ratio_error"] = fsdp.all_reduce_(first_ratio_error.to(self.host), "max").cpu()
        metrics.update(self._gap_metrics(gap_stats, is_weight, is_cap, batch))
        self.kl_ctrl.update(self._measured_kl(metrics), N * self.world_size)
        metrics["actor/kl_coef"] = torch.tensor(self.kl_coef)
        metrics["actor/version"] = torch.tensor(float(self.version))
        return metrics

    def sft_update(self, batch: Mapping, *, micro_batch_size: int, token_loss: bool = True, stop_token: bool = True,
                   l1_head: bool = False) -> dict[str, torch.Tensor]:
        """One supervised optimizer step (``embodirl sft``) on this rank's samples, through the same optimizer,
        gradient clipping, LR schedule and FSDP2 wrapping as :meth:`update`. ``batch``: ``images``, ``state``
        (optional), ``instruction`` (list of strings) and ``actions`` (normalised chunks ``[B, H, A]``); the
        losses are the policy's ``supervised`` sums over the labels of all ranks (so the summed rank gradients
        are the whole batch's), ``token_loss`` the action-token cross-entropy, ``l1_head`` OFT's L1 regression
        loss. Bumps :attr:`version`; metrics are global over ranks."""
        actions = torch.as_tensor(batch["actions"])
        B = actions.shape[0]
        L = actions[0].numel()
        norms = fsdp.all_reduce_(torch.tensor([B * (L + int(stop_token)), B * L], dtype=torch.float32,
                                              device=self.host)).to(self.device)
        self.policy.train()
        refresh_lr(self.scheduler)
        self._steps_before_update = self.optimizer_steps
        sums: dict[str, torch.Tensor] = {}
        for rows in torch.arange(B).split(int(micro_batch_size)):
            obs = {key: _take(batch[key], rows) for key in (D.IMAGES, D.STATE, "instruction")
                   if batch.get(key) is not None}
            out = self.policy.supervised(obs, actions[rows], stop_token=stop_token, l1_head=l1_head)
            loss = out["ce_sum"] / norms[0] if token_loss else out["ce_sum"].new_zeros(())
            if l1_head:
                loss = loss + out["l1_head_sum"] / norms[1]
            loss.backward()
            for key, value in out.items():
                sums[f"sft/{key}"] = sums.get(f"sft/{key}", 0.0) + value.detach().float()
        raw = self._optimizer_step(sums)
        self.version += 1
        metrics = {k: v for k, v in raw.items() if not k.startswith("sft/")}
        metrics["sft/loss"] = raw["sft/ce_sum"] / raw["sft/labels"]
        if "sft/correct" in raw:                   # token policies; π0's loss is the velocity's squared error
            metrics["sft/token_accuracy"] = raw["sft/correct"] / raw["sft/tokens"]
        metrics["sft/action_l1"] = raw["sft/l1_sum"] / raw["sft/tokens"]
        if l1_head:
            metrics["sft/l1_head_loss"] = raw["sft/l1_head_sum"] / raw["sft/tokens"]
        metrics["sft/samples"] = raw["sft/tokens"] / L
        metrics["actor/version"] = torch.tensor(float(self.version))
        return metrics

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
        if evaluated and self.ema is not None and not self.ema_swapped:
            averaged = {name for name, _ in self._averaged()}
            return {name: fsdp.full_tensor(self.ema[name] if name in averaged else p).to("cpu", copy=True)
                    for name, p in self._trainable}
        return {name: fsdp.full_tensor(p).to("cpu", copy=True) for name, p in self._trainable}

    def swap_ema(self) -> bool:
        """Exchange the averaged tensors with their moving average (``actor.ema_decay``): called once before an
        evaluation, so the module acts with the average, and once after it; returns whether the average is now in
        the module (False without an average). The exchanged tensors count as changed for the next publication."""
        if self.ema is None:
            return False
        with torch.no_grad():
            for name, p in self._averaged():
                live, avg = fsdp.local_tensor(p), fsdp.local_tensor(self.ema[name])
                held = live.clone()
                live.copy_(avg)
                avg.copy_(held)
                self._changed.add(name)
        self.ema_swapped = not self.ema_swapped
        return self.ema_swapped

    def _averaged(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors the moving average covers: those the optimizer has stepped (it holds their moments). The
        others keep their own value in evaluation: statistics no gradient reaches (the state normaliser), an idle
        value head."""
        state = self.optimizer.state
        return [(name, p) for name, p in self._trainable if state.get(p)]

    def _update_ema(self) -> None:
        """After an update: ``ema = decay * ema + (1 - decay) * weights`` for every averaged tensor (a tensor joins
        with the weights it had before its first step, which is where its average started)."""
        if self.ema is None:
            return
        if self.ema_swapped:
            raise RuntimeError("the actor trained while its module held the moving average; call swap_ema() after "
                               "the evaluation")
        pairs = [(fsdp.local_tensor(self.ema[n]), fsdp.local_tensor(p)) for n, p in self._averaged()]
        if pairs:
            self._ema_fn([a for a, _ in pairs], [w for _, w in pairs], None)

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
            "ema": None if self.ema is None else {n: fsdp.full_tensor(t).to("cpu", copy=True)
                                                  for n, t in self.ema.items()},
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` (on every rank; under FSDP rank 0's optimizer state is
        broadcast, so the other ranks may pass a copy without it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        params = dict(self._trainable)
        with torch.no_grad():
            for name, value in state["trainable"].items():
                param = params[name]
                if hasattr(param, "full_tensor"):  # FSDP2 DTensor: take this rank's shard of the full value
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

    def reset_ema(self, values: Mapping[str, torch.Tensor] | None = None) -> None:
        """Set the moving average (``actor.ema_decay``) to ``values`` (full tensors by name), or to the weights."""
        if self.ema is None:
            return
        self.ema_swapped = False
        with torch.no_grad():
            for name, p in self._trainable:
                target = self.ema[name]
                if values is None:
                    fsdp.local_tensor(target).copy_(fsdp.local_tensor(p))
                elif hasattr(target, "device_mesh"):
                    from torch.distributed.tensor import distribute_tensor

                    shard = distribute_tensor(values[name].to(p.device, p.dtype), target.device_mesh, target.placements)
                    fsdp.local_tensor(target).copy_(shard.to_local())
                else:
                    target.copy_(values[name].to(target.device, target.dtype))

    # --- internals -----------------------------------------------------------------------------------
    def _check_batch(self, batch: TensorDict) -> None:
        D.validate(batch)
        need = [D.ADVANTAGE, D.LOGPROB_BEHAVIOR, self.policy.action_field]
        if self.cfg.algorithm.uses_critic:
            need += [D.VALUE, D.RETURNS]
        if self.cfg.algorithm.use_kl_loss and self.kl_coef > 0:
            need.append(D.LOGPROB_REF)
        missing = [k for k in need if k not in batch.keys()]
        if missing:
            raise ValueError(f"the actor's batch lacks {missing}; prepare it with prepare_batch/compute_ref_logprob")

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
            self.policy.reshard()

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

    def _gap_metrics(self, gap_stats: torch.Tensor | None, is_weight: torch.Tensor | None, is_cap: float | None,
                     batch: TensorDict) -> dict[str, torch.Tensor]:
        """The behaviour/learner log-prob gap of the first optimizer step (mean, p99, max over all ranks'
        tokens, :mod:`embodirl.algorithms.behaviour_gap`), and the importance weights' mean and truncated
        fraction over the valid units when the update applies them."""
        size = 3 + behaviour_gap.BINS + 2
        stats = gap_stats.to(self.host) if gap_stats is not None else torch.zeros(size, device=self.host)
        head = fsdp.all_reduce_(stats[behaviour_gap.MAX].clone(), "max")
        stats = fsdp.all_reduce_(stats)
        stats[behaviour_gap.MAX] = head
        metrics = {f"actor/behaviour_gap_{k}": torch.tensor(v) for k, v in behaviour_gap.summary(stats).items()}
        if is_weight is not None:
            valid = batch.get(D.VALID)[:, :, None].expand_as(is_weight).to(is_weight.device)
            truncated = valid & (is_weight >= is_cap * (1 - 1e-6))
            sums = torch.stack([torch.where(valid, is_weight, 0.0).sum(), valid.sum().float(),
                                truncated.sum().float()]).to(self.host)
            sums = fsdp.all_reduce_(sums)
            count = sums[1].clamp(min=1)
            metrics["actor/is_weight_mean"] = (sums[0] / count).cpu()
            metrics["actor/is_weight_truncated_fraction"] = (sums[2] / count).cpu()
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
        self._check_finite(metrics, grad_norm)
        self._changed.update(name for name, p in self._trainable if p.grad is not None)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        metrics["actor/grad_norm"] = grad_norm.detach().float().cpu()
        metrics.update(lrs)  # the learning rates this step used
        return metrics

    def _check_finite(self, metrics: Mapping[str, torch.Tensor], grad_norm: torch.Tensor) -> None:
        step, within = self.version + 1, self.optimizer_steps - self._steps_before_update + 1
        bad = next((k for k in sorted(metrics, key=lambda k: ("loss" not in k, k))
                    if not bool(torch.isfinite(metrics[k]).all())), None)
        if bad is None and bool(torch.isfinite(grad_norm)):
            return
        self.optimizer.zero_grad(set_to_none=True)
        if bad is not None:
            what = f"the loss term {bad} is {float(metrics[bad])}"
        else:
            params = [n for n, p in self._trainable if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
            what = (f"the gradient norm is {float(grad_norm)} (non-finite in {len(params)} tensor(s), e.g. "
                    f"{params[0] if params else '?'})")
        raise NonFiniteUpdate(f"training step {step}, optimizer step {within} of its update: {what}, so the update "
                              "stopped before that optimizer step changed the weights; lower actor.optim.lr, or set "
                              "runner.guard.enabled=true to roll back and go on")

    def _batch_metrics(self, batch: TensorDict, L: int, epochs: float) -> dict[str, torch.Tensor]:
        """Whole-batch metrics over all ranks: valid decisions, explained variance of the critic,
        KL(behaviour || reference) when reference log-probs are present."""
        valid = batch.get(D.VALID)
        decisions = fsdp.all_reduce_(valid.sum().float().to(self.host)).cpu()
        # rows with a valid decision (padding rows that even out the ranks' shards have none)
        rows = fsdp.all_reduce_(valid.any(-1).sum().float().to(self.host)).cpu()
        metrics = {"actor/decisions": decisions * epochs, "actor/trajectories": rows}
        if self.cfg.algorithm.uses_critic:
            sums = fsdp.all_reduce_(losses.explained_variance_sums(
                batch.get(D.VALUE), batch.get(D.RETURNS), valid).to(self.host)).cpu()
            metrics["critic/explained_variance"] = losses.explained_variance(sums)
        if D.LOGPROB_REF in batch.keys():
            token_kl = kl_mod.kl_divergence(batch.get(D.LOGPROB_BEHAVIOR), batch.get(D.LOGPROB_REF),
                                            self.cfg.algorithm.kl_penalty) * valid[:, :, None]
            sums = fsdp.all_reduce_(torch.stack([token_kl.sum(), valid.sum().float() * L]).to(self.host)).cpu()
            metrics["kl/behaviour_ref_kl"] = sums[0] / sums[1].clamp(min=1)
        return metrics

    def _measured_kl(self, metrics: Mapping[str, torch.Tensor]) -> float:
        """The KL the adaptive controller tracks: of the trained policy (loss mode) or of the behaviour
        policy (reward-penalty mode)."""
        key = "actor/kl" if self.cfg.algorithm.use_kl_loss else "kl/behaviour_ref_kl"
        value = metrics.get(key)
        return 0.0 if value is None or not math.isfinite(float(value)) else float(value)
