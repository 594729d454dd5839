"""The policy interface shared by the inference worker (``act``) and the actor (``score_actions``).

A policy maps a batched observation to an action chunk ``[B, H, A]`` and returns the quantities RL
needs: the sampled "policy-space" actions from which log-probs are recomputed (``action_tokens`` for
token policies such as OpenVLA-OFT, ``action_sample`` for Gaussian policies), their per-dimension
behaviour log-probs ``[B, L]`` and, when the policy has a value head, values ``[B]`` (chunk level) or
``[B, H]`` (action level).

Observation dict (tensors or numpy arrays)::

    images       uint8   [B, V, C, h, w]   (pixel policies)
    state        float32 [B, S]            (proprio / state policies)
    task_id      int64   [B]
    instruction  list[str] of length B     (language-conditioned policies)

Policies never hold action queues: chunk execution belongs to the env side.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from embodirl import data as D
from embodirl.config_fields import num, one_of, required, section
from embodirl.envs.conventions import POLICY_GRIPPERS

#: the trained tensors a policy folder holds outside any adapter layout, by parameter name (safetensors)
TRAINABLE_WEIGHTS = "trainable.safetensors"


@dataclass
class SamplingParams:
    """How :meth:`Policy.act` chooses actions. ``greedy`` ignores the rest (evaluation); a
    ``temperature`` of 0 is greedy too (sampling's limit as it cools, ``rollout.temperature=0``)."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def deterministic(self) -> bool:
        """Greedy decoding: ``greedy`` set, or temperature 0. Its log-probs are scored at temperature 1."""
        return self.greedy or self.temperature == 0


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build modules directly in ``dtype`` (no float32 copy of a 7B model)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def scoring_temperature(temperature: float) -> float:
    """The temperature at which the log-probs of actions chosen at ``temperature`` were scored: greedy
    decisions (temperature 0) are scored at 1, so the actor recomputes them there."""
    return 1.0 if float(temperature) == 0 else float(temperature)


class Policy(nn.Module, abc.ABC):
    """Base class of every embodirl policy (see module docstring)."""

    #: H, A and L = tokens (or Gaussian dims) per decision
    action_chunk: int
    action_dim: int
    #: which trajectory field holds the sampled policy-space actions
    action_field: str = D.ACTION_TOKENS
    #: "chunk_level" ([B] values) or "action_level" ([B, H]); None when the policy has no value head
    value_type: str | None = None

    @property
    def tokens_per_decision(self) -> int:
        return self.action_chunk * self.action_dim

    @abc.abstractmethod
    def act(self, obs: dict, sampling: SamplingParams, *, return_value: bool = False) -> dict[str, torch.Tensor]:
        """Choose actions for a batch. Returns ``action_chunk`` float32 ``[B, H, A]`` (un-normalised,
        ready for the env), ``self.action_field`` ``[B, L]``, ``logprob_behavior`` float32 ``[B, L]``
        and, with ``return_value``, ``value``. Runs without autograd."""

    @abc.abstractmethod
    def score_actions(self, obs: dict, actions: torch.Tensor, *, temperature: float = 1.0,
                 return_value: bool = True, return_entropy: bool = True) -> dict[str, torch.Tensor]:
        """Recompute with autograd for given policy-space ``actions`` ``[B, L]``: ``logprob`` float32
        ``[B, L]``, ``entropy`` ``[B, L]``, and ``value`` when asked."""

    def compile_blocks_(self) -> int:
        """Compile this policy's networks in place with ``torch.compile`` for an inference copy
        (``rollout.compile``); returns how many modules were compiled. The default compiles each child module
        that holds parameters; a policy of repeated blocks compiles the blocks instead (one graph per block
        class, so the first call compiles each class once). Compiled modules read their parameters at every
        call: weight updates and merges in place after this stay in effect."""
        children = [m for m in self.children() if next(m.parameters(), None) is not None]
        for child in children:
            child.compile()
        return len(children)

    # --- weights that change during RL ---------------------------------------------------------
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors the actor changes (LoRA adapter, value head, ...), detached on CPU; this is
        what weight sync publishes to inference workers."""
        return {name: p.detach().cpu().clone() for name, p in self.named_parameters() if p.requires_grad}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load tensors produced by :meth:`trainable_state_dict` (strict on names and shapes)."""
        params = dict(self.named_parameters())
        unknown = sorted(set(state) - set(params))
        if unknown:
            raise KeyError(f"weight update names unknown parameters: {unknown[:5]}")
        with torch.no_grad():
            for name, tensor in state.items():
                target = params[name]
                if target.shape != tensor.shape:
                    raise ValueError(f"weight update for '{name}' has shape {tuple(tensor.shape)}, "
                                     f"the model's is {tuple(target.shape)}")
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))

    def cast_trainable_(self, dtype: torch.dtype) -> None:
        """Hold the trainable tensors in ``dtype``: an inference copy computes them in the dtype its actor
        computes them in (FSDP2's mixed precision casts the float32 master weights to it), so that its
        log-probs are the actor's; weight updates are cast on arrival (:meth:`load_trainable_state_dict`)."""
        for param in self.parameters():
            if param.requires_grad and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)

    # --- the trained weights on disk -----------------------------------------------------------
    def save_trainable(self, folder: str | Path, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write the trained tensors into ``folder``: by default every trainable tensor, by parameter
        name, in ``trainable.safetensors``. ``tensors`` (full CPU tensors named as in
        :meth:`trainable_state_dict`, e.g. gathered by the actor) replaces the live ones. Adapter
        policies override this to write the adapter in its library's layout."""
        from safetensors.torch import save_file

        tensors = dict(self.trainable_state_dict() if tensors is None else tensors)
        save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()},
                  str(Path(folder) / TRAINABLE_WEIGHTS), metadata={"format": "pt"})

    def load_trainable(self, folder: str | Path) -> None:
        """Load what :meth:`save_trainable` wrote. Every trainable tensor must be in the folder; it may
        also hold other parameters of this policy (a full fine-tuning run trained them all)."""
        self._load_trainable_file(Path(folder), {n for n, p in self.named_parameters() if p.requires_grad})

    def _load_trainable_file(self, folder: Path, required: set[str]) -> None:
        from safetensors.torch import load_file

        path = folder / TRAINABLE_WEIGHTS
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: {folder} is not a policy folder written by save_trainable")
        state = load_file(str(path))
        missing = sorted(required - set(state))
        if missing:
            raise ValueError(f"{path} lacks {len(missing)} trained tensor(s) of {type(self).__name__}, e.g. "
                             f"'{missing[0]}'; it was written for another model configuration")
        try:
            self.load_trainable_state_dict(state)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{path} does not fit {type(self).__name__}: {exc.args[0]}") from None

    @contextlib.contextmanager
    def reference_mode(self):
        """Context in which the policy acts as the KL reference (LoRA adapters disabled). Policies
        without adapters have no separate reference and raise."""
        raise NotImplementedError(f"{type(self).__name__} has no reference policy (it has no adapter)")
        yield  # pragma: no cover


# --- config ---------------------------------------------------------------------------------------------------
def _policies():
    from embodirl.models.registry import available_policies
    return available_policies()


def _known_policy(name) -> bool:
    from embodirl.models.registry import POLICIES
    return isinstance(name, str) and POLICIES.known(name)


@dataclass
class ActionConventionConfig:
    """``model.action_convention``: what the policy's actions mean where it differs from what its family declares (a
    checkpoint trained in another convention); null keys keep the family's (:mod:`embodirl.envs.conventions`)."""

    arm: str | None = required()             # a named arm action space, or any (learns the env's)
    gripper: str | None = one_of(POLICY_GRIPPERS, null=True)


@dataclass
class CommonModelConfig:
    """The keys every ``model`` option has (types and ranges; the values live in the YAML). A policy types its own keys
    with a subclass it registers with (``@register_policy(name, config=...)``)."""

    name: str = one_of(_policies, known=_known_policy)
    path: str | None = required()
    action_chunk: int = num(1)
    value_type: str | None = one_of(D.REWARD_TYPES, null=True)     # null: no value head
    dtype: str = required()                  # parameter dtype (a policy narrows the choices)
    device: str | None = required()          # where the weights are created (null: cpu; meta: no memory)
    action_convention: ActionConventionConfig = section(ActionConventionConfig)
