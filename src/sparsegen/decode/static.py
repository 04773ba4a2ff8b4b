"""Every attention layer's slots together (`decode.state.LayerState`), as one decode step reads them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsegen.decode.state import LayerState
from sparsegen.kv.policy import PARTS


@dataclass
class StaticKV:
    """Every layer's `LayerState` (None for a layer without attention state), passed to each
    attention call through `decode.engine.StaticKVEngine` (the `attention_engine` keyword), with
    each row's token count so far. `varying`: the row count and the slot count are left free in a
    compiled step (rows join and leave a server's batch), so a change of either does not compile
    it again."""

    layers: list[LayerState]
    seen: torch.Tensor
    varying: bool = False

    def __post_init__(self) -> None:
        self._mark_static()

    @torch.inference_mode()  # the buffers change in place, and a prefill made them inference tensors
    def select(self, order: list[int]) -> None:
        """Keep the rows `order` (old indices, in their new order) in every layer."""
        for layer in self.layers:
            layer.select(order)
        self.seen = self.seen[order]
        self._mark_static()

    @torch.inference_mode()
    def extend(self, other: StaticKV) -> None:
        """Append `other`'s rows to every layer."""
        for layer, joining in zip(self.layers, other.layers, strict=True):
            layer.extend(joining)
        self.seen = torch.cat([self.seen, other.seen])
        self._mark_static()

    def _mark_static(self) -> None:
        """Tell the compiler what changes between steps, whenever rows join or leave (new buffers
        replace the old): with `varying`, the rows and slots dimensions; on a GPU, that the slots
        keep their addresses from step to step (a CUDA graph replays over them)."""
        if self.varying:
            for layer in self.layers:
                for tensor in _per_row(layer):
                    torch._dynamo.maybe_mark_dynamic(tensor, 0)
                for name in layer.store.per_slot:
                    torch._dynamo.maybe_mark_dynamic(getattr(layer.store, name), 2)
                for part in PARTS:
                    torch._dynamo.maybe_mark_dynamic(getattr(layer.sizes, part), 0)
            torch._dynamo.maybe_mark_dynamic(self.seen, 0)
        if not self.seen.is_cuda:
            return
        for layer in self.layers:
            for tensor in _per_row(layer):
                torch._dynamo.mark_static_address(tensor, guard=False)
        torch._dynamo.mark_static_address(self.seen, guard=False)

    def kv_bytes(self) -> int:
        """Bytes of the preallocated key and value buffers (all rows, all slots)."""
        held = [(layer.keys, layer.values, layer.recent_keys, layer.recent_values) for layer in self.layers]
        held += [(layer.context.keys, layer.context.values) for layer in self.layers if layer.context is not None]
        return sum(t.numel() * t.element_size() for tensors in held for t in tensors if t is not None)

    def live_tokens(self) -> torch.Tensor:
        """Tokens held per row after the last step's eviction, in the first layer."""
        first = self.layers[0]
        own = (first.positions[:, 0] >= 0).sum(-1)
        if first.head_of is not None:  # per head, on average
            own = own // first.kv_heads
        return own if first.context is None else own + first.context.live[:, 0].sum(-1)


def _per_row(layer: LayerState) -> list[torch.Tensor]:
    """A layer's tensors with a row per batch row: its store's and each row's next slot."""
    return [*(getattr(layer.store, name) for name in layer.store.per_row), layer.slot]
