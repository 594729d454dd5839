"""The key/value cache between π0's VLM (the prefix: images and prompt) and its action expert, safe under autograd.

transformers' ``sample_actions`` keeps the prefix in one ``DynamicCache``: each expert pass appends the chunk's keys and
values to it and crops them off again. That is fine without gradients, but a training pass breaks it two ways:
gradient checkpointing recomputes a VLM layer in the backward pass, which would append the prefix to itself a second
time, and recomputes an expert layer after the cache has moved on. Here the two sides get two caches:

* :class:`PrefixCache` - what the VLM writes. A second write of a layer (its recomputation) replaces the first.
* :class:`ExpertCache` - what one expert pass reads: each layer returns the prefix followed by the chunk's own keys and
  values and keeps nothing, so every pass and every recomputation sees exactly the prefix.

Both are ``transformers.cache_utils.Cache`` objects, so the library's attention, masks and position logic run
unchanged (the same tensors in the same order as ``sample_actions``: the greedy chain stays bit for bit the library's).
"""

from __future__ import annotations

from typing import cast

import torch
from transformers.cache_utils import Cache, DynamicLayer


class PrefixLayer(DynamicLayer):
    """One VLM layer's keys and values; writing again replaces them (a recomputation writes the same prefix)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return self.keys, self.values


class PrefixCache(Cache):
    def __init__(self):
        super().__init__(layer_class_to_replicate=PrefixLayer)


class ExpertLayer(DynamicLayer):
    """Reads through to one prefix layer: returns prefix + new keys/values and stores nothing."""

    def __init__(self, prefix: PrefixLayer):
        super().__init__()
        self.prefix = prefix
        self.dtype, self.device = prefix.dtype, prefix.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        prefix_keys, prefix_values = self.prefix.keys, self.prefix.values
        assert prefix_keys is not None and prefix_values is not None      # the VLM's pass wrote them
        return (torch.cat([prefix_keys, key_states], dim=-2),
                torch.cat([prefix_values, value_states], dim=-2))

    def get_seq_length(self) -> int:
        return self.prefix.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.prefix.get_seq_length() + query_length, 0


class ExpertCache(Cache):
    def __init__(self, prefix: PrefixCache):
        # a PrefixCache's layers are all PrefixLayers (its layer_class_to_replicate); Cache types them as any layer
        super().__init__(layers=[ExpertLayer(cast(PrefixLayer, layer)) for layer in prefix.layers])
