"""The typed hand-over between a policy cache layer and the fast path's fixed-shape slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsegen.kv.policy import Policy, Sizes
from sparsegen.kv.quantized import KVCodec
from sparsegen.kv.rope import KeyRotation

EMPTY = -1
"""The position of a free slot in `HeldSlots` (and the fast path's buffers)."""


@dataclass
class HeldSlots:
    """A cache layer's tokens as the fast path takes them over and hands them back (`decode.state`).

    keys, values [b, h, n, d]; positions [b, h, n], `EMPTY` where a slot is free; scores [b, h, n].
    How the layer goes on: its policy, its resolved sizes, whether it still evicts while decoding,
    and the rotation of rolling positions. With a `codec`, keys and values are its byte rows.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    policy: Policy
    sizes: Sizes
    evicting: bool
    rotation: KeyRotation | None = None
    codec: KVCodec | None = None


def room_for(budget: int) -> int:
    """Slots a layer that keeps every new token holds free beyond what it holds (a sixteenth, so
    its buffers stay within about 6% of its tokens' bytes; decoding past it grows them)."""
    return max(1, budget // 16)
