"""The slot store: the one holder of a layer's tokens under every path that applies a policy.

The drop-in cache (`kv.cache.PolicyLayer`), the fast path's fixed-shape slots
(`decode.state.LayerState`, which also holds the rows of a shared context's own tokens) each hold
one. A slot holds a token's key and value (numbers, or a codec's byte rows), its original
position (`EMPTY` for a free slot, `DEAD` beyond a row's budget) and its policy score. Writing a
token, compacting, growing, moving rows and the quantized read are written here once; which slot
goes is `kv.evict`'s, and where keys roll to is `kv.rope.roll_deltas`'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from sparsegen.kv.quantized import RING_SLOTS, KVCodec, remember, row_centre

EMPTY = -1
"""The position of a free slot."""
DEAD = -2
"""The position of a slot beyond its row's budget in a batch of rows with different budgets: never used."""
RING = ("recent_keys", "recent_values")
TOKENS = ("keys", "values", "positions", "scores")


def gather_slots(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """buffer [b, h, n, ...] gathered along dim 2 by index [b, h, m]."""
    if buffer.dim() == 4:
        index = index.unsqueeze(-1).expand(-1, -1, -1, buffer.shape[-1])
    return buffer.gather(2, index)


def put_in_slots(buffer: torch.Tensor, slot: torch.Tensor, new: torch.Tensor | float) -> None:
    """Write `new` ([b, h, 1, ...] or a number) into each row's and head's `slot` [b, h, 1] of
    `buffer` [b, h, C, ...]. Eagerly a `scatter_` (the cheapest to launch); in a compiled step an
    `index_put_`, which inductor writes in place, where a `scatter_` on a graph input is copied
    whole, written and copied back (two copies of every layer's buffers a step: a third of a
    1k-context int4 step, docs/benchmarks.md)."""
    if not torch.compiler.is_compiling():
        index = slot if buffer.dim() == 3 else slot.unsqueeze(-1).expand(*slot.shape, buffer.shape[3])
        buffer.scatter_(2, index, new)
        return
    b, h = slot.shape[:2]
    at = (torch.arange(b, device=slot.device).view(b, 1, 1), torch.arange(h, device=slot.device).view(1, h, 1), slot)
    buffer.index_put_(at, new if isinstance(new, torch.Tensor) else buffer.new_full((), new))


def append_rows(buffer: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`buffer` [n, ...] with `rows` [k, ...] after its own rows: in place where its storage has
    room (left by rows that left), else in a new buffer with room for as many rows again, so rows
    joining one at a time copy the batch only when it doubles, not at every join."""
    n, k, shape = buffer.shape[0], rows.shape[0], buffer.shape[1:]
    if buffer.untyped_storage().nbytes() < (n + k) * shape.numel() * buffer.element_size():
        grown = buffer.new_empty((2 * (n + k), *shape))
        grown[:n] = buffer
        buffer = grown
    buffer.resize_(n + k, *shape)
    buffer[n:] = rows
    return buffer


def select_rows(buffer: torch.Tensor, order: list[int]) -> None:
    """Keep `buffer`'s rows `order` (old indices, in their new order), in place: only rows whose
    index changes are copied, and the storage stays for rows that join later (`append_rows`)."""
    moved = [(new, old) for new, old in enumerate(order) if new != old]
    if len(moved) > 1:  # a permutation: read every moved row before writing any
        buffer[[new for new, _ in moved]] = buffer[[old for _, old in moved]]
    elif moved:
        buffer[moved[0][0]].copy_(buffer[moved[0][1]])
    buffer.resize_(len(order), *buffer.shape[1:])


def store_view(name: str) -> property:
    """A read-only view of a holder's `store.<name>` (None before it holds a store): a layer shows
    what its store holds, and nothing outside writes it."""
    return property(lambda holder: None if holder.store is None else getattr(holder.store, name))


@dataclass
class SlotStore:
    """keys, values [b, h, C, d] (a codec's byte rows [b, h, C, width] with a `codec`);
    positions, scores [b, h, C]. With a codec, `recent_keys`, `recent_values` [b, h, RING_SLOTS, d]
    hold each row's first and newest tokens at full precision (`kv.quantized`). With `head_of` [b, 1, C] the
    `kv_heads` heads of a head-adaptive layer are held flat (`kv.ragged`): h is 1 and each slot is
    tagged by its head."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    codec: KVCodec | None = None
    recent_keys: torch.Tensor | None = None
    recent_values: torch.Tensor | None = None
    head_of: torch.Tensor | None = None
    kv_heads: int = 0

    @classmethod
    def empty(cls, keys: torch.Tensor, values: torch.Tensor, codec: KVCodec | None) -> SlotStore:
        """A store of no slots for tokens like `keys`, `values` [b, h, n, d] (a ring of zeros with a codec)."""
        b, h = keys.shape[:2]
        ring = {}
        if codec is not None:
            ring = {
                name: t.new_zeros(b, h, RING_SLOTS, t.shape[-1]) for name, t in zip(RING, (keys, values), strict=True)
            }
        stored = (t[:, :, :0] if codec is None else codec.encode(t[:, :, :0]) for t in (keys, values))
        positions = torch.empty(b, h, 0, dtype=torch.long, device=keys.device)
        return cls(*stored, positions, positions.float(), codec=codec, kv_heads=h, **ring)

    @property
    def per_slot(self) -> tuple[str, ...]:
        """The names of the tensors with a slot per slot (dim 2)."""
        return TOKENS if self.head_of is None else (*TOKENS, "head_of")

    @property
    def per_row(self) -> tuple[str, ...]:
        """The names of the tensors with a row per batch row."""
        return self.per_slot if self.codec is None else (*self.per_slot, *RING)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def heads(self) -> int:
        """KV heads per row (flat heads are tagged, not a dimension)."""
        return self.keys.shape[1] if self.head_of is None else self.kv_heads

    def tensors(self, count: int | None = None) -> dict[str, torch.Tensor]:
        """The per-slot tensors by name, the first `count` slots (all when None)."""
        return {name: getattr(self, name)[:, :, :count] for name in self.per_slot}

    def ring(self) -> dict[str, torch.Tensor]:
        """The ring of the first and newest tokens by name (none without a codec)."""
        return {} if self.codec is None else {name: getattr(self, name) for name in RING}

    def stored(self, name: str, states: torch.Tensor) -> torch.Tensor:
        """The "keys" or "values" [b, h, n, d] as held: the codec's byte rows (keys less their row's
        centre: `remember` them first), or the numbers in the store's dtype."""
        if self.codec is None:
            return states.to(self.keys.dtype)
        return self.codec.encode(states, self.centre(name))

    def centre(self, name: str) -> torch.Tensor | None:
        """Each row's centre [b, h, d] of "keys" (`kv.quantized.row_centre`); values have none."""
        return row_centre(self.recent_keys) if name == "keys" else None

    def remember(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """With a codec, put new tokens' full-precision keys and values at `positions` [b, h, n] in the ring
        (before `stored`: a row's first tokens set its centre)."""
        if self.codec is not None:
            remember(self.recent_keys, keys, positions)
            remember(self.recent_values, values, positions)

    def put(self, slot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Write one stored token per row and head ([b, h, 1, ...]) into its `slot` [b, h, 1], score 0."""
        put_in_slots(self.keys, slot, keys)
        put_in_slots(self.values, slot, values)
        put_in_slots(self.positions, slot, positions)
        put_in_slots(self.scores, slot, 0.0)

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Write stored tokens [b, h, n, ...] into slots [start, start + n), scores 0."""
        end = start + keys.shape[2]
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        self.positions[:, :, start:end] = positions
        self.scores[:, :, start:end] = 0.0

    def keep(self, index: torch.Tensor, capacity: int) -> None:
        """Keep the slots `index` [b, h, m], compacted into new buffers of `capacity` slots."""
        for name in self.per_slot:
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, *old.shape[3:])
            new[:, :, : index.shape[-1]] = gather_slots(old, index)
            setattr(self, name, new)

    def grow(self, capacity: int, position: int = EMPTY) -> None:
        """Add slots up to `capacity` at `position` (free, or DEAD); flat heads take them in turn."""
        extra = capacity - self.capacity
        if extra <= 0:
            return
        b, h = self.positions.shape[:2]
        self.keys = torch.cat([self.keys, self.keys.new_zeros(b, h, extra, self.keys.shape[3])], 2)
        self.values = torch.cat([self.values, self.values.new_zeros(b, h, extra, self.values.shape[3])], 2)
        self.positions = torch.cat([self.positions, self.positions.new_full((b, h, extra), position)], 2)
        self.scores = torch.cat([self.scores, self.scores.new_zeros(b, h, extra)], 2)
        if self.head_of is not None:
            tags = torch.arange(capacity - extra, capacity, device=self.head_of.device).remainder(self.kv_heads)
            self.head_of = torch.cat([self.head_of, tags.expand(b, h, extra)], 2)

    def map_rows(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace each per-row tensor by `rows(tensor)` (rows selected, repeated)."""
        for name in self.per_row:
            setattr(self, name, rows(getattr(self, name)))

    def select(self, order: list[int]) -> None:
        """Keep the rows `order` (old indices, in their new order; rows leave a batch between
        steps), in place (`select_rows`)."""
        for name in self.per_row:
            select_rows(getattr(self, name), order)

    def extend(self, other: SlotStore) -> None:
        """Append `other`'s rows (of as many slots; rows join a batch between steps)."""
        for name in self.per_row:
            setattr(self, name, append_rows(getattr(self, name), getattr(other, name)))

    def read_one(self, name: str, seen: int | torch.Tensor, count: int | None = None, dtype=torch.float32):
        """The first `count` slots (all when None) of "keys" or "values" as numbers: the buffer
        itself, or decoded in `dtype` with each row's first and newest tokens (of `seen`) from the ring
        at full precision. The one quantized read of every path."""
        held = getattr(self, name)[:, :, :count]
        if self.codec is None:
            return held
        head_of = None if self.head_of is None else self.head_of[:, :, :count]
        recent = self.recent_keys if name == "keys" else self.recent_values
        return self.codec.read(held, self.positions[:, :, :count], seen, recent, head_of, dtype, self.centre(name))

    def read(self, seen: int | torch.Tensor, count: int | None = None, dtype=torch.float32):
        """Keys and values as numbers (`read_one`)."""
        return self.read_one("keys", seen, count, dtype), self.read_one("values", seen, count, dtype)

    def state(self) -> dict[str, torch.Tensor | int | None]:
        """Its tensors and head count by name (for checkpoints; the codec is the cache's)."""
        return {field.name: getattr(self, field.name) for field in fields(self) if field.name != "codec"}
