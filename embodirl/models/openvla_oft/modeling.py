"""OpenVLA-OFT's network: vision -> projector -> Llama-2 decoding a whole action chunk in one bidirectional pass.

Sequence fed to the decoder (OFT's ``predict_action``; ``P`` patches per image, ``V`` images, ``M``
prompt tokens after BOS, ``L = H * A`` action slots)::

    index  0     1 .. V*P     [+1]      next M           next L                     last
           BOS | patches   | proprio | prompt ... "▁" | L empty action slots   | </s>
                                        (left-padded)   (embeddings are zeros)

* every token attends to every other non-pad token (bidirectional attention, OFT sec. 3 "parallel
  decoding"; openvla-oft's transformers fork disables the causal mask for the whole sequence);
* action slots carry zero embeddings, so their only content is their position (RoPE);
* the logits of action token ``k`` are read at position ``first_slot - 1 + k``: one position early,
  as in next-token alignment, so the first action is read at the prompt's last token "▁";
* ``</s>`` after the slots is part of the sequence because OFT trained with it and, attention being
  bidirectional, it changes every position's output;
* padding sits between the prompt's BOS/patches and its text; positions are ``cumsum(mask) - 1`` and
  pads are masked as keys, so a padded sample's outputs equal its unpadded outputs.

Only the ``num_bins`` action rows of the LM head are evaluated (the logits of other ids are never
used), unless the LM head carries a LoRA adapter, in which case the full head runs on the L read
positions and the action ids are sliced out.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from embodirl.models.action_tokenizer import ActionTokenizer
from embodirl.models.base import default_dtype
from embodirl.models.openvla_oft.projector import (
    FusedMLPProjector,
    L1RegressionActionHead,
    ProprioProjector,
    ValueHead,
)
from embodirl.models.openvla_oft.resolve import OFTConfig
from embodirl.models.openvla_oft.vision import FusedVisionBackbone
from embodirl.models.processor import LLAMA_BOS_ID, LLAMA_STOP_ID

#: tokens after the action slots (``</s>``)
NUM_SUFFIX_TOKENS = 1


@dataclass
class OFTOutput:
    """One parallel-decoding pass.

    ``action_logits`` float32 ``[B, L, num_bins]`` (action ids only, untempered), ``action_hidden``
    ``[B, L, D]`` final hidden states at the read positions, ``prompt_hidden`` ``[B, D]`` (the prompt's
    last token, the value head's input), ``stop_hidden`` ``[B, D]`` at the last action slot (where
    ``</s>`` is read: the stop-token label of OFT's fine-tuning).
    """

    action_logits: torch.Tensor
    action_hidden: torch.Tensor
    prompt_hidden: torch.Tensor
    stop_hidden: torch.Tensor | None = None


@dataclass
class SequenceInputs:
    """Decoder inputs: ``embeds`` ``[B, T, D]``, ``mask`` bool ``[B, T]`` (False on pads), ``position_ids``
    int64 ``[B, T]``."""

    embeds: torch.Tensor
    mask: torch.Tensor
    position_ids: torch.Tensor


class OpenVLAOFT(nn.Module):
    """The OFT network (see module docstring). Inputs are already processed: ``pixel_values`` float
    ``[B, V*6, S, S]``, ``prompt_ids``/``prompt_mask`` ``[B, M]`` (no BOS), ``proprio`` normalised float
    ``[B, S_p]`` or None."""

    def __init__(self, cfg: OFTConfig):
        super().__init__()
        from transformers import LlamaForCausalLM

        self.cfg = cfg
        self.vision = FusedVisionBackbone(cfg)
        self.projector = FusedMLPProjector(cfg.vision_dim, cfg.llm_dim)
        self.language_model = LlamaForCausalLM(cfg.llama_config())
        for layer in self.language_model.model.layers:
            # sdpa/flash read the module flag when no mask is materialised (no padding)
            layer.self_attn.is_causal = False
        self.proprio_projector = ProprioProjector(cfg.proprio_dim, cfg.llm_dim) if cfg.use_proprio else None
        self.action_head = (L1RegressionActionHead(cfg.llm_dim, cfg.action_dim, cfg.model.action_chunk)
                            if cfg.use_l1_regression else None)
        value_out = 1 if cfg.model.value_type == "chunk_level" else cfg.model.action_chunk
        self.value_head = ValueHead(cfg.llm_dim, cfg.model.value_head.hidden_sizes, value_out)
        self.action_tokenizer = ActionTokenizer(cfg.model.num_bins)
        if cfg.model.gradient_checkpointing:
            for model in (self.language_model, self.vision.dino, self.vision.siglip):
                model.activation_checkpointing_enable({"use_reentrant": False})

    # --- sizes -----------------------------------------------------------------------------------
    @property
    def num_prefix_tokens(self) -> int:
        """BOS + patches (+ proprio token): the tokens before the prompt text."""
        return 1 + self.cfg.num_images_in_input * self.cfg.patches_per_image + int(self.cfg.use_proprio)

    @property
    def dtype(self) -> torch.dtype:
        return self.projector.fc1.weight.dtype

    # --- sequence construction ---------------------------------------------------------------------
    def embed_prefix(self, pixel_values: torch.Tensor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                     proprio: torch.Tensor | None = None) -> SequenceInputs:
        """BOS, patches, proprio and prompt: everything before the action slots (``T0`` tokens)."""
        B = prompt_ids.shape[0]
        embed = self.language_model.get_input_embeddings()
        device = prompt_ids.device
        bos = embed(torch.full((B, 1), LLAMA_BOS_ID, dtype=torch.int64, device=device))  # (B, 1, D)
        patches = self.projector(self.vision(pixel_values.to(self.dtype))).to(bos.dtype)  # (B, V*P, D)
        parts = [bos, patches]
        if self.proprio_projector is not None:
            if proprio is None:
                raise ValueError("this model uses a proprio token: pass the (normalised) state")
            parts.append(self.proprio_projector(proprio).to(bos.dtype).unsqueeze(1))      # (B, 1, D)
        parts.append(embed(prompt_ids))                                                  # (B, M, D)
        embeds = torch.cat(parts, dim=1)                                                 # (B, T0, D)
        prefix_len = embeds.shape[1] - prompt_ids.shape[1]
        mask = torch.cat([torch.ones(B, prefix_len, dtype=torch.bool, device=device),
                          prompt_mask.to(torch.bool)], dim=1)                            # (B, T0)
        return SequenceInputs(embeds, mask, positions_from_mask(mask))

    def build_sequence(self, pixel_values: torch.Tensor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                       proprio: torch.Tensor | None = None) -> SequenceInputs:
        """The full parallel-decoding sequence: prefix, L zero-embedding slots, ``</s>``."""
        prefix = self.embed_prefix(pixel_values, prompt_ids, prompt_mask, proprio)
        B, _, D = prefix.embeds.shape
        L = self.cfg.tokens_per_decision
        device = prefix.embeds.device
        slots = torch.zeros(B, L, D, dtype=prefix.embeds.dtype, device=device)       # (B, L, D)
        stop = self.language_model.get_input_embeddings()(
            torch.full((B, NUM_SUFFIX_TOKENS), LLAMA_STOP_ID, dtype=torch.int64, device=device))  # (B, 1, D)
        embeds = torch.cat([prefix.embeds, slots, stop], dim=1)                        # (B, T, D)
        mask = torch.cat([prefix.mask, torch.ones(B, L + NUM_SUFFIX_TOKENS, dtype=torch.bool, device=device)], 1)
        return SequenceInputs(embeds, mask, positions_from_mask(mask))

    # --- decoder ---------------------------------------------------------------------------------
    def decoder_hidden(self, seq: SequenceInputs, attention_mask: torch.Tensor | None = None,
                       past_key_values=None) -> torch.Tensor:
        """Final (normed) decoder hidden states ``[B, T, D]``. ``attention_mask`` overrides the
        bidirectional padding mask built from ``seq.mask`` (a 4-D mask, e.g. causal, for the
        autoregressive baseline)."""
        out = self.language_model.model(
            inputs_embeds=seq.embeds, attention_mask=seq.mask if attention_mask is None else attention_mask,
            position_ids=seq.position_ids, past_key_values=past_key_values,
            use_cache=past_key_values is not None)
        return out.last_hidden_state

    def action_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., D)`` -> float32 logits over the action ids ``(..., num_bins)``."""
        tok = self.action_tokenizer
        head = self.language_model.lm_head
        ids = slice(tok.first_id, tok.end_id)
        if type(head) is nn.Linear:
            return _sliced_linear(hidden, head, ids).float()
        if _plain_lora_linear(head):
            # adapted head (peft LoRA): the base and each active adapter's B rows of the action ids only,
            # instead of the whole vocabulary's logits (the same numbers: tests/models/test_openvla_policy.py)
            logits = _sliced_linear(hidden, head.base_layer, ids)
            if not head.disable_adapters and not head.merged:
                for name in head.active_adapters:
                    if name not in head.lora_A:
                        continue
                    a, b = head.lora_A[name], head.lora_B[name]
                    x = head.lora_dropout[name](hidden.to(a.weight.dtype))
                    logits = logits + F.linear(a(x), b.weight[ids]).to(logits.dtype) * head.scaling[name]
            return logits.float()
        return head(hidden)[..., ids].float()  # any other wrapper: run it whole, then keep the action ids

    def greedy_action_ids(self, action_hidden: torch.Tensor) -> torch.Tensor:
        """OFT's greedy decoding (``_regression_or_discrete_prediction`` of openvla-oft's
        ``modeling_prismatic.py``; ``model.greedy_decoding=vocabulary``): the argmax over the *whole* vocabulary,
        not only the action ids, then ``clip(32000 - id - 1, 0, num_bins - 2)`` as the bin. A non-action winner
        thus becomes the nearest end bin; here it is clamped to the nearest action id, which decodes to that same
        bin and keeps the returned tokens inside the action vocabulary. ``(B, L, D)`` -> int64 ids ``(B, L)``."""
        tok = self.action_tokenizer
        ids = self.language_model.lm_head(action_hidden).argmax(dim=-1)  # (B, L) over all vocabulary ids
        return ids.clamp(tok.first_id, tok.end_id - 1)

    def forward(self, pixel_values: torch.Tensor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                proprio: torch.Tensor | None = None) -> OFTOutput:
        seq = self.build_sequence(pixel_values, prompt_ids, prompt_mask, proprio)
        hidden = self.decoder_hidden(seq)                         # (B, T, D)
        L = self.cfg.tokens_per_decision
        first_slot = hidden.shape[1] - NUM_SUFFIX_TOKENS - L
        read = hidden[:, first_slot - 1: first_slot - 1 + L]     # (B, L, D): one position early
        return OFTOutput(action_logits=self.action_logits(read), action_hidden=read, prompt_hidden=read[:, 0],
                         stop_hidden=hidden[:, first_slot - 1 + L])

    # --- heads -----------------------------------------------------------------------------------
    def values(self, prompt_hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[B]`` (chunk level) or ``[B, H]`` (action level)."""
        v = self.value_head(prompt_hidden).float()  # (B, 1) or (B, H)
        return v.squeeze(-1) if self.cfg.model.value_type == "chunk_level" else v

    def regress_actions(self, action_hidden: torch.Tensor) -> torch.Tensor:
        """L1 head: normalised actions float32 ``[B, H, A]`` (requires ``use_l1_regression``)."""
        if self.action_head is None:
            raise RuntimeError("this model has no L1 regression head (model.use_l1_regression is false)")
        return self.action_head(action_hidden).float()


def _sliced_linear(hidden: torch.Tensor, linear: nn.Linear, rows: slice) -> torch.Tensor:
    return F.linear(hidden, linear.weight[rows], None if linear.bias is None else linear.bias[rows])


def _plain_lora_linear(module: nn.Module) -> bool:
    """A peft LoRA ``Linear`` over an ``nn.Linear`` without DoRA or bias adapters (rows of its output
    can be computed on their own)."""
    from peft.tuners.lora import Linear as LoraLinear

    if type(module) is not LoraLinear or type(module.base_layer) is not nn.Linear:
        return False
    use_dora = getattr(module, "use_dora", {})
    lora_bias = getattr(module, "lora_bias", {})
    return not any(use_dora.get(n, False) or lora_bias.get(n, False) for n in module.active_adapters)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip pads: ``cumsum(mask) - 1`` (pads repeat their predecessor's id)."""
    return (mask.to(torch.int64).cumsum(dim=1) - 1).clamp(min=0)


def build_model(cfg: OFTConfig, device: torch.device | str = "cpu", *, init_weights: bool = True) -> OpenVLAOFT:
    """Construct the network on ``device`` directly in ``cfg.dtype`` (``"meta"``: no memory at all).

    ``init_weights=False`` skips the random initialisation of everything a checkpoint provides (the
    value head, which public checkpoints lack, is still initialised)."""
    skip: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if not init_weights:
        from transformers.initialization import no_init_weights

        skip = no_init_weights()
    with torch.device(device), default_dtype(cfg.dtype), skip:
        model = OpenVLAOFT(cfg)
    if not init_weights and torch.device(device).type != "meta":
        model.value_head.reset_parameters()
    if torch.device(device).type != "meta":
        with torch.no_grad():
            # timm's DINOv2 adds no position embedding to CLS: start that slot at zero, as a loaded tower has it
            # (a full fine-tune may train it; names.py folds it into cls_token when writing the public layout)
            model.vision.dino.embeddings.position_embeddings[:, 0].zero_()
    return model
