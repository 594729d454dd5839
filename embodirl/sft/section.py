"""The ``sft`` and ``data`` sections of ``embodirl sft``'s config (``config/sft.yaml``) as the typed objects the SFT
code runs on: each key's type and range declared once here (:mod:`embodirl.config_fields`), its value in the YAML.
:func:`embodirl.sft.compose.check` converts them once, checked in one sentence naming the key, and the rules between
them and the rest of the config read these attributes."""

from __future__ import annotations

from dataclasses import dataclass

from embodirl.config_fields import num, required


@dataclass
class Sft:
    batch_size: int = num(1)
    micro_batch_size: int | None = num(1, null=True)
    token_loss: bool = required()
    l1_head: bool = required()
    stop_token: bool | None = required()

    def actor_options(self, tokens: bool) -> dict:
        """These keys as :meth:`~embodirl.actor.actor.Actor.sft_update` takes them; ``stop_token`` null is true for a
        family that trains action tokens (``tokens``: OpenVLA-OFT) and false for one that trains a flow-matching loss
        (π0)."""
        return {"micro_batch_size": self.micro_batch_size or self.batch_size, "token_loss": self.token_loss,
                "stop_token": tokens if self.stop_token is None else self.stop_token,
                "l1_head": self.l1_head}


@dataclass
class Data:
    path: str | None = required()


@dataclass
class SftSections:
    """What ``embodirl sft`` adds to ``embodirl train``'s config."""

    sft: Sft
    data: Data
