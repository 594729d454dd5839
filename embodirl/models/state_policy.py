"""Gaussian MLP actor-critic over the state vector, for state-observation tasks.

The actor maps ``state [B, S]`` to the mean of H*A independent Gaussians (one action chunk); a
state-independent learned log-std is shared across the batch. Sampled "policy-space" actions
(``action_sample [B, L]``, L = H*A) are what log-probs refer to; the env receives them clipped to the
action bounds (``action_chunk [B, H, A]``), as CleanRL's continuous PPO does. The critic is a separate
MLP giving one value per chunk (``chunk_level``) or one per action (``action_level``, ``[B, H]``).

``SamplingParams.temperature`` scales the standard deviation; ``greedy`` returns the mean.

With ``obs_norm`` the state is standardised per feature by running statistics of the states the policy
was trained on (:class:`StateNormalizer`), as in the PPO implementation details (Huang et al., 2022):
ManiSkill's state vectors mix positions with a spread of ~1 cm and joint velocities of ~1 rad/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from embodirl import data as D
from embodirl.config_fields import instance, one_of, required
from embodirl.dtypes import parse_dtype
from embodirl.envs.conventions import NATIVE_CONVENTION
from embodirl.errors import ConfigError
from embodirl.models.base import CommonModelConfig, Policy, SamplingParams, default_dtype
from embodirl.models.registry import register_policy

_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}
_LOG_2PI = math.log(2.0 * math.pi)
VALUE_TYPES = D.REWARD_TYPES        # one value per chunk or per action


def _mlp(sizes: list[int], activation: str, out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        linear = nn.Linear(sizes[i], sizes[i + 1])
        last = i == len(sizes) - 2
        # orthogonal init as in the PPO implementation details (Huang et al., 2022): sqrt(2) for hidden
        # layers, a small gain for the policy output so initial actions are near zero.
        nn.init.orthogonal_(linear.weight, out_gain if last else math.sqrt(2.0))
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if not last:
            layers.append(_ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


class StateNormalizer(nn.Module):
    """Per-feature running mean and variance of training states; ``forward`` standardises and clips.

    The statistics are parameters that no gradient reaches (``forward`` detaches them, so the optimizer,
    which skips parameters without a gradient, never steps them). The actor folds each batch's valid
    states in after its update (:meth:`observe`, merged over the actor's ranks) and publishes them with
    the changed weights, so rollout copies, evaluation and checkpoints all normalise with the same numbers,
    and the states of one update are scored with the statistics they were collected with.
    """

    def __init__(self, dim: int, clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.clip, self.eps = float(clip), float(eps)
        self.mean = nn.Parameter(torch.zeros(dim))
        self.var = nn.Parameter(torch.ones(dim))
        self.count = nn.Parameter(torch.zeros(1))

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        z = (state - self.mean.detach()) * torch.rsqrt(self.var.detach() + self.eps)
        return z.clamp(-self.clip, self.clip)

    @torch.no_grad()
    def observe(self, states: torch.Tensor) -> None:
        """Fold ``states [M, S]`` into the statistics (Chan et al.'s parallel update); collective when a
        process group is up: every rank calls it and all end with the statistics of every rank's states."""
        x = states.detach().to(torch.float64).reshape(-1, states.shape[-1])
        moments = torch.cat([x.new_tensor([float(x.shape[0])]), x.sum(0), (x * x).sum(0)])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            moments = moments.to(_local(self.mean).device)
            dist.all_reduce(moments)
        n = float(moments[0])
        if n == 0:
            return
        S = x.shape[-1]
        batch_mean = moments[1:1 + S] / n
        batch_var = (moments[1 + S:] / n - batch_mean ** 2).clamp_min(0.0)
        mean, var, count = (_full(p).to(torch.float64).cpu() for p in (self.mean, self.var, self.count))
        c = float(count[0])
        total = c + n
        delta = batch_mean.cpu() - mean
        new_mean = mean + delta * (n / total)
        new_var = (var * c + batch_var.cpu() * n + delta ** 2 * (c * n / total)) / total
        for param, value in ((self.mean, new_mean), (self.var, new_var), (self.count, count.new_tensor([total]))):
            _assign(param, value.to(torch.float32))


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write a full value into a parameter, also when FSDP2 holds it as a sharded DTensor."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import DTensor, distribute_tensor

        sharded = cast(DTensor, param)          # a device_mesh: FSDP2's DTensor
        value = distribute_tensor(value.to(_local(param).device), sharded.device_mesh, sharded.placements)
    param.copy_(value.to(param.device) if not hasattr(param, "device_mesh") else value)


class StateMLPPolicy(Policy):
    """Gaussian actor + value critic; see module docstring."""

    action_field = D.ACTION_SAMPLE
    action_low: torch.Tensor        # buffers (register_buffer)
    action_high: torch.Tensor

    def __init__(self, state_dim: int, action_dim: int, action_chunk: int, *,
                 hidden_sizes=(256, 256), critic_hidden_sizes=(256, 256), activation: str = "tanh",
                 init_log_std: float = -0.5, value_type: str = "chunk_level",
                 action_low: float | list[float] = -1.0, action_high: float | list[float] = 1.0,
                 obs_norm: bool = False):
        super().__init__()
        self.state_dim, self.action_dim, self.action_chunk = state_dim, action_dim, action_chunk
        self.value_type = value_type
        L = action_chunk * action_dim
        self.actor = _mlp([state_dim, *hidden_sizes, L], activation, out_gain=0.01)
        self.log_std = nn.Parameter(torch.full((L,), float(init_log_std)))
        n_values = 1 if value_type == "chunk_level" else action_chunk
        self.critic = _mlp([state_dim, *critic_hidden_sizes, n_values], activation, out_gain=1.0)
        low = torch.as_tensor(action_low, dtype=torch.float32).expand(action_dim)
        high = torch.as_tensor(action_high, dtype=torch.float32).expand(action_dim)
        self.register_buffer("action_low", low.clone(), persistent=False)
        self.register_buffer("action_high", high.clone(), persistent=False)
        self.obs_norm = StateNormalizer(state_dim) if obs_norm else None

    def _state(self, obs: dict) -> torch.Tensor:
        state = torch.as_tensor(obs[D.STATE], dtype=torch.float32, device=self.log_std.device)
        return state if self.obs_norm is None else self.obs_norm(state)  # (B, S)

    def observe_batch(self, batch) -> list[str]:
        """After an update: fold the batch's valid states into the normaliser; returns the names of the
        parameters that changed (the actor publishes them). Collective under a process group."""
        if self.obs_norm is None:
            return []
        states = batch.get(D.STATE)                       # (N, T, S)
        valid = batch.get(D.VALID)                        # (N, T)
        self.obs_norm.observe(states[valid.bool()])
        return [f"obs_norm.{name}" for name in ("mean", "var", "count")]

    def _value(self, state: torch.Tensor) -> torch.Tensor:
        v = self.critic(state)  # (B, 1) or (B, H)
        return v.squeeze(-1) if self.value_type == "chunk_level" else v

    def _dist(self, state: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.actor(state)  # (B, L)
        log_std = self.log_std.expand_as(mean) + math.log(max(temperature, 1e-6))
        return mean, log_std

    @staticmethod
    def _log_prob(x: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
        return -0.5 * ((x - mean) / log_std.exp()) ** 2 - log_std - 0.5 * _LOG_2PI  # (B, L)

    @torch.no_grad()
    def act(self, obs: dict, sampling: SamplingParams, *, return_value: bool = False) -> dict[str, torch.Tensor]:
        state = self._state(obs)
        B = state.shape[0]
        greedy = sampling.deterministic
        mean, log_std = self._dist(state, 1.0 if greedy else sampling.temperature)
        sample = mean if greedy else mean + log_std.exp() * torch.randn_like(mean)  # (B, L)
        chunk = sample.view(B, self.action_chunk, self.action_dim)
        chunk = torch.maximum(torch.minimum(chunk, self.action_high), self.action_low)  # (B, H, A)
        out = {                                        # on the policy's device, as every policy returns them
            D.ACTION_CHUNK: chunk.float(),
            D.ACTION_SAMPLE: sample.float(),
            D.LOGPROB_BEHAVIOR: self._log_prob(sample, mean, log_std).float(),
        }
        if return_value:
            out[D.VALUE] = self._value(state).float()
        return out

    def score_actions(self, obs: dict, actions: torch.Tensor, *, temperature: float = 1.0,
                 return_value: bool = True, return_entropy: bool = True) -> dict[str, torch.Tensor]:
        state = self._state(obs)
        mean, log_std = self._dist(state, temperature)
        actions = actions.to(mean.device, mean.dtype)
        out = {"logprob": self._log_prob(actions, mean, log_std)}  # (B, L)
        if return_entropy:
            out["entropy"] = (0.5 + 0.5 * _LOG_2PI + log_std).expand_as(mean)  # (B, L)
        if return_value:
            out[D.VALUE] = self._value(state)
        return out


@dataclass
class StateMLPConfig(CommonModelConfig):
    """``model=state_mlp`` (config/model/state_mlp.yaml)."""

    hidden_sizes: list[int] = required()
    critic_hidden_sizes: list[int] = required()
    activation: str = one_of(tuple(_ACTIVATIONS))
    init_log_std: float = required()
    obs_norm: bool = required()
    dtype: str = one_of(("float32", "float64"))
    device: str | None = required()


# trained from scratch in the env's own action space (native actions); no adapter to merge; in process by default
@register_policy("state_mlp", config=StateMLPConfig, compile=True, value_head=True, action_convention=NATIVE_CONVENTION)
def build_state_policy(cfg, env_spec) -> StateMLPPolicy:
    """The policy ``model`` (the typed :class:`StateMLPConfig`, or a DictConfig or plain mapping of it) describes."""
    model = instance(StateMLPConfig, cfg, "model")
    check_spec(model, env_spec)
    if model.value_type not in VALUE_TYPES:
        raise ConfigError("model.value_type", f"'{model.value_type}' is not one of {', '.join(VALUE_TYPES)}")
    # model.device / model.dtype: where and in which dtype every tensor of the policy is created
    dtype = parse_dtype(model.dtype)
    assert dtype is not None                # model.dtype is one of float32, float64
    with torch.device(model.device or "cpu"), default_dtype(dtype):
        policy = StateMLPPolicy(
            env_spec.state_dim, env_spec.action_dim, model.action_chunk, hidden_sizes=tuple(model.hidden_sizes),
            critic_hidden_sizes=tuple(model.critic_hidden_sizes), activation=model.activation,
            init_log_std=model.init_log_std, value_type=model.value_type, action_low=env_spec.action_low,
            action_high=env_spec.action_high, obs_norm=model.obs_norm)
    if model.path:
        from safetensors.torch import load_file

        policy.load_state_dict(load_file(model.path))
    return policy


def check_spec(model, env_spec) -> None:
    if env_spec.state_dim <= 0:
        raise ConfigError("model.name", f"state_mlp needs a state observation but env '{env_spec.name}' has none; "
                                        "turn on the env's state observation (toy_reach: env.train.state_obs=true, "
                                        "ManiSkill: obs_mode=state) or use a pixel policy such as openvla_oft_tiny")


def check_config(cfg) -> None:
    model = instance(StateMLPConfig, cfg, "model")
    if model.path:
        check_weights_file(model.path)


def check_weights_file(path) -> None:
    """``model.path`` is a readable safetensors file (its header parses): one sentence before anything starts."""
    from pathlib import Path

    from safetensors import safe_open

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError("model.path", f"{file} does not exist; give the policy's safetensors file")
    try:
        with safe_open(str(file), framework="pt") as f:
            f.keys()
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError("model.path", f"{file} is not a safetensors file ({reason}); write it again") from None


build_state_policy.check_config = check_config
build_state_policy.check_spec = check_spec
