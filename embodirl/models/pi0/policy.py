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
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from embodirl import data as D
from embodirl.errors import ConfigError
from embodirl.models.base import Policy, SamplingParams
from embodirl.models.lora_merge import AdapterMerger
from embodirl.models.pi0 import flow
from embodirl.models.pi0.cache import ExpertCache, PrefixCache
from embodirl.models.pi0.checkpoint import processor_statistics, save_checkpoint, statistics_tensors
from embodirl.models.pi0.heads import NoiseHead, ValueHead
from embodirl.models.pi0.lora import apply_lora, merged_state_dict
from embodirl.models.pi0.openpi import clean_prompt, resize_with_pad
from embodirl.models.pi0.schema import Pi0ModelConfig
from embodirl.models.processor import HashWordTokenizer

INSTRUCTION = "instruction"
LOGPROB, ENTROPY = "logprob", "entropy"
#: PI0Processor's guard against a zero standard deviation
STD_EPS = 1e-8
#: mixed with a greedy decision's observation into the seed of its chain start (:meth:`Pi0Policy._greedy_start`)
EVAL_NOISE_SEED = 0
#: Gemma's tokenizer: BOS and the newline that ends π0's prompt
GEMMA_BOS_ID, GEMMA_NEWLINE_ID = 2, 108
#: ids the hashing tokenizer uses for a model without a tokenizer (above Gemma's special ids)
HASH_ID_LOW = 256
#: compiled variants dynamo may keep per transformer block (:meth:`Pi0Policy.compile_blocks_`): its layer, the cache
#: kind (the VLM's prefix, the expert's read-through), a batch size, its dynamic-shape generalisation
COMPILE_VARIANTS_PER_BLOCK = 4
#: activation bytes per token, layer and hidden unit of the action expert's training pass with the VLM frozen, without
#: and with gradient checkpointing (:meth:`Pi0Policy.activation_profile`). The full-size dry run (LIBERO's two cameras,
#: 48 decisions per micro-batch) measures 119 (Flow-SDE) and 129 (Flow-Noise) without it. With it the peak is the
#: frozen prefix pass's transient (~2.4 GiB for both methods), which a per-token constant follows only roughly: 200
#: puts both within 10 %
EXPERT_ACT_BYTES, EXPERT_RECOMPUTED_BYTES = 115, 200


class Pi0Policy(Policy):
    """See module docstring. Build with :func:`.build.build_policy`."""

    action_field = D.ACTION_CHAIN
    # buffers (register_buffer): the standardisation statistics and the action bounds
    state_mean: torch.Tensor
    state_std: torch.Tensor
    actions_mean: torch.Tensor
    actions_std: torch.Tensor
    action_low: torch.Tensor
    action_high: torch.Tensor

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
        self.statistics: Mapping[str, Sequence[float]] | None = dict(statistics) if statistics else None
        stats = statistics_tensors(self.statistics, self.max_state_dim, self.max_action_dim, device)
        for name, tensor in stats.items():
            self.register_buffer(name, tensor, persistent=False)
        bound_low = torch.as_tensor(action_low, dtype=torch.float32, device=device).expand(self.action_dim)
        bound_high = torch.as_tensor(action_high, dtype=torch.float32, device=device).expand(self.action_dim)
        self.register_buffer("action_low", bound_low.clone(), persistent=False)
        self.register_buffer("action_high", bound_high.clone(), persistent=False)
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

    def set_statistics(self, statistics: Mapping) -> None:
        """Standardise state and actions with ``statistics`` from now on (:func:`.checkpoint.processor_statistics`'s
        layouts), and write them with :meth:`save_pretrained`."""
        self.statistics = processor_statistics(statistics)
        for name, tensor in statistics_tensors(self.statistics, self.max_state_dim, self.max_action_dim,
                                               self.device).items():
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
    def _prefix(self, inputs: Mapping) -> tuple[PrefixCache, torch.Tensor]:
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
        assert self.value_head is not None          # the callers ask for a value only when there is a head
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

    def _sde_step(self, x: torch.Tensor, velocity: torch.Tensor, steps: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
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
            # every row's drawn step is one of the K >= 1 (model.flow.num_steps), so all three are set
            assert x_before is not None and x_after is not None and logprob is not None
            chain = torch.cat([drawn.to(self.device, torch.float32)[:, None], x_before.reshape(B, -1),
                               x_after.reshape(B, -1)], dim=1)
        else:
            # every step stochastic; with joint_logprob the prior's log N(x_0; 0, I) is one more term of the mean
            states = [x]
            logprob = flow.standard_normal_logprob(x) if self.joint_logprob else torch.zeros_like(x)
            assert self.noise_head is not None          # Flow-Noise builds it
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
            # the expert's value is set at the steps above whenever it is wanted (K >= 1)
            out[D.VALUE] = value if value is not None else self._prefix_value(prefix_hidden, inputs["attention_mask"])
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
        logprob: torch.Tensor | float
        entropy: torch.Tensor | float
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
            assert self.noise_head is not None          # Flow-Noise builds it
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
            assert isinstance(logprob, torch.Tensor) and isinstance(entropy, torch.Tensor)   # K >= 1 terms added
            logprob, entropy = logprob / terms, entropy / terms
            value = value / K if value is not None else None
        result = {LOGPROB: self._executed(logprob)}
        if return_entropy:
            result[ENTROPY] = self._executed(entropy)
        if return_value and self.value_head is not None:
            # the expert's value is set above whenever it is wanted (K >= 1)
            result[D.VALUE] = value if value is not None else self._prefix_value(prefix_hidden, inputs["attention_mask"])
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
        return merged_state_dict(self.network)

    def save_pretrained(self, directory, *, step: int = 0, marker: Mapping | None = None) -> Path:
        """A transformers ``PI0ForConditionalGeneration`` folder (``from_pretrained`` reads it back, adapters folded
        in), the statistics in ``processor_config.json``, and the value and noise heads in ``embodirl_heads.safetensors``
        (:func:`.checkpoint.save_checkpoint`)."""
        processor = {**(self.statistics or {}), "max_state_dim": self.max_state_dim, "chunk_size": self.chunk_size}
        return save_checkpoint(directory, self.network, processor,
                               {"value_head": self.value_head, "noise_head": self.noise_head}, self.tokenizer,
                               step=step, marker=marker)
