"""A policy family added the way docs/extending.md's "Adding a policy" says, from outside the package: this one package (its
config class, policy and builder, registered under the package's dotted name with what it can do) and one model YAML
naming it (tests/extension/test_extension.py copies this package under another name into a temporary folder and writes
the YAML there). The policy: a linear Gaussian over the state vector, acting in the env's own actions, no value head
(so GRPO-style estimators only), in the driver's process under ``cluster.use_ray=auto``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from embodirl import data as D
from embodirl.config_fields import num
from embodirl.envs.conventions import NATIVE_CONVENTION
from embodirl.errors import ConfigError
from embodirl.models.base import CommonModelConfig, Policy, SamplingParams
from embodirl.models.registry import register_policy

_LOG_2PI = math.log(2 * math.pi)


@dataclass
class LinearPolicyConfig(CommonModelConfig):
    """The keys this family adds to the common ones."""

    init_log_std: float = num(-5.0, 1.0)


class LinearPolicy(Policy):
    action_field = D.ACTION_SAMPLE          # Gaussian samples [B, H * A], log-probs recomputed from them

    def __init__(self, state_dim: int, action_dim: int, action_chunk: int, init_log_std: float):
        super().__init__()
        self.action_dim, self.action_chunk = action_dim, action_chunk
        self.mean = nn.Linear(state_dim, action_chunk * action_dim)
        nn.init.zeros_(self.mean.weight)
        self.log_std = nn.Parameter(torch.full((action_chunk * action_dim,), float(init_log_std)))

    def _dist(self, obs: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        state = torch.as_tensor(obs[D.STATE], dtype=torch.float32, device=self.log_std.device)   # (B, S)
        mean = self.mean(state)                                                                    # (B, L)
        return mean, self.log_std.expand_as(mean) + math.log(max(temperature, 1e-6))

    @staticmethod
    def _log_prob(x, mean, log_std):
        return -0.5 * ((x - mean) / log_std.exp()) ** 2 - log_std - 0.5 * _LOG_2PI                 # (B, L)

    @torch.no_grad()
    def act(self, obs: dict, sampling: SamplingParams, *, return_value: bool = False) -> dict[str, torch.Tensor]:
        mean, log_std = self._dist(obs, 1.0 if sampling.deterministic else sampling.temperature)
        sample = mean if sampling.deterministic else mean + log_std.exp() * torch.randn_like(mean)  # (B, L)
        chunk = sample.clamp(-1.0, 1.0).view(-1, self.action_chunk, self.action_dim)               # (B, H, A)
        return {D.ACTION_CHUNK: chunk, D.ACTION_SAMPLE: sample, D.LOGPROB_BEHAVIOR: self._log_prob(sample, mean, log_std)}

    def score_actions(self, obs: dict, actions: torch.Tensor, *, temperature: float = 1.0, return_value: bool = True,
                 return_entropy: bool = True) -> dict[str, torch.Tensor]:
        mean, log_std = self._dist(obs, temperature)
        out = {"logprob": self._log_prob(actions.to(mean), mean, log_std)}
        if return_entropy:
            out["entropy"] = (0.5 + 0.5 * _LOG_2PI + log_std).expand_as(mean)
        return out


@register_policy(__name__, config=LinearPolicyConfig, action_convention=NATIVE_CONVENTION)
def build(model: LinearPolicyConfig, env_spec) -> LinearPolicy:
    if env_spec.state_dim <= 0:
        raise ConfigError("model.name", f"{model.name} reads the state vector, and env '{env_spec.name}' has none")
    with torch.device(model.device or "cpu"):
        policy = LinearPolicy(env_spec.state_dim, env_spec.action_dim, model.action_chunk, model.init_log_std)
    if model.path:
        policy.load_trainable(model.path)
    return policy
