"""How a policy cache layer hands its slots over to the fast path and takes them back (`kv.slots`).

A mixin of `kv.cache.PolicyLayer`: the layer itself reads and writes its buffers, the hand-over
(`kv.slots`) only asks it.
"""

from __future__ import annotations

import torch

from sparsegen.kv import ragged
from sparsegen.kv.policy import Sizes
from sparsegen.kv.store import EMPTY, RING, TOKENS, SlotStore


class HandOver:
    """`PolicyLayer`'s side of the hand-over: what it holds as slots, and one row's slots held again."""

    def hand_over(self) -> dict[str, torch.Tensor]:
        """What the layer holds, for the fast path to take over (`kv.slots`): keys, values,
        positions, scores [b, h, n, ...], the evicted slot's position `EMPTY` and rolling sinks
        as stored; with heads held flat, `head_of` too."""
        if self.head_of is not None:
            return {**self.held_slots(), "head_of": self.head_of[:, :, : self.size]}
        held = self.size + (self.hole is not None)
        keys, positions = self.keys[:, :, :held].clone(), self.positions[:, :, :held].clone()
        if self.hole is not None:
            positions.scatter_(2, self.hole, EMPTY)
        if self.sink_keys is not None and self.codec is None:  # rolling sinks were rotated in place: restore them
            keys[:, :, : self.sink_keys.shape[2]] = self.sink_keys
        return {
            "keys": keys,
            "values": self.values[:, :, :held],
            "positions": positions,
            "scores": self.scores[:, :, :held],
        }

    def take_over(
        self,
        held: dict[str, torch.Tensor],
        seen: int,
        dtype: torch.dtype,
        kv_heads: int,
        sizes: Sizes | None,
        compressed: bool,
        ring: tuple[torch.Tensor | None, torch.Tensor | None],
    ) -> None:
        """Hold one row's slots `held` (`hand_over`'s layout) after `seen` tokens in a fresh layer,
        read back in `dtype`, its prompt `compressed` or not (a conversation the fast path hands
        back): the live slots in slot order (a contiguous policy's sinks first); heads of different
        counts packed flat. `ring`: the newest tokens' keys and values with a codec."""
        live = held["positions"][0] >= 0
        self.kv_heads, self.dtype, self.device = kv_heads, dtype, held["keys"].device
        self.is_initialized, self.cumulative_length, self.check_padding = True, seen, False
        self.sizes, self.compressed = sizes, compressed
        tokens = {name: held[name] for name in TOKENS}
        self.store = SlotStore(**tokens, codec=self.codec, **dict(zip(RING, ring, strict=True)), kv_heads=kv_heads)
        counts = live.sum(-1)
        if "head_of" in held:  # held flat: the live slots in their order
            self.hold_packed({name: t[:, :, live[0].nonzero()[:, 0]] for name, t in held.items()})
        elif bool((counts != counts[0]).any()):
            self.hold_packed(ragged.pack(tokens, live[None]))
        else:
            self._keep((~live).to(torch.uint8).argsort(dim=-1, stable=True)[None, :, : int(counts[0])], int(counts[0]))
