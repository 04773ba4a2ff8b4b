"""How a policy cache layer hands its slots over to the fast path and takes them back (`kv.slots`),
and saves and restores them (checkpoints that resume a stream, `kv.policy_cache`).

A mixin of `kv.cache.PolicyLayer`: the layer itself reads and writes its store, the hand-over and
the checkpoint only ask it.
"""

from __future__ import annotations

import torch

from sparsegen.kv import ragged
from sparsegen.kv.policy import Sizes
from sparsegen.kv.store import EMPTY, RING, TOKENS, SlotStore

_STORE_STATE = ("keys", "values", "positions", "scores", "head_of", "recent_keys", "recent_values")
_LAYER_STATE = (
    *("hole", "sink_keys", "kv_heads", "cumulative_length", "size", "check_padding", "new_tokens", "compressed"),
    "is_initialized",
)


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

    def checkpoint(self) -> dict:
        """The layer's state: tensors and plain values only (loads with `torch.load(weights_only=True)`)."""
        held = dict.fromkeys(_STORE_STATE) if self.store is None else self.store.state()
        state = {**held, **{name: getattr(self, name) for name in _LAYER_STATE}}
        state["sizes"] = None if self.sizes is None else [self.sizes.sinks, self.sizes.heavy, self.sizes.recent]
        state["dtype"] = str(getattr(self, "dtype", torch.float32)).removeprefix("torch.")
        state["kv_bits"] = None if self.codec is None else self.codec.bits
        state["kv_rotated"] = self.codec is not None and self.codec.rotated
        return state

    def restore(self, state: dict) -> None:
        """Hold what `checkpoint` saved (its codec checked by the caller)."""
        tokens = {name: state.get(name) for name in _STORE_STATE}  # a ring only with a codec
        self.store = (
            None if tokens["keys"] is None else SlotStore(**tokens, codec=self.codec, kv_heads=state["kv_heads"])
        )
        for name in _LAYER_STATE:
            setattr(self, name, state.get(name))
        self.sizes = None if state["sizes"] is None else Sizes(*state["sizes"])
        self.awaiting_attention = False
        if self.keys is not None:
            self.dtype = getattr(torch, state["dtype"]) if "dtype" in state else self.keys.dtype
            self.device = self.keys.device
