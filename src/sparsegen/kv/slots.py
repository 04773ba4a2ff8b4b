"""The typed hand-over between a policy cache layer and the fast path's fixed-shape slots."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv import ragged
from sparsegen.kv.cache import PolicyLayer, gather_slots
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
    if layer.head_of is not None:
        flat = {"head_of": layer.head_of[:, :, : layer.size], "kv_heads": layer.kv_heads, **_storage(layer)}
        return HeldSlots(**layer.held_slots(), policy=layer.policy, sizes=layer.sizes, evicting=False, **flat)
    held = layer.size + (layer.hole is not None)
    keys = layer.keys[:, :, :held].clone()
    positions = layer.positions[:, :, :held].clone()
    if layer.hole is not None:
        positions.scatter_(2, layer.hole, EMPTY)
    if layer.sink_keys is not None and layer.codec is None:  # rolling sinks were rotated in place: restore them
        keys[:, :, : layer.sink_keys.shape[2]] = layer.sink_keys
    evicting = layer.sizes is not None and not layer.compressed
    values, scores = layer.values[:, :, :held], layer.scores[:, :, :held]
    return HeldSlots(keys, values, positions, scores, layer.policy, layer.sizes or Sizes(), evicting, **_storage(layer))


def take_slots(layer: PolicyLayer, slots: HeldSlots, seen: int, dtype: torch.dtype) -> None:
    """Let a fresh policy `layer` hold one row's `slots` after `seen` tokens (a conversation the
    fast path hands back), read back in `dtype`: the live slots in slot order, which keeps a
    contiguous policy's sinks first; heads that hold different counts are packed flat."""
    if slots.codec != layer.codec:
        raise SparsegenError(f"slots held in {slots.codec} cannot continue in a cache of {layer.codec}")
    live = slots.positions[0] >= 0
    layer.kv_heads, layer.dtype, layer.device = slots.kv_heads or live.shape[0], dtype, slots.keys.device
    layer.is_initialized, layer.cumulative_length, layer.check_padding = True, seen, False
    bounded = bool(layer.policy.budget_parts())
    layer.sizes = slots.sizes if bounded else None
    layer.compressed = bounded and not slots.evicting
    layer.recent_keys, layer.recent_values = slots.recent_keys, slots.recent_values
    tensors = slots.tensors()
    if slots.head_of is not None:  # held flat: the live slots in their order
        index = live[0].nonzero()[:, 0]
        layer.hold_packed({name: t[:, :, index] for name, t in {**tensors, "head_of": slots.head_of}.items()})
        return
    counts = live.sum(-1)
    if bool((counts != counts[0]).any()):
        layer.hold_packed(ragged.pack(tensors, live[None]))
        return
    order = (~live).to(torch.uint8).argsort(dim=-1, stable=True)[None, :, : int(counts[0])]
    for name, tensor in tensors.items():
        setattr(layer, name, gather_slots(tensor, order))
    layer.size = int(counts[0])
