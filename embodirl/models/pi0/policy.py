"""π0 (Black et al. 2024) as an embodirl :class:`~embodirl.models.base.Policy`, on transformers'
``PI0ForConditionalGeneration``.

The network is the library's: PaliGemma (SigLIP + Gemma) encodes the cameras and the prompt once per decision into a
key/value cache; a Gemma action expert reads it and predicts the velocity of a flow from noise to a chunk of
``chunk_size`` actions, padded to ``max_action_dim``, with the normalised state as one more input. What this module adds
is what RL needs, as RLinf's ``rlinf/models/embodiment/openpi/openpi_action_model.py`` (RLinf/RLinf @ 558aeb38) adds it:

* ``act`` runs the denoising chain as transformers' ``sample_actions`` does (same calls, same Euler update, the VLM's
  key/value cache computed once and read by every step), with the chain kept in float32, and makes it stochastic by
  Flow-SDE or Flow-Noise (:mod:`.flow`). It returns the chain states a log-probability needs (``action_chain``) and
  per-element log-probs over the executed ``[H, A]`` part of the chunk.
  Greedy decisions (evaluation) run the plain ODE, with no noise added along the chain, from a Gaussian start drawn
  from a generator seeded by :data:`EVAL_NOISE_SEED` and the decision's observation: deterministic, like a greedy
  token policy's argmax, whatever the global generator's state. The start is a draw of the prior, as in transformers'
  ``sample_actions`` and RLinf's evaluation, not its mean: zero is no sample the network was trained from (a draw
  has norm ~sqrt(chunk_size * max_action_dim)), and from it an RL-trained chain scored 0.005 where the same
  weights score 0.28 from draws (README, "π0").
* ``score_actions`` re-runs the prefix and the steps the log-probability covers, with autograd: the drawn step for
  Flow-SDE, every step for Flow-Noise.
* a value head (``model.value_head``): by default RLinf's π0 critic, a ReLU MLP on the action expert's output averaged
  over the chunk positions, detached, at the steps the log-probability covers (the drawn one for Flow-SDE, the mean
  over all for Flow-Noise), so that ``act`` and ``score_actions`` agree on it; or on the VLM's mean prefix feature
  (``features: vlm_prefix``, RLinf's π0.5 mode). For Flow-Noise a noise head on the expert's features. Both train in
  place.
* what trains (``model.train_expert``, ``model.lora``): RLinf's π0 recipe trains the action expert in full (its Gemma
  layers and its action, state and time projections) with PaliGemma frozen; LoRA adapters stay an option.

Inputs follow openpi's (Physical-Intelligence/openpi @ 15a9616a): images resized with padding to ``image_size``
(:func:`resize_with_pad`) and scaled to [-1, 1]; the prompt cleaned (:func:`clean_prompt`) and tokenised as
``BOS, instruction, newline`` after the image tokens, right-padded to a fixed length (``max_prompt_tokens``), so a
decision's numbers do not depend on the rest of its batch; state and actions are standardised with the checkpoint's
statistics and zero-padded. The parameters openpi keeps in float32 stay in float32 in a bfloat16 model
(:data:`.openpi.FP32_PARAMETERS`).

``action_chain`` per decision, float32: Flow-SDE ``[k, x_k, x_{k+1}]`` (the drawn step and its two states, ``1 + 2 *
chunk_size * max_action_dim`` values); Flow-Noise the whole chain ``x_0 .. x_K``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PI0ForConditionalGeneration

from embodirl import data as D
from embodirl.errors import ConfigError
from embodirl.models.base import Policy, SamplingParams
from embodirl.models.lora_merge import AdapterMerger
from embodirl.models.pi0 import flow, lerobot
from embodirl.models.pi0.cache import ExpertCache, PrefixCache
from embodirl.models.pi0.openpi import clean_prompt, fp32_on_load, keep_fp32_, resize_with_pad
from embodirl.models.pi0.schema import Pi0ModelConfig
from embodirl.models.processor import HashWordTokenizer

log = logging.getLogger(__name__)

INSTRUCTION = "instruction"
LOGPROB, ENTROPY = "logprob", "entropy"
#: the statistics file an exported π0 checkpoint carries (transformers' PI0Processor keys)
PROCESSOR_FILE = "processor_config.json"
HEADS_FILE = "embodirl_heads.safetensors"
STAT_KEYS = ("state_mean", "state_std", "actions_mean", "actions_std")
#: PI0Processor's guard against a zero standard deviation
STD_EPS = 1e-8
#: mixed with a greedy decision's observation into the seed of its chain start (:meth:`Pi0Policy._greedy_start`)
EVAL_NOISE_SEED = 0
#: Gemma's tokenizer: BOS and the newline that ends π0's prompt
GEMMA_BOS_ID, GEMMA_NEWLINE_ID = 2, 108
#: ids the hashing tokenizer uses for a model without a tokenizer (above Gemma's special ids)
HASH_ID_LOW = 256
#: PaliGemma's vocabulary: a checkpoint with it reads prompts through PaliGemma's tokenizer, whose files it must carry
PALIGEMMA_VOCAB = 257_152
#: compiled variants dynamo may keep per transformer block (:meth:`Pi0Policy.compile_blocks_`): its layer, the cache
#: kind (the VLM's prefix, the expert's read-through), a batch size, its dynamic-shape generalisation
COMPILE_VARIANTS_PER_BLOCK = 4
#: activation bytes per token, layer and hidden unit of the action expert's training pass with the VLM frozen, without
#: and with gradient checkpointing (:meth:`Pi0Policy.activation_profile`). The full-size dry run (LIBERO's two cameras,
#: 48 decisions per micro-batch) measures 119 (Flow-SDE) and 129 (Flow-Noise) without it. With it the peak is the
#: frozen prefix pass's transient (~2.4 GiB for both methods), which a per-token constant follows only roughly: 200
#: puts both within 10 %
EXPERT_ACT_BYTES, EXPERT_RECOMPUTED_BYTES = 115, 200
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
#: the action expert's parameters (``model.train_expert``): its Gemma layers and final norm, the action/state/time
#: projections and the velocity head. Not the expert's token embedding, which π0 never reads (it feeds the expert
#: embeddings; openpi deletes it: ``gemma_expert.model.embed_tokens = None`` in gemma_pytorch.py)
EXPERT_PREFIXES = ("model.dit.", "embed_action_time.", "action_out_proj.")
EXPERT_UNUSED = "model.dit.embed_tokens."


def _mlp(sizes: Sequence[int], activation: type[nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


class ValueHead(nn.Module):
    """RLinf's critic MLP (rlinf/models/embodiment/modules/value_head.py @ 558aeb38, with the ReLU and the last layer's
    bias openpi_action_model.py gives it): ReLU between the layers, hidden layers Kaiming-normal (fan out), the last
    N(0, 0.02), zero biases; one value (``chunk_level``) or ``H`` (``action_level``) per feature vector."""

    def __init__(self, width: int, hidden_sizes: Sequence[int], outputs: int):
        super().__init__()
        self.mlp = _mlp([width, *hidden_sizes, outputs], nn.ReLU)
        linears = [m for m in self.mlp if isinstance(m, nn.Linear)]
        for layer in linears[:-1]:
            nn.init.kaiming_normal_(layer.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(layer.bias)
        nn.init.normal_(linears[-1].weight, mean=0.0, std=0.02)
        nn.init.zeros_(linears[-1].bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.mlp(features.to(self.mlp[0].weight.dtype)).float()


class NoiseHead(nn.Module):
    """Flow-Noise's standard deviation per action element from the expert's feature of each chunk position: a tanh
    MLP whose output goes through tanh and is mapped linearly onto the log-variance between ``log(low^2)`` and
    ``log(high^2)`` (:func:`.flow.log_variance_std`; RLinf's ``ExploreNoiseNet``,
    rlinf/models/embodiment/modules/explore_noise_net.py @ 558aeb38)."""

    def __init__(self, width: int, hidden_sizes: Sequence[int], outputs: int, low: float, high: float):
        super().__init__()
        self.mlp = _mlp([width, *hidden_sizes, outputs], nn.Tanh)
        self.low, self.high = float(low), float(high)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        raw = self.mlp(features.to(self.mlp[0].weight.dtype)).float()
        return flow.log_variance_std(raw, self.low, self.high)


def expert_parameters(network) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of the action expert (:data:`EXPERT_PREFIXES`, without its unused token embedding)."""
    return [(name, p) for name, p in network.named_parameters()
            if name.startswith(EXPERT_PREFIXES) and not name.startswith(EXPERT_UNUSED)]


class Pi0Policy(Policy):
    """See module docstring. Build with :func:`build_policy`."""

    action_field = D.ACTION_CHAIN

    def __init__(self, model: Pi0ModelConfig, network, *, action_dim: int, num_images: int,
                 statistics: Mapping[str, Sequence[float]] | None = None, tokenizer=None,
                 task_descriptions: Sequence[str] | None = None, action_low=-1.0, action_high=1.0):
        super().__init__()
        cfg = network.config
        self.model_cfg = model
        self.method = model.flow.method
        self.num_steps = int(model.flow.num_steps)
        self.noise_level = float(model.flow.noise_level)
        self.chunk_size, self.max_action_dim = int(cfg.chunk_size), int(cfg.max_action_dim)
        self.max_state_dim = int(cfg.max_state_dim)
        self.action_chunk, self.action_dim = int(model.action_chunk), int(action_dim)
        self.value_type = model.value_type
        self.value_features, self.detach_value = model.value_head.features, bool(model.value_head.detach)
        self.joint_logprob = bool(model.flow.joint_logprob)
        self.train_expert = bool(model.train_expert)
        self.num_images = int(num_images)
        self.task_descriptions = list(task_descriptions or [])
        self.tokenizer = tokenizer
        vision = cfg.vlm_config.vision_config
        self.image_size = int(vision.image_size)
        self.tokens_per_image = (self.image_size // int(vision.patch_size)) ** 2
        self.image_token_id = int(cfg.vlm_config.image_token_id)
        vocab = int(cfg.vlm_config.text_config.vocab_size)
        self._words = HashWordTokenizer(HASH_ID_LOW, vocab) if tokenizer is None else None
        self.prompt_length = self.num_images * self.tokens_per_image + int(model.max_prompt_tokens)
        self._prompt_cache: dict[str, tuple[int, ...]] = {}
        device = network.action_out_proj.weight.device
        dtype = network.action_out_proj.weight.dtype
        with torch.device(device):
            text = cfg.vlm_config.text_config
            outputs = 1 if self.value_type == D.CHUNK_LEVEL else self.action_chunk
            width = cfg.dit_config.hidden_size if self.value_features == "expert" else text.hidden_size
            self.value_head = (ValueHead(width, model.value_head.hidden_sizes, outputs).to(dtype)
                               if self.value_type is not None else None)
            low, high = model.flow.noise_std_range
            self.noise_head = (NoiseHead(cfg.dit_config.hidden_size, model.flow.noise_head_hidden_sizes,
                                         self.max_action_dim, low, high).to(dtype)
                               if self.method == flow.FLOW_NOISE else None)
        self.statistics = dict(statistics) if statistics else None
        stats = self._statistics_tensors(self.statistics, device)
        for name, tensor in stats.items():
            self.register_buffer(name, tensor, persistent=False)
        low = torch.as_tensor(action_low, dtype=torch.float32, device=device).expand(self.action_dim)
        high = torch.as_tensor(action_high, dtype=torch.float32, device=device).expand(self.action_dim)
        self.register_buffer("action_low", low.clone(), persistent=False)
        self.register_buffer("action_high", high.clone(), persistent=False)
        self.pi0 = apply_lora(network, model.lora, train_expert=self.train_expert) if model.lora.enabled else network
        self._merger = AdapterMerger()      # merge_adapters_ (rollout.merge_lora)
        self._check_prompts(self.task_descriptions)

    # --- structure -------------------------------------------------------------------------------
    @property
    def network(self):
        """The ``PI0ForConditionalGeneration`` (LoRA layers injected in place when adapters are on)."""
        return self.pi0.get_base_model() if hasattr(self.pi0, "get_base_model") else self.pi0

    @property
    def device(self) -> torch.device:
        return self.network.action_out_proj.weight.device

    @property
    def chain_width(self) -> int:
        """Values of ``action_chain`` per decision (see module docstring)."""
        width = self.chunk_size * self.max_action_dim
        return 1 + 2 * width if self.method == flow.FLOW_SDE else (self.num_steps + 1) * width

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.network.action_out_proj.weight.dtype

    def _statistics_tensors(self, statistics, device) -> dict[str, torch.Tensor]:
        """Standardisation statistics padded to the network's widths: state ``[max_state_dim]``, actions
        ``[max_action_dim]`` (identity where the checkpoint says nothing)."""
        out = {}
        for key, width in (("state", self.max_state_dim), ("actions", self.max_action_dim)):
            mean = torch.zeros(width, dtype=torch.float32, device=device)
            std = torch.ones(width, dtype=torch.float32, device=device)
            if statistics is not None and f"{key}_mean" in statistics:
                m = torch.as_tensor(statistics[f"{key}_mean"], dtype=torch.float32).reshape(-1)
                s = torch.as_tensor(statistics[f"{key}_std"], dtype=torch.float32).reshape(-1)
                if m.numel() > width or s.numel() != m.numel():
                    raise ConfigError("model.path", f"the checkpoint's {key}_mean/{key}_std have {m.numel()}/"
                                                    f"{s.numel()} entries; the network takes at most {width}")
                mean[: m.numel()] = m.to(device)
                std[: s.numel()] = s.to(device)
            out[f"{key}_mean"], out[f"{key}_std"] = mean, std
        return out

    def set_statistics(self, statistics: Mapping) -> None:
        """Standardise state and actions with ``statistics`` from now on, and write them with :meth:`save_pretrained`:
        PI0Processor's keys (``state_mean``, ``state_std``, ``actions_mean``, ``actions_std``), or the
        ``dataset_statistics.json`` layout ``embodirl sft`` computes (one entry with ``action`` and ``proprio``
        blocks; their ``mean`` and ``std`` are used)."""
        if not any(k in statistics for k in STAT_KEYS):
            entries = [v for v in statistics.values() if isinstance(v, Mapping) and "action" in v]
            if len(entries) != 1:
                raise ValueError("π0 statistics need state/actions mean and std, or one dataset_statistics entry")
            entry = entries[0]
            statistics = {"actions_mean": entry["action"]["mean"], "actions_std": entry["action"]["std"]}
            if "proprio" in entry:
                statistics.update(state_mean=entry["proprio"]["mean"], state_std=entry["proprio"]["std"])
        self.statistics = {k: list(map(float, statistics[k])) for k in STAT_KEYS if k in statistics}
        for name, tensor in self._statistics_tensors(self.statistics, self.device).items():
            getattr(self, name).copy_(tensor)

    # --- inputs ----------------------------------------------------------------------------------
    def prompt_ids(self, instruction: str) -> tuple[int, ...]:
        """``BOS, instruction, newline`` ids (the image tokens go before them), the instruction cleaned as openpi cleans
        it (:func:`clean_prompt`) and the newline encoded on its own, as openpi's ``PaligemmaTokenizer.tokenize`` does
        (src/openpi/models/tokenizer.py @ 15a9616a)."""
        ids = self._prompt_cache.get(instruction)
        if ids is None:
            text = clean_prompt(instruction)
            if self._words is not None:
                ids = (GEMMA_BOS_ID, *self._words.encode(text), GEMMA_NEWLINE_ID)
            else:
                tok = self.tokenizer
                ids = (tok.bos_token_id, *tok.encode(text, add_special_tokens=False),
                       *tok.encode("\n", add_special_tokens=False))
            self._prompt_cache[instruction] = ids
        return ids

    def _check_prompts(self, instructions: Sequence[str]) -> None:
        limit = int(self.model_cfg.max_prompt_tokens)
        for text in instructions:
            n = len(self.prompt_ids(text))
            if n > limit:
                raise ConfigError("model.max_prompt_tokens", f"is {limit} but the instruction '{text}' takes {n} "
                                                             f"tokens; raise it to at least {n}")

    def _instructions(self, obs: Mapping, batch: int) -> list[str]:
        instructions = obs.get(INSTRUCTION)
        if instructions is None and obs.get(D.TASK_ID) is not None and self.task_descriptions:
            ids = obs[D.TASK_ID]
            ids = ids.reshape(-1).tolist() if torch.is_tensor(ids) else np.asarray(ids).reshape(-1).tolist()
            instructions = [self.task_descriptions[int(t)] for t in ids]
        if instructions is None or len(instructions) != batch:
            raise ValueError(f"obs needs '{INSTRUCTION}' (one string per batch element) or '{D.TASK_ID}' indexing "
                             f"the env's task table ({batch} elements)")
        return [str(t) for t in instructions]

    def prepare_inputs(self, obs: Mapping) -> dict[str, torch.Tensor]:
        """Observation dict -> the network's inputs on the policy's device. The uint8 images move once; resize and
        scaling run on the device."""
        device, dtype = self.device, self.compute_dtype
        images = obs.get(D.IMAGES)
        if images is None:
            raise KeyError(f"π0 needs obs['{D.IMAGES}'] (uint8 [B, V, 3, h, w])")
        images = torch.from_numpy(np.ascontiguousarray(images)) if isinstance(images, np.ndarray) else images
        if images.ndim != 5 or images.shape[1] < self.num_images:
            raise ValueError(f"obs['{D.IMAGES}'] has shape {tuple(images.shape)}; expected [B, V>={self.num_images}, "
                             "3, h, w]")
        B = images.shape[0]
        x = images[:, : self.num_images].to(device, non_blocking=True).flatten(0, 1).float()   # (B*V, 3, h, w)
        x = resize_with_pad(x, self.image_size)                                             # (B*V, 3, S, S)
        pixels = x / 255.0 * 2.0 - 1.0                                                     # [-1, 1], as openpi
        # float32: SigLIP's patch embedding casts them to its own dtype (float32, openpi.FP32_PARAMETERS)
        pixel_values = pixels.reshape(B, self.num_images, 3, self.image_size, self.image_size)
        pixel_mask = torch.ones(B, self.num_images, dtype=torch.bool, device=device)
        rows = [self.prompt_ids(t) for t in self._instructions(obs, B)]
        image_ids = [self.image_token_id] * (self.num_images * self.tokens_per_image)
        ids = torch.zeros(B, self.prompt_length, dtype=torch.int64)
        mask = torch.zeros(B, self.prompt_length, dtype=torch.int64)
        for i, row in enumerate(rows):
            if len(image_ids) + len(row) > self.prompt_length:
                raise ValueError(f"an instruction takes {len(row)} tokens, over model.max_prompt_tokens")
            full = torch.tensor([*image_ids, *row], dtype=torch.int64)
            ids[i, : len(full)] = full
            mask[i, : len(full)] = 1
        state = obs.get(D.STATE)
        if state is None:      # an env without a state vector: the padding π0 gives missing dimensions
            state = torch.zeros(B, self.max_state_dim, device=device)
        else:
            state = torch.as_tensor(np.asarray(state) if not torch.is_tensor(state) else state)
            state = state.to(device=device, dtype=torch.float32).reshape(B, -1)
            if state.shape[1] > self.max_state_dim:
                raise ValueError(f"the state has {state.shape[1]} entries; the network takes at most "
                                 f"{self.max_state_dim}")
            state = F.pad(state, (0, self.max_state_dim - state.shape[1]))
            state = (state - self.state_mean) / (self.state_std + STD_EPS)
        return {"input_ids": ids.to(device, non_blocking=True), "attention_mask": mask.to(device, non_blocking=True),
                "pixel_values": pixel_values, "pixel_attention_mask": pixel_mask, "state": state.to(dtype)}

    # --- the network's two halves ------------------------------------------------------------------
    def _prefix(self, inputs: Mapping) -> tuple[object, torch.Tensor]:
        """The VLM over images and prompt: its key/value cache and last hidden states, as ``sample_actions`` runs it."""
        net = self.network
        mask = inputs["attention_mask"]
        embeds = net.model.embed_prefix(inputs["input_ids"], inputs["pixel_values"], inputs["pixel_attention_mask"])
        cache = PrefixCache()
        out = net.model.vlm(inputs_embeds=embeds, attention_mask=mask, position_ids=mask.cumsum(-1) - 1,
                            token_type_ids=torch.zeros_like(embeds)[:, :, 0], past_key_values=cache, use_cache=True)
        return cache, out.last_hidden_state

    def _velocity(self, inputs: Mapping, cache: PrefixCache, x: torch.Tensor,
                  times: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert pass at chain state ``x`` float32 ``[B, Hm, Am]`` and times ``[B]`` over the prefix ``cache``: the
        velocity (float32) and the expert's features of the chunk positions."""
        net = self.network
        embeds = net.embed_action_time(inputs["state"], x.to(self.compute_dtype), times)
        out = net.model(action_embeds=embeds, attention_mask=inputs["attention_mask"],
                        pixel_attention_mask=inputs["pixel_attention_mask"], past_key_values=ExpertCache(cache))
        hidden = out.last_hidden_state[:, -self.chunk_size:]
        velocity = net.action_out_proj(hidden)
        return velocity.float(), hidden

    def _value(self, features: torch.Tensor) -> torch.Tensor:
        """The value head on ``features`` ``[B, W]`` (detached with ``model.value_head.detach``): ``[B]`` or ``[B, H]``."""
        if self.detach_value:
            features = features.detach()
        values = self.value_head(features)                                    # (B, 1) or (B, H)
        return values.squeeze(-1) if self.value_type == D.CHUNK_LEVEL else values

    def _prefix_value(self, prefix_hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``features: vlm_prefix``: the value of the VLM's mean prefix feature over the attended tokens."""
        weights = mask.to(prefix_hidden.dtype)[..., None]
        return self._value((prefix_hidden * weights).sum(1) / weights.sum(1))

    def _expert_value(self, hidden: torch.Tensor) -> torch.Tensor:
        """``features: expert``: the value of one expert pass's output ``[B, chunk_size, W]`` averaged over the chunk
        positions, in float32 (RLinf's ``sample_mean_var_val`` with ``chunk_critic_input`` False)."""
        return self._value(hidden.float().mean(1))

    @property
    def _expert_values(self) -> bool:
        return self.value_head is not None and self.value_features == "expert"

    def _times(self, steps: torch.Tensor) -> torch.Tensor:
        """Float32 times ``t_k`` of step indices ``[B]`` on the policy's device, equal to :func:`flow.step_time`'s
        (the same float64 operations, then one rounding), without reading the indices on the host."""
        steps = steps.to(self.device)
        return (1.0 + steps.to(torch.float64) * (-1.0 / self.num_steps)).to(torch.float32)

    def _sde_step(self, x, velocity, steps: torch.Tensor, temperature: float):
        times = self._times(steps)[:, None, None]
        sigma = flow.sde_sigma(times, self.num_steps, self.noise_level)
        mean, std = flow.sde_transition(x, velocity, times, 1.0 / self.num_steps, sigma)
        return mean, std * temperature

    def _executed(self, per_element: torch.Tensor) -> torch.Tensor:
        """``[B, Hm, Am]`` -> the executed part ``[B, H * A]``."""
        return per_element[:, : self.action_chunk, : self.action_dim].reshape(per_element.shape[0], -1)

    def _unnormalize(self, x: torch.Tensor) -> torch.Tensor:
        actions = x * (self.actions_std + STD_EPS) + self.actions_mean       # (B, Hm, Am)
        chunk = actions[:, : self.action_chunk, : self.action_dim]
        return torch.maximum(torch.minimum(chunk, self.action_high), self.action_low)

    # --- Policy interface --------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: dict, sampling: SamplingParams, *, return_value: bool = False,
            noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``noise`` (float32 ``[B, chunk_size, max_action_dim]``): the chain's start; default Gaussian, for greedy
        decisions seeded by each row's observation (:meth:`_greedy_start`), so that an evaluation is the same
        whatever the global generator's state."""
        inputs = self.prepare_inputs(obs)
        B, K = inputs["state"].shape[0], self.num_steps
        cache, prefix_hidden = self._prefix(inputs)
        shape = (B, self.chunk_size, self.max_action_dim)
        greedy = sampling.deterministic
        if noise is not None:
            x = noise.to(device=self.device, dtype=torch.float32)
        else:
            x = self._greedy_start(obs, shape) if greedy else torch.randn(shape, device=self.device)
        temperature = 1.0 if greedy else float(sampling.temperature)
        dt = -1.0 / K
        want_expert_value = return_value and self._expert_values
        value = None
        if self.method == flow.FLOW_SDE:
            # one stochastic step per decision, drawn uniformly (greedy: none; step 0's kernel scores the ODE step);
            # an expert-feature value is that step's, as score_actions() recomputes it
            drawn = torch.randint(K, (B,)) if not greedy else torch.zeros(B, dtype=torch.int64)
            x_before = x_after = logprob = None
            for k in range(K):
                t = flow.step_time(k, K)
                velocity, hidden = self._velocity(inputs, cache, x, torch.full((B,), t, device=self.device))
                ode = x + dt * velocity
                here = drawn == k
                if bool(here.any()):
                    mean, std = self._sde_step(x, velocity, torch.full((B,), k), temperature)
                    step = ode if greedy else mean + std * torch.randn_like(mean)
                    rows = here.to(self.device)[:, None, None]
                    x_before = x.clone() if x_before is None else torch.where(rows, x, x_before)
                    x_after = step.clone() if x_after is None else torch.where(rows, step, x_after)
                    lp = flow.gaussian_logprob(step, mean, std)
                    logprob = lp if logprob is None else torch.where(rows, lp, logprob)
                    x = torch.where(rows, step, ode)
                    if want_expert_value:
                        v = self._expert_value(hidden)                              # (B,) or (B, H)
                        value = v if value is None else torch.where(rows.reshape(B, *[1] * (v.dim() - 1)), v, value)
                else:
                    x = ode
            chain = torch.cat([drawn.to(self.device, torch.float32)[:, None], x_before.reshape(B, -1),
                               x_after.reshape(B, -1)], dim=1)
        else:
            # every step stochastic; with joint_logprob the prior's log N(x_0; 0, I) is one more term of the mean
            states = [x]
            logprob = flow.standard_normal_logprob(x) if self.joint_logprob else torch.zeros_like(x)
            for k in range(K):
                t = flow.step_time(k, K)
                velocity, hidden = self._velocity(inputs, cache, x,
                                                  torch.full((B,), t, device=self.device))
                mean = x + dt * velocity
                std = self.noise_head(hidden) * temperature
                step = mean if greedy else mean + std * torch.randn_like(mean)
                logprob = logprob + flow.gaussian_logprob(step, mean, std)
                if want_expert_value:
                    v = self._expert_value(hidden)
                    value = v if value is None else value + v
                x = step
                states.append(x)
            logprob = logprob / (K + 1 if self.joint_logprob else K)
            value = value / K if value is not None else None
            chain = torch.stack(states, dim=1).reshape(B, -1)
        out = {D.ACTION_CHUNK: self._unnormalize(x).float(), D.ACTION_CHAIN: chain.float(),
               D.LOGPROB_BEHAVIOR: self._executed(logprob).float()}
        if return_value and self.value_head is not None:
            out[D.VALUE] = value if want_expert_value else self._prefix_value(prefix_hidden, inputs["attention_mask"])
        return out

    def _greedy_start(self, obs: dict, shape: tuple[int, ...]) -> torch.Tensor:
        """A greedy decision's chain start: per row, a Gaussian draw from a generator seeded with
        :data:`EVAL_NOISE_SEED` and the row's own observation (camera bytes and state), so that it is a fresh draw
        at every decision, as a sampled one is, yet the same for the same observation whatever the global
        generator's state, the batch or the row's place in it."""
        views = [obs[key] for key in (D.IMAGES, D.STATE) if obs.get(key) is not None]
        if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in views):
            return torch.randn(shape, device=self.device)      # the dry run: shapes only
        rows = [np.ascontiguousarray(v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v))
                for v in views]
        starts = []
        for i in range(shape[0]):
            seed = EVAL_NOISE_SEED
            for view in rows:
                seed = zlib.crc32(view[i].tobytes(), seed)
            starts.append(torch.randn(shape[1:], generator=torch.Generator().manual_seed(seed)))
        return torch.stack(starts).to(self.device)

    def score_actions(self, obs: dict, actions: torch.Tensor, *, temperature: float = 1.0,
                 return_value: bool = True, return_entropy: bool = True) -> dict[str, torch.Tensor]:
        chain = torch.as_tensor(actions).to(self.device, torch.float32)
        B = chain.shape[0]
        width, expected = self.chunk_size * self.max_action_dim, self.chain_width
        if tuple(chain.shape) != (B, expected):
            raise ValueError(f"action chains have shape {tuple(chain.shape)}, expected {(B, expected)} for "
                             f"{self.method} with {self.num_steps} steps")
        inputs = self.prepare_inputs(obs)
        cache, prefix_hidden = self._prefix(inputs)
        shape = (B, self.chunk_size, self.max_action_dim)
        want_expert_value = return_value and self._expert_values
        value = None
        if self.method == flow.FLOW_SDE:
            steps = chain[:, 0].round().long()
            x_before, x_after = chain[:, 1: 1 + width].reshape(shape), chain[:, 1 + width:].reshape(shape)
            velocity, hidden = self._velocity(inputs, cache, x_before, self._times(steps))
            mean, std = self._sde_step(x_before, velocity, steps, temperature)
            logprob, entropy = flow.gaussian_logprob(x_after, mean, std), flow.gaussian_entropy(std)
            if want_expert_value:
                value = self._expert_value(hidden)
        else:
            K = self.num_steps
            states = chain.reshape(B, K + 1, *shape[1:])
            if self.joint_logprob:           # the prior's term: log N(x_0; 0, I), entropy of N(0, 1)
                logprob = flow.standard_normal_logprob(states[:, 0])
                entropy = flow.gaussian_entropy(torch.ones_like(states[:, 0]))
            else:
                logprob = entropy = 0.0
            for k in range(K):
                t = flow.step_time(k, K)
                velocity, hidden = self._velocity(inputs, cache, states[:, k],
                                                  torch.full((B,), t, device=self.device))
                mean = states[:, k] + (-1.0 / K) * velocity
                std = self.noise_head(hidden) * temperature
                logprob = logprob + flow.gaussian_logprob(states[:, k + 1], mean, std)
                entropy = entropy + flow.gaussian_entropy(std)
                if want_expert_value:
                    v = self._expert_value(hidden)
                    value = v if value is None else value + v
            terms = K + 1 if self.joint_logprob else K
            logprob, entropy = logprob / terms, entropy / terms
            value = value / K if value is not None else None
        result = {LOGPROB: self._executed(logprob)}
        if return_entropy:
            result[ENTROPY] = self._executed(entropy)
        if return_value and self.value_head is not None:
            result[D.VALUE] = value if want_expert_value else self._prefix_value(prefix_hidden, inputs["attention_mask"])
        return result

    def supervised(self, obs: dict, actions: torch.Tensor, *, stop_token: bool = False,
                   l1_head: bool = False) -> dict[str, torch.Tensor]:
        """π0's flow-matching loss on one batch (``embodirl sft``), as sums (with autograd). ``actions``: chunks
        ``[B, H', A]`` standardised with the statistics (``model.normalization: mean_std``), ``H' <= chunk_size``;
        they are zero-padded to the network's chunk as ``PI0Processor`` pads them. As transformers' forward trains it:
        a time ``t`` per sample from Beta(1.5, 1) scaled into [0.001, 1], ``x_t = t noise + (1 - t) actions``, and the
        squared error of the predicted velocity against ``noise - actions``, here over the real ``[H', A]`` part only
        (the padding carries no label). Returns ``ce_sum`` (that squared error summed), ``labels`` and ``tokens``
        (the element count) and ``l1_sum`` (its absolute error summed): :meth:`Actor.sft_update`'s keys."""
        if stop_token or l1_head:
            raise ValueError("π0 has no stop token and no L1 head (sft.stop_token / sft.l1_head are OpenVLA-OFT's)")
        inputs = self.prepare_inputs(obs)
        target = torch.as_tensor(actions, dtype=torch.float32).to(self.device)
        B, H, A = target.shape
        padded = F.pad(target, (0, self.max_action_dim - A, 0, self.chunk_size - H))        # (B, Hm, Am)
        cfg = self.network.config
        beta = torch.distributions.Beta(torch.tensor(float(cfg.time_sampling_beta_alpha)),
                                        torch.tensor(float(cfg.time_sampling_beta_beta)))
        times = (beta.sample((B,)) * cfg.time_sampling_scale + cfg.time_sampling_offset).float().to(self.device)
        noise = torch.randn(padded.shape).to(self.device)
        x_t = times[:, None, None] * noise + (1.0 - times[:, None, None]) * padded
        cache, _ = self._prefix(inputs)
        velocity, _ = self._velocity(inputs, cache, x_t, times)
        error = (velocity - (noise - padded))[:, :H, :A]
        count = torch.tensor(float(error.numel()))
        return {"ce_sum": error.pow(2).sum(), "labels": count, "tokens": count,
                "l1_sum": error.detach().abs().sum()}

    def merge_adapters_(self) -> None:
        """Fold the LoRA adapters into the weights for an inference copy (``rollout.merge_lora``; see
        :mod:`embodirl.models.lora_merge`)."""
        self._merger.merge(self.pi0, self.device)

    def compile_blocks_(self) -> int:
        """Compile each transformer block of the vision tower, the VLM and the action expert in place.

        The blocks share one forward (transformers' ``GradientCheckpointingLayer``), and dynamo keeps its compiled
        variants per code object: each Gemma layer is one more (its ``layer_idx`` indexes the key/value cache, a static
        int), and a batch size or cache kind another. Under dynamo's default ``recompile_limit`` (8) all but 8 of
        π0's 36 Gemma layers ran uncompiled (a CPU run with 6 + 6 layers hit the limit); the limits are raised here
        to four variants per block."""
        import torch._dynamo

        net = self.network
        blocks = [*net.model.vlm.vision_tower.encoder.layers, *net.model.vlm.language_model.layers,
                  *net.model.dit.layers]
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, COMPILE_VARIANTS_PER_BLOCK * len(blocks))
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit,
                                                 COMPILE_VARIANTS_PER_BLOCK * len(blocks))
        for block in blocks:
            block.compile()
        return len(blocks)

    def _vlm_trains(self) -> bool:
        return any(p.requires_grad for p in self.network.model.vlm.parameters())

    def activation_profile(self) -> dict:
        """What ``embodirl doctor``'s memory estimate (:mod:`embodirl.tools.memory_plan`) needs for the trainable set: the
        layers, width and tokens whose activations a training pass keeps, and the bytes per token, layer and hidden
        unit (without checkpointing) and of the recomputed layer (with it). The constants are the full-size dry run's
        (``tests/test_dry_run.py``).

        * The VLM trains (LoRA on it, or ``actor.fsdp.full_finetune``): the VLM's layers over the prefix; 165 and 374
          (float32 LoRA on every linear layer) fold in the vision tower and the expert, and Gemma's MLP is 8x its
          width, against Llama-2's 2.7x (OpenVLA-OFT's 80 and 128).
        * The VLM frozen (RLinf's recipe): nothing of the prefix pass is kept; the expert's layers over the chunk and
          the state token, once per expert pass with gradients (the drawn step for Flow-SDE, every step for
          Flow-Noise). The constants fold in the prefix keys and values each expert layer's attention keeps (two
          cameras and a 48-token prompt: 560 prefix tokens)."""
        if self._vlm_trains():
            text = self.network.config.vlm_config.text_config
            return {"layers": int(text.num_hidden_layers), "hidden": int(text.hidden_size),
                    "tokens": self.prompt_length, "act_bytes_per_token_layer": 165,
                    "recomputed_layer_bytes_per_token": 374}
        expert = self.network.config.dit_config
        passes = 1 if self.method == flow.FLOW_SDE else self.num_steps
        return {"layers": int(expert.num_hidden_layers), "hidden": int(expert.hidden_size),
                "tokens": passes * (self.chunk_size + 1), "act_bytes_per_token_layer": EXPERT_ACT_BYTES,
                "recomputed_layer_bytes_per_token": EXPERT_RECOMPUTED_BYTES}

    def fsdp_keeps_gathered(self, unit: nn.Module) -> bool:
        """FSDP2 keeps the VLM's decoder layers gathered from forward to backward when they train: the expert reads
        their keys and values from the cache, so their weights get gradients that do not pass through the layers'
        outputs. A frozen VLM (RLinf's recipe) reshards them after the forward like every unit."""
        return (any(unit is layer for layer in self.network.model.vlm.language_model.layers)
                and any(p.requires_grad for p in unit.parameters()))

    @contextlib.contextmanager
    def reference_mode(self):
        """Adapters off: the network as loaded (the noise head, which the reference shares, stays as trained)."""
        if self.train_expert:
            raise NotImplementedError("this π0 policy trains its action expert in full (model.train_expert), so it "
                                      "has no separate reference policy")
        if not hasattr(self.pi0, "disable_adapter"):
            raise NotImplementedError("this π0 policy has no LoRA adapter (model.lora.enabled is false), so it has "
                                      "no separate reference policy")
        with self.pi0.disable_adapter():
            yield

    # --- the public checkpoint layout ----------------------------------------------------------------
    def merged_network_state(self) -> dict[str, torch.Tensor]:
        """The network's weights under their ``PI0ForConditionalGeneration`` names, LoRA folded in (nothing changes
        in the live model)."""
        from peft.tuners.lora import LoraLayer

        net = self.network
        state = {}
        lora_layers = {name: m for name, m in net.named_modules() if isinstance(m, LoraLayer)}
        for name, tensor in net.state_dict().items():
            if ".lora_" in name:
                continue
            layer_name, _, leaf = name.rpartition(".base_layer.")
            if layer_name in lora_layers and leaf == "weight":
                layer = lora_layers[layer_name]
                with torch.no_grad():
                    tensor = tensor + layer.get_delta_weight(layer.active_adapters[0]).to(tensor.dtype)
            state[name.replace(".base_layer.", ".")] = tensor.detach()
        return state

    def save_pretrained(self, directory, *, step: int = 0, marker: Mapping | None = None) -> Path:
        """A transformers ``PI0ForConditionalGeneration`` folder (``from_pretrained`` reads it back, adapters folded
        in), the statistics in ``processor_config.json``, and the value and noise heads in ``embodirl_heads.safetensors``."""
        from safetensors.torch import save_file
        from transformers import PI0ForConditionalGeneration
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        plain = PI0ForConditionalGeneration._from_config(self.network.config)
        plain.load_state_dict(self.merged_network_state(), strict=True, assign=True)
        plain.config.embodirl = {"step": int(step), **dict(marker or {})}
        plain.save_pretrained(str(directory))
        stats = dict(self.statistics or {})
        stats.update(max_state_dim=self.max_state_dim, chunk_size=self.chunk_size)
        (directory / PROCESSOR_FILE).write_text(json.dumps(stats, indent=2))
        heads = {f"{name}.{k}": v.detach().cpu().contiguous() for name in ("value_head", "noise_head")
                 if getattr(self, name) is not None for k, v in getattr(self, name).state_dict().items()}
        if heads:
            save_file(heads, str(directory / HEADS_FILE), metadata={"format": "pt"})
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(directory))
        return directory


# --- building ---------------------------------------------------------------------------------------------------
def network_config(model: Pi0ModelConfig):
    """The ``PI0Config`` of a randomly initialised network of ``model``'s sizes."""
    from transformers import PI0Config

    lang, exp, vis = model.language, model.expert, model.vision
    if lang.num_hidden_layers != exp.num_hidden_layers:
        raise ConfigError("model.expert.num_hidden_layers", f"is {exp.num_hidden_layers}; the action expert reads the "
                                                            f"VLM's cache layer by layer, so it needs the VLM's "
                                                            f"{lang.num_hidden_layers}")
    for key in ("num_key_value_heads", "head_dim"):
        if getattr(lang, key) != getattr(exp, key):
            raise ConfigError(f"model.expert.{key}", f"is {getattr(exp, key)}; the expert reads the VLM's key/value "
                                                     f"cache, so it needs model.language.{key} = {getattr(lang, key)}")
    if model.image_size % vis.patch_size:
        raise ConfigError("model.image_size", f"{model.image_size} is not a multiple of the patch size {vis.patch_size}")
    text = {"model_type": "gemma", "hidden_size": lang.hidden_size, "num_hidden_layers": lang.num_hidden_layers,
            "intermediate_size": lang.intermediate_size, "num_attention_heads": lang.num_attention_heads,
            "num_key_value_heads": lang.num_key_value_heads, "head_dim": lang.head_dim, "vocab_size": lang.vocab_size}
    vision = {"model_type": "siglip_vision_model", "hidden_size": vis.hidden_size,
              "intermediate_size": vis.intermediate_size, "num_hidden_layers": vis.num_hidden_layers,
              "num_attention_heads": vis.num_attention_heads, "patch_size": vis.patch_size,
              "image_size": model.image_size, "vision_use_head": False}
    expert = {"model_type": "gemma", "hidden_size": exp.hidden_size, "num_hidden_layers": exp.num_hidden_layers,
              "intermediate_size": exp.intermediate_size, "num_attention_heads": exp.num_attention_heads,
              "num_key_value_heads": exp.num_key_value_heads, "head_dim": exp.head_dim}
    return PI0Config(vlm_config={"model_type": "paligemma", "text_config": text, "vision_config": vision,
                                 "projection_dim": lang.hidden_size, "image_token_id": lang.vocab_size},
                     dit_config=expert, chunk_size=model.chunk_size, max_state_dim=model.max_state_dim,
                     max_action_dim=model.max_action_dim, num_inference_steps=model.flow.num_steps)


def lora_on_expert(targets) -> ConfigError:
    """The refusal of adapters on an expert that ``model.train_expert`` trains in full."""
    return ConfigError("model.lora.target_modules", f"{targets} puts adapters on the action expert, which "
                                                    "model.train_expert trains in full; use vlm, or set "
                                                    "model.train_expert=false")


def apply_lora(network, settings, *, train_expert: bool = False):
    """Wrap the network in a :class:`peft.PeftModel` with adapters (at zero) on its linear layers: ``all-linear``
    (the vision tower, the VLM, the expert and the action projections), ``expert`` (the action expert and the action
    projections), ``vlm`` (the vision tower and the VLM), or a list of module-name suffixes. With ``train_expert`` the
    expert trains in full, so adapters there are refused."""
    import peft

    linears = [name for name, m in network.named_modules() if isinstance(m, nn.Linear)]
    expert = [n for n in linears if n.startswith(("model.dit.", "embed_action_time.", "action_out_proj"))]
    vlm = [n for n in linears if n.startswith("model.vlm.")]
    groups = {"all-linear": expert + vlm, "expert": expert, "vlm": vlm}
    targets = settings.target_modules
    if isinstance(targets, str):
        targets = [targets]
    chosen: list[str] = []
    for target in targets:
        hits = groups.get(target) or [n for n in linears if n == target or n.endswith("." + target)]
        if not hits:
            raise ConfigError("model.lora.target_modules", f"'{target}' matches no linear layer of π0 (use all-linear, "
                                                           "expert, vlm or a name such as q_proj)")
        chosen.extend(hits)
    if train_expert and set(chosen) & set(expert):
        raise lora_on_expert(settings.target_modules)
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=sorted(set(chosen)), bias="none")
    on_meta = network.action_out_proj.weight.is_meta
    return peft.get_peft_model(network, config, low_cpu_mem_usage=on_meta)


def _image_count(model: Pi0ModelConfig, env_spec) -> int:
    cameras = len(env_spec.camera_names) if env_spec is not None else 0
    if model.num_images_in_input is not None:
        if env_spec is not None and model.num_images_in_input > cameras:
            raise ConfigError("model.num_images_in_input", f"is {model.num_images_in_input} but env "
                                                           f"'{env_spec.name}' has {cameras} camera(s)")
        return int(model.num_images_in_input)
    if cameras == 0:
        raise ConfigError("model.name", f"π0 needs camera images but env '{getattr(env_spec, 'name', '?')}' has none; "
                                        "use a pixel env (e.g. maniskill_pushcube_rgb, libero_*, toy_reach)")
    return cameras


def _read_config(path: str | Path) -> tuple[Path, dict]:
    """``(folder, config.json parsed)``: one :class:`ConfigError` sentence naming the file when it is absent or not a
    JSON object."""
    folder = Path(path).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError("model.path", f"{folder} has no config.json; give a transformers- or LeRobot-layout π0 "
                                        "checkpoint folder")
    try:
        data = json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError("model.path", f"{config} is not JSON ({str(exc).splitlines()[0]}); write it again") from None
    if not isinstance(data, dict):
        raise ConfigError("model.path", f"{config} is not a JSON object; write it again")
    return folder, data


def _check_tokenizer(folder: Path, vocab_size: int, name: str | None = None) -> None:
    """A checkpoint with PaliGemma's vocabulary reads its prompts in PaliGemma's token ids, which only PaliGemma's
    tokenizer gives: one :class:`ConfigError` sentence when its files are not in the folder (the hashing tokenizer
    would hand the trained network arbitrary ids). Smaller vocabularies (``pi0_tiny``'s) hash their words."""
    if vocab_size < PALIGEMMA_VOCAB or any((folder / f).is_file() for f in TOKENIZER_FILES):
        return
    source = name or "google/paligemma-3b-pt-224"
    raise ConfigError("model.path", f"{folder} holds a π0 with PaliGemma's {vocab_size}-token vocabulary but no "
                                    f"tokenizer: copy the tokenizer files of {source} (tokenizer.json or "
                                    "tokenizer.model, with tokenizer_config.json and special_tokens_map.json) into it")


def check_checkpoint(path: str | Path) -> str:
    """A π0 folder, read without building anything: transformers' layout (``config.json`` says ``model_type`` pi0,
    every weight file's header reads, the statistics file parses) or LeRobot's (:mod:`.lerobot`). One
    :class:`ConfigError` sentence naming the file otherwise; else a one-line description (``embodirl doctor``)."""
    from safetensors import safe_open

    folder, data = _read_config(path)
    config = folder / "config.json"
    if lerobot.is_lerobot_config(data):
        checkpoint = lerobot.read(folder, data)
        if checkpoint.variants[0] in lerobot.GEMMA_VARIANTS:       # a VLM of LeRobot's: PaliGemma's vocabulary
            _check_tokenizer(folder, lerobot.LEROBOT_VOCAB, checkpoint.tokenizer_name)
        return checkpoint.describe()
    if data.get("model_type") != "pi0":
        raise ConfigError("model.path", f"{config} describes a '{data.get('model_type')}' model; π0 checkpoints say "
                                        "model_type pi0 (use the model option of that checkpoint)")
    weights = sorted(p for p in folder.glob("*.safetensors") if p.name != HEADS_FILE)
    if not weights:
        raise ConfigError("model.path", f"{folder} holds no *.safetensors weights; export the checkpoint again")
    for file in [*weights, *([folder / HEADS_FILE] if (folder / HEADS_FILE).is_file() else [])]:
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as exc:   # safetensors raises its own error types for a bad header
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError("model.path", f"{file} is not a safetensors file ({reason}); write it again") from None
    text_config = (data.get("vlm_config") or {}).get("text_config") or {}
    _check_tokenizer(folder, int(text_config.get("vocab_size", PALIGEMMA_VOCAB)))
    statistics = "no statistics (identity)"
    if (folder / PROCESSOR_FILE).is_file():
        try:
            found = [k for k in STAT_KEYS if k in json.loads((folder / PROCESSOR_FILE).read_text())]
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError("model.path", f"{folder / PROCESSOR_FILE} is not JSON ({str(exc).splitlines()[0]}); "
                                            "write it again") from None
        statistics = f"statistics ({', '.join(found) or 'none'})"
    heads = "value/noise heads" if (folder / HEADS_FILE).is_file() else "no trained heads"
    return (f"{folder.name}: π0, {len(weights)} weight file(s), chunk {data.get('chunk_size')} x "
            f"{data.get('max_action_dim')}, {statistics}, {heads}")


def _from_pretrained(folder: Path, dtype: torch.dtype, device, *,
                     fix: str = "use the checkpoint's own files", **kwargs):
    """``PI0ForConditionalGeneration.from_pretrained`` (:data:`.openpi.FP32_PARAMETERS` loaded in float32,
    :func:`.openpi.fp32_on_load`) that lets no weight go missing, stay unused or change shape (transformers would
    initialise it at random and go on): one :class:`ConfigError` sentence ending in ``fix`` instead."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()          # one bar per load in every worker's log otherwise
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()           # its load report is many lines; the sentence below says what matters
    try:
        with fp32_on_load():
            network, info = PI0ForConditionalGeneration.from_pretrained(
                str(folder), dtype=dtype, device_map=str(device), output_loading_info=True,
                ignore_mismatched_sizes=True, **kwargs)
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError("model.path", f"{folder} is not a loadable π0 checkpoint ({first})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    problems = [(what, sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(key) or ()))
                for what, key in (("missing", "missing_keys"), ("unused", "unexpected_keys"),
                                  ("of another shape", "mismatched_keys"))]
    problems = [(what, keys) for what, keys in problems if keys]
    if problems:
        told = ", ".join(f"{len(keys)} {what} (e.g. {keys[0]})" for what, keys in problems)
        raise ConfigError("model.path", f"{folder}'s weights do not fit the network its config describes: {told}; "
                                        f"{fix}")
    return network


def load_checkpoint(path: str | Path, dtype: torch.dtype, device, model: Pi0ModelConfig):
    """``(network, statistics, tokenizer or None, heads)`` from a transformers- or LeRobot-layout π0 folder (a LeRobot
    network of variants LeRobot does not define takes ``model``'s sizes, see :func:`.lerobot.network_config`)."""
    folder, data = _read_config(path)
    if lerobot.is_lerobot_config(data):
        checkpoint = lerobot.read(folder, data)
        config = lerobot.network_config(checkpoint, model)
        network = _from_pretrained(folder, dtype, device, fix=lerobot.size_fix(checkpoint), config=config,
                                   attn_implementation=model.attn_implementation)
        statistics = checkpoint.statistics or None
        if config.num_inference_steps != model.flow.num_steps:
            log.info("%s was sampled with %d denoising steps; model.flow.num_steps = %d runs here", folder,
                     config.num_inference_steps, model.flow.num_steps)
        tokenizer_name = checkpoint.tokenizer_name
    else:
        network = _from_pretrained(folder, dtype, device)
        statistics = None
        if (folder / PROCESSOR_FILE).is_file():
            statistics = {k: v for k, v in json.loads((folder / PROCESSOR_FILE).read_text()).items() if k in STAT_KEYS}
        tokenizer_name = None
    _check_tokenizer(folder, int(network.config.vlm_config.text_config.vocab_size), tokenizer_name)
    tokenizer = None
    if any((folder / f).is_file() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    heads = None
    if (folder / HEADS_FILE).is_file():
        from safetensors.torch import load_file

        heads = load_file(str(folder / HEADS_FILE))
    return network, statistics, tokenizer, heads


def build_policy(model_cfg, env_spec=None, *, device: torch.device | str | None = None) -> Pi0Policy:
    """The policy ``model`` describes: random init (``path: null``, the sizes below) or a checkpoint (its own sizes).
    Trainable: the heads, the action expert with ``model.train_expert``, the adapters with ``model.lora``."""
    from embodirl.config_fields import instance
    from embodirl.dtypes import parse_dtype
    from embodirl.models.base import default_dtype

    model = instance(Pi0ModelConfig, model_cfg, "model")
    device = torch.device(device or model.device or "cpu")
    dtype = parse_dtype(model.dtype)
    action_dim = int(env_spec.action_dim) if env_spec is not None else model.max_action_dim
    heads = statistics = tokenizer = None
    if model.path:
        if device.type == "meta":
            raise ConfigError("model.device", "a checkpoint cannot be loaded onto the meta device")
        network, statistics, tokenizer, heads = load_checkpoint(model.path, dtype, device, model)
    else:
        config = network_config(model)
        config._attn_implementation = model.attn_implementation
        with torch.device(device), default_dtype(dtype):
            network = PI0ForConditionalGeneration(config)
        # every tensor on the build device, non-persistent buffers included: in one clean-clone suite run the time
        # embedding's sinusoid_freq buffer came out on the CPU in a model built on meta (not reproduced alone)
        network.to(device)
    keep_fp32_(network)
    network.requires_grad_(False)
    if action_dim > network.config.max_action_dim:
        raise ConfigError("model.max_action_dim", f"is {network.config.max_action_dim} but env has {action_dim}-D actions")
    if model.action_chunk > network.config.chunk_size:
        raise ConfigError("model.action_chunk", f"is {model.action_chunk} but the network predicts "
                                                f"{network.config.chunk_size} actions per decision (model.chunk_size)")
    if env_spec is not None and env_spec.state_dim > network.config.max_state_dim:
        raise ConfigError("model.max_state_dim", f"is {network.config.max_state_dim} but env '{env_spec.name}' has a "
                                                 f"{env_spec.state_dim}-D state")
    with default_dtype(dtype):
        policy = Pi0Policy(model, network, action_dim=action_dim, num_images=_image_count(model, env_spec),
                           statistics=statistics, tokenizer=tokenizer,
                           task_descriptions=env_spec.task_descriptions if env_spec is not None else None,
                           action_low=env_spec.action_low if env_spec is not None else -1.0,
                           action_high=env_spec.action_high if env_spec is not None else 1.0)
    if heads:
        for name in ("value_head", "noise_head"):
            head = getattr(policy, name)
            part = {k[len(name) + 1:]: v for k, v in heads.items() if k.startswith(name + ".")}
            if head is None or not part:
                continue
            own = head.state_dict()
            if {k: tuple(v.shape) for k, v in part.items()} != {k: tuple(v.shape) for k, v in own.items()}:
                # a head of other settings (e.g. written before the value head read the expert): it starts fresh
                log.warning("%s: the checkpoint's %s has other shapes than model.%s makes; it starts fresh",
                            model.path, name, "value_head" if name == "value_head" else "flow")
                continue
            head.load_state_dict(part)
    for head in (policy.value_head, policy.noise_head):
        if head is not None:
            head.requires_grad_(True)
    if model.train_expert:
        for _, param in expert_parameters(policy.network):
            param.requires_grad_(True)
    return policy

