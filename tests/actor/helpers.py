"""Actor test fixtures: a small token policy with LoRA-style adapters (a real nn.Module), random
prepared trajectories for it, and the composed default config."""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
from torch import nn

from embodirl import data as D
from embodirl.models.base import Policy, SamplingParams

STATE_DIM, H, A, BINS, HIDDEN, NUM_TASKS = 5, 2, 3, 8, 32, 3
L = H * A
V, C, IMG = 1, 3, 4
TASKS = [f"task {i}" for i in range(NUM_TASKS)]


class AdaptedLinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank adapter (B starts at zero, as in LoRA)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.3)
        self.lora_b = nn.Parameter(torch.zeros(d_out, rank))
        self.adapter_enabled = True

    def forward(self, x):
        y = self.base(x)
        if self.adapter_enabled:
            y = y + (x @ self.lora_a.t()) @ self.lora_b.t()
        return y


class TinyBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.mix = AdaptedLinear(width, width)
        self.norm = nn.LayerNorm(width)
        self.norm.requires_grad_(False)

    def forward(self, x):
        return x + torch.tanh(self.mix(self.norm(x)))


class TinyTokenPolicy(Policy):
    """Images + state + task -> L = H*A categorical tokens over BINS bins, and a chunk-level value.

    Blocks are declared in ``_no_split_modules`` like transformers models, so FSDP2 shards them one by
    one; ``reference_mode`` disables the adapters (the KL reference)."""

    _no_split_modules = ["TinyBlock"]
    action_field = D.ACTION_TOKENS
    value_type = "chunk_level"

    def __init__(self, num_blocks: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.action_chunk, self.action_dim = H, A
        self.task_embed = nn.Embedding(NUM_TASKS, HIDDEN)
        self.inp = nn.Linear(STATE_DIM + V * C, HIDDEN)
        self.blocks = nn.ModuleList([TinyBlock(HIDDEN) for _ in range(num_blocks)])
        self.head = AdaptedLinear(HIDDEN, L * BINS)
        self.value_head = nn.Linear(HIDDEN, 1)
        for module in (self.task_embed, self.inp):
            module.requires_grad_(False)

    def _hidden(self, obs):
        device = self.inp.weight.device
        images = torch.as_tensor(obs[D.IMAGES], device=device).float().mean((-1, -2)) / 255.0  # (B, V, C)
        state = torch.as_tensor(obs[D.STATE], device=device, dtype=torch.float32)  # (B, S)
        assert len(obs["instruction"]) == state.shape[0]
        x = self.inp(torch.cat([state, images.flatten(1)], -1).to(self.inp.weight.dtype))
        x = x + self.task_embed(torch.as_tensor(obs[D.TASK_ID], device=device))  # (B, W)
        for block in self.blocks:
            x = block(x)
        return x

    def _logits(self, x, temperature):
        return self.head(x).view(-1, L, BINS).float() / temperature  # (B, L, BINS)

    @torch.no_grad()
    def act(self, obs, sampling: SamplingParams, *, return_value=False):
        x = self._hidden(obs)
        logits = self._logits(x, sampling.temperature)
        tokens = logits.argmax(-1) if sampling.greedy else torch.distributions.Categorical(logits=logits).sample()
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
        out = {D.ACTION_TOKENS: tokens, D.LOGPROB_BEHAVIOR: logp,
               D.ACTION_CHUNK: (tokens.float() / (BINS - 1) * 2 - 1).view(-1, H, A)}
        if return_value:
            out[D.VALUE] = self.value_head(x).squeeze(-1).float()
        return out

    def score_actions(self, obs, actions, *, temperature=1.0, return_value=True, return_entropy=True):
        x = self._hidden(obs)
        logp_all = torch.log_softmax(self._logits(x, temperature), -1)  # (B, L, BINS)
        tokens = torch.as_tensor(actions, device=logp_all.device).long()
        out = {"logprob": logp_all.gather(-1, tokens[..., None])[..., 0]}  # (B, L)
        if return_entropy:
            out["entropy"] = -(logp_all.exp() * logp_all).sum(-1)  # (B, L)
        if return_value:
            out[D.VALUE] = self.value_head(x).squeeze(-1).float()  # (B,)
        return out

    @contextlib.contextmanager
    def reference_mode(self):
        adapters = [m for m in self.modules() if isinstance(m, AdaptedLinear)]
        for m in adapters:
            m.adapter_enabled = False
        try:
            yield
        finally:
            for m in adapters:
                m.adapter_enabled = True


def token_batch(N: int = 8, T: int = 4, seed: int = 0, policy: TinyTokenPolicy | None = None, group_size: int = 4,
                p_terminated: float = 0.8) -> D.TensorDict:
    """A random trajectory batch for :class:`TinyTokenPolicy` with behaviour log-probs and values from
    ``policy`` (or random ones), episodes ending at random decisions, and a success flag."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[0] = T
    valid = torch.arange(T)[None, :] < lengths[:, None]  # (N, T)
    terminated = torch.zeros(N, T, dtype=torch.bool)
    truncated = torch.zeros(N, T, dtype=torch.bool)
    ends = torch.rand(N, generator=g) < p_terminated
    for n in range(N):
        (terminated if ends[n] else truncated)[n, lengths[n] - 1] = True
    fields = {
        D.IMAGES: torch.randint(0, 256, (N, T, V, C, IMG, IMG), generator=g, dtype=torch.uint8),
        D.STATE: torch.randn(N, T, STATE_DIM, generator=g),
        D.TASK_ID: torch.randint(0, NUM_TASKS, (N,), generator=g),
        D.ACTION_TOKENS: torch.randint(0, BINS, (N, T, L), generator=g),
        D.ACTION_CHUNK: torch.zeros(N, T, H, A),
        D.REWARD: torch.randn(N, T, generator=g),
        D.TERMINATED: terminated, D.TRUNCATED: truncated, D.VALID: valid,
        D.SUCCESS: (torch.rand(N, 1, generator=g) < 0.5).expand(N, T) & valid,
        D.GROUP_ID: torch.arange(N) // group_size, D.INIT_STATE_ID: torch.arange(N) // group_size,
    }
    if policy is None:
        fields[D.LOGPROB_BEHAVIOR] = -torch.rand(N, T, L, generator=g) * 2
        fields[D.VALUE] = torch.randn(N, T, generator=g)
    else:
        with torch.no_grad():
            flat_obs = {D.IMAGES: fields[D.IMAGES].flatten(0, 1), D.STATE: fields[D.STATE].flatten(0, 1),
                        D.TASK_ID: fields[D.TASK_ID][:, None].expand(N, T).flatten(),
                        "instruction": ["x"] * (N * T)}
            out = policy.score_actions(flat_obs, fields[D.ACTION_TOKENS].flatten(0, 1), return_entropy=False)
        fields[D.LOGPROB_BEHAVIOR] = out["logprob"].view(N, T, L).float()
        fields[D.VALUE] = out[D.VALUE].view(N, T).float()
    return D.make_trajectory(fields, extras={D.BOOTSTRAP_VALUE: torch.randn(N, generator=g)})


@functools.lru_cache(maxsize=1)
def _default_cfg() -> dict:
    from omegaconf import OmegaConf

    from embodirl.config import compose

    cfg = compose(["env=toy_reach", "model=state_mlp"])
    return OmegaConf.to_container(cfg, resolve=False)


def actor_cfg(algorithm: dict | None = None, actor: dict | None = None) -> dict:
    """The composed defaults of ``algorithm`` and ``actor`` with overrides (nested keys with dots)."""
    base = _default_cfg()
    cfg = {"algorithm": copy.deepcopy(base["algorithm"]), "actor": copy.deepcopy(base["actor"])}
    cfg["actor"]["seed"] = 0
    cfg["actor"]["global_batch_size"] = 8
    cfg["actor"]["micro_batch_size"] = 8
    for node, over in (("algorithm", algorithm or {}), ("actor", actor or {})):
        for key, value in over.items():
            target = cfg[node]
            *parents, last = key.split(".")
            for p in parents:
                target = target[p]
            target[last] = value
    return cfg


def grpo(**over) -> dict:
    base = {"adv_type": "grpo", "group_size": 4, "normalize_advantages": False, "update_epochs": 1,
            "logprob_type": "token"}
    base.update(over)
    return base


def ppo(**over) -> dict:
    base = {"adv_type": "gae", "group_size": 1, "update_epochs": 2, "logprob_type": "action"}
    base.update(over)
    return base


# --- the tiny OpenVLA-OFT preset ------------------------------------------------------------------
OFT_TASKS = ["pick up the black bowl", "open the top drawer"]
OFT_IMAGE = 56  # the tiny preset's image size


@functools.lru_cache(maxsize=1)
def _oft_model_cfg() -> dict:
    from omegaconf import OmegaConf

    from embodirl.config import compose

    return OmegaConf.to_container(compose(["model=openvla_oft_tiny"]).model, resolve=True)


def oft_spec():
    from embodirl.envs.base import EnvSpec

    return EnvSpec(action_dim=7, max_episode_steps=64, task_descriptions=OFT_TASKS, camera_names=["agentview", "wrist"],
                   image_size=(OFT_IMAGE, OFT_IMAGE), state_dim=8, name="libero_like")


def oft_policy(seed: int = 0):
    from embodirl.models.openvla_oft import build_policy

    torch.manual_seed(seed)
    return build_policy(_oft_model_cfg(), oft_spec())


def oft_batch(policy, N: int = 4, T: int = 2, seed: int = 0):
    """Trajectories of a pixel policy (the tiny OFT policy, π0): its own sampled actions, log-probs and values."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (N * T, 2, 3, OFT_IMAGE, OFT_IMAGE), generator=g, dtype=torch.uint8)
    state = torch.randn(N * T, 8, generator=g)
    task_id = (torch.arange(N) % len(OFT_TASKS))[:, None].expand(N, T)
    obs = {D.IMAGES: images, D.STATE: state, D.TASK_ID: task_id.flatten(),
           "instruction": [OFT_TASKS[int(i)] for i in task_id.flatten()]}
    torch.manual_seed(seed)
    out = policy.act(obs, SamplingParams(), return_value=True)
    valid = torch.ones(N, T, dtype=torch.bool)
    valid[-1, -1] = False  # one episode ends a decision early
    last_valid = valid & ~torch.cat([valid[:, 1:], torch.zeros(N, 1, dtype=torch.bool)], 1)
    return D.make_trajectory({
        D.IMAGES: images.view(N, T, 2, 3, OFT_IMAGE, OFT_IMAGE), D.STATE: state.view(N, T, 8),
        D.TASK_ID: task_id[:, 0].contiguous(), policy.action_field: out[policy.action_field].view(N, T, -1),
        D.ACTION_CHUNK: out[D.ACTION_CHUNK].view(N, T, *out[D.ACTION_CHUNK].shape[1:]).float(),
        D.LOGPROB_BEHAVIOR: out[D.LOGPROB_BEHAVIOR].view(N, T, -1).float(), D.VALUE: out[D.VALUE].view(N, T).float(),
        D.REWARD: torch.randn(N, T, generator=g), D.VALID: valid,
        D.TERMINATED: torch.zeros(N, T, dtype=torch.bool), D.TRUNCATED: last_valid,
        D.GROUP_ID: torch.arange(N) // 2,
    })
