"""The typed hand-over between a policy cache layer and the fast path's fixed-shape slots."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv import ragged
from sparsegen.kv.cache import PolicyLayer
from sparsegen.kv.layer_slots import EMPTY
from sparsegen.kv.policy import Policy, Sizes
from sparsegen.kv.quantized import KVCodec
from sparsegen.kv.rope import KeyRotation


@dataclass
class HeldSlots:
    """A cache layer's tokens as the fast path takes them over and hands them back (`decode.state`).

    keys, values [b, h, n, d]; positions [b, h, n], `EMPTY` where a slot is free; scores [b, h, n].
    How the layer goes on: its policy, its resolved sizes, whether it still evicts while decoding,
    and the rotation of rolling positions. With a `codec`, keys and values are its byte rows and
    `recent_keys`, `recent_values` [b, h, RESIDUAL, d] the ring of the newest at full precision.
    With `head_of` [b, 1, n], the `kv_heads` heads of a head-adaptive layer are held flat
    (`kv.ragged`): keys, values [b, 1, n, d], positions, scores [b, 1, n], each slot's head tagged.
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
    recent_keys: torch.Tensor | None = None
    recent_values: torch.Tensor | None = None
    head_of: torch.Tensor | None = None
    kv_heads: int = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-slot tensors, by name."""
        return {"keys": self.keys, "values": self.values, "positions": self.positions, "scores": self.scores}

    def flat(self) -> HeldSlots:
        """These slots with their heads held flat (`kv.ragged.pack` of the live slots; every row
        holds as many as the others)."""
        if self.head_of is not None:
            return self
        live = self.positions >= 0
        return replace(self, **ragged.pack(self.tensors(), live), kv_heads=live.shape[1])

    def per_head(self) -> HeldSlots:
        """These slots per head [b, h, W, ...], W the largest head's count, the rest free: the
        layout of rows that share a step with rows of other policies or a shared context."""
        if self.head_of is None:
            return self
        fills = {"keys": 0.0, "values": 0.0, "positions": EMPTY, "scores": 0.0}
        return replace(self, **ragged.unpack(self.tensors(), self.head_of, self.kv_heads, fills), head_of=None)


def _storage(layer: PolicyLayer) -> dict:
    """How a layer's slots are read: rolled, decoded, the ring of the newest (`HeldSlots`' last fields)."""
    ring = {"recent_keys": layer.recent_keys, "recent_values": layer.recent_values}
    return {"rotation": layer.rotation, "codec": layer.codec, **ring}


def slots_of_layer(layer: PolicyLayer) -> HeldSlots:
    """What a policy layer holds, as slots (heads of different counts held flat)."""
    held = layer.hand_over()
    flat = {} if "head_of" not in held else {"kv_heads": layer.kv_heads}
    evicting = layer.sizes is not None and not layer.compressed
    return HeldSlots(
        **held, policy=layer.policy, sizes=layer.sizes or Sizes(), evicting=evicting, **flat, **_storage(layer)
    )


def take_slots(layer: PolicyLayer, slots: HeldSlots, seen: int, dtype: torch.dtype) -> None:
    """Let a fresh policy `layer` hold one row's `slots` after `seen` tokens (a conversation the
    fast path hands back), read back in `dtype` (`PolicyLayer.take_over`)."""
    if slots.codec != layer.codec:
        raise SparsegenError(f"slots held in {slots.codec} cannot continue in a cache of {layer.codec}")
    bounded = bool(layer.policy.budget_parts())
    held = {**slots.tensors(), **({} if slots.head_of is None else {"head_of": slots.head_of})}
    kv_heads = slots.kv_heads or slots.positions.shape[1]
    ring = (slots.recent_keys, slots.recent_values)
    sizes, compressed = (slots.sizes if bounded else None), bounded and not slots.evicting
    layer.take_over(held, seen, dtype, kv_heads, sizes, compressed, ring)
