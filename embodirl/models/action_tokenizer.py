"""Discrete action tokens of OpenVLA / OpenVLA-OFT: normalised actions in [-1, 1] <-> Llama-2 vocabulary ids.

OpenVLA (Kim et al. 2024, sec. 3.2) discretises every action dimension with ``num_bins`` uniformly
spaced *edges* over [-1, 1] and writes the bin index ``d`` (``numpy.digitize`` semantics, 1..num_bins)
as the token id ``base_vocab_size - d``. The action ids are therefore the last ``num_bins`` ids of the
32000-token Llama-2 base vocabulary (31744..31999 for 256 bins; the 64 padding ids that follow are
never actions). Decoding maps an id back to the centre of its bin; there are ``num_bins - 1`` centres,
so the id reached only by an action of exactly +1.0 (``d = num_bins``) shares the last centre with its
neighbour. Public OpenVLA-OFT checkpoints were trained with exactly this scheme, so it is reproduced
bit for bit rather than "fixed".

Besides the token id, policies work with the *action index* ``k = id - first_id`` in ``[0, num_bins)``:
the position of an id inside the restricted ``num_bins``-way softmax used for sampling.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

#: Llama-2's vocabulary before OpenVLA's padding to a multiple of 64 (32000 -> 32064 rows).
LLAMA_BASE_VOCAB_SIZE = 32000
#: OpenVLA's default number of action bins (``n_action_bins`` in the checkpoint config).
DEFAULT_NUM_BINS = 256
#: Actions are normalised to this interval before tokenisation.
ACTION_LOW, ACTION_HIGH = -1.0, 1.0


class ActionTokenizer(nn.Module):
    """Uniform-bin tokenizer over [-1, 1] mapped onto the last ``num_bins`` base-vocabulary ids.

    Shapes are arbitrary: every method is elementwise over ``(...,)``. The bin edges and centres are
    (non-persistent) buffers created on ``device`` (default: torch's current default device, so a network
    built under ``torch.device(...)`` gets them there) and moved with the network's ``.to()``.
    """

    edges: torch.Tensor
    centers: torch.Tensor

    def __init__(self, num_bins: int = DEFAULT_NUM_BINS, base_vocab_size: int = LLAMA_BASE_VOCAB_SIZE, *,
                 device: torch.device | str | None = None):
        super().__init__()
        if not 2 <= num_bins <= base_vocab_size:
            raise ValueError(f"num_bins must lie in [2, {base_vocab_size}], got {num_bins}")
        self.num_bins = num_bins
        self.base_vocab_size = base_vocab_size
        #: first (smallest) action token id; the action ids are ``[first_id, end_id)``
        self.first_id = base_vocab_size - num_bins
        self.end_id = base_vocab_size
        # numpy's float64 linspace, bit for bit the edges OpenVLA trained with (torch.linspace differs in
        # the last ulp for some edges, which moves actions that sit exactly on an edge)
        edges = np.linspace(ACTION_LOW, ACTION_HIGH, num_bins)
        self.register_buffer("edges", torch.tensor(edges, dtype=torch.float64, device=device),
                             persistent=False)  # (num_bins,)
        self.register_buffer("centers", torch.tensor((edges[:-1] + edges[1:]) / 2.0, dtype=torch.float64,
                                                     device=device), persistent=False)  # (num_bins - 1,)

    # --- actions <-> token ids -----------------------------------------------------------------
    def encode(self, actions: torch.Tensor) -> torch.Tensor:
        """Normalised actions (any float shape) -> int64 token ids of the same shape. Values outside
        [-1, 1] are clipped first, as OpenVLA does."""
        clipped = actions.detach().to(torch.float64).clamp(ACTION_LOW, ACTION_HIGH)
        # right=True reproduces numpy.digitize: edges[d-1] <= x < edges[d]; x == +1 gives num_bins
        digit = torch.bucketize(clipped, self.edges.to(clipped.device), right=True)  # (...,) in 1..num_bins
        return (self.base_vocab_size - digit).to(torch.int64)

    def decode(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> float32 bin centres in [-1, 1] (ids outside the action range are clamped to
        the nearest bin, as OpenVLA's decoder does)."""
        index = (self.base_vocab_size - token_ids.to(torch.int64) - 1).clamp(0, self.num_bins - 2)
        return self.centers.to(token_ids.device)[index].to(torch.float32)

    # --- token ids <-> index inside the restricted softmax ---------------------------------------
    def ids_to_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[first_id, end_id)`` -> action index ``[0, num_bins)`` (int64)."""
        return token_ids.to(torch.int64) - self.first_id

    def index_to_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Action index ``[0, num_bins)`` -> token ids (int64)."""
        return index.to(torch.int64) + self.first_id

    def is_action_id(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Bool mask of the ids that are action tokens."""
        return (token_ids >= self.first_id) & (token_ids < self.end_id)

    def bin_width(self) -> float:
        return (ACTION_HIGH - ACTION_LOW) / (self.num_bins - 1)
