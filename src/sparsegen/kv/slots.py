"""The typed hand-over between a policy cache layer and the fast path's fixed-shape slots."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv import ragged
from sparsegen.kv.cache import PolicyLayer
from sparsegen.kv.policy import Policy, Sizes
from sparsegen.kv.rope import KeyRotation
from sparsegen.kv.store import EMPTY, RING, TOKENS, SlotStore, store_view


@dataclass
class HeldSlots:
    """A cache layer's tokens as the fast path takes them over and hands them back (`decode.state`).

    The `store` holds keys, values [b, h, n, d], positions [b, h, n] (`EMPTY` where a slot is free)
    and scores; with a codec, its byte rows and the ring of the newest tokens; with `head_of`, the
    heads of a head-adaptive layer held flat (`kv.ragged`). How the layer goes on: its policy, its
    resolved sizes, whether it still evicts while decoding, the rotation of rolling positions, and
    the model's RoPE frequencies and the layer's index (for a policy that reasons about queries).
    """

    store: SlotStore
    policy: Policy
    sizes: Sizes
    evicting: bool
    rotation: KeyRotation | None = None
    rope: KeyRotation | None = None
    layer: int = 0

    keys, values, positions, scores = (store_view(n) for n in TOKENS)
    codec, head_of, recent_keys, recent_values = (store_view(n) for n in ("codec", "head_of", *RING))

    @property
    def kv_heads(self) -> int:
        return self.store.heads

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-slot tensors but the head tags, by name."""
        return {name: getattr(self.store, name) for name in TOKENS}

    def flat(self) -> HeldSlots:
        """These slots with their heads held flat (`kv.ragged.pack` of the live slots; every row
        holds as many as the others)."""
        if self.head_of is not None:
            return self
        live = self.positions >= 0
        return replace(self, store=replace(self.store, **ragged.pack(self.tensors(), live), kv_heads=live.shape[1]))

    def per_head(self) -> HeldSlots:
        """These slots per head [b, h, W, ...], W the largest head's count, the rest free: the
        layout of rows that share a step with rows of other policies or a shared context."""
        if self.head_of is None:
            return self
        fills = {"keys": 0.0, "values": 0.0, "positions": EMPTY, "scores": 0.0}
        unpacked = ragged.unpack(self.tensors(), self.head_of, self.kv_heads, fills)
        return replace(self, store=replace(self.store, **unpacked, head_of=None))


def slots_of_layer(layer: PolicyLayer) -> HeldSlots:
    """What a policy layer holds, as slots (heads of different counts held flat)."""
    store = SlotStore(**layer.hand_over(), codec=layer.codec, **layer.store.ring(), kv_heads=layer.kv_heads)
    evicting = layer.sizes is not None and not layer.compressed
    sizes = layer.sizes or Sizes()
    return HeldSlots(store, layer.policy, sizes, evicting, layer.rotation, layer.rope, layer.layer_idx or 0)


def take_slots(layer: PolicyLayer, slots: HeldSlots, seen: int, dtype: torch.dtype) -> None:
    """Let a fresh policy `layer` hold one row's `slots` after `seen` tokens (a conversation the
    fast path hands back), read back in `dtype` (`PolicyLayer.take_over`)."""
    if slots.codec != layer.codec:
        raise SparsegenError(f"slots held in {slots.codec} cannot continue in a cache of {layer.codec}")
    bounded = bool(layer.policy.budget_parts())
    ring = (slots.recent_keys, slots.recent_values)
    sizes, compressed = (slots.sizes if bounded else None), bounded and not slots.evicting
    layer.take_over(slots.store.tensors(), seen, dtype, slots.kv_heads, sizes, compressed, ring)
