"""The cache layer that applies a policy, and the transformers `Cache` built from such layers.

Each layer preallocates its buffers at the budget plus one slot. While decoding, the new token is
written into the slot freed by the last eviction (no copying of the cache), attention runs over
the budget plus the token in flight, and the lowest-priority slot becomes the next free slot.
Slot order does not matter to attention once every slot carries its original position.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from sparsegen.errors import SparsegenError
from sparsegen.kv import ragged
from sparsegen.kv.evict import keep_best, priorities, update_scores, victim
from sparsegen.kv.layer_slots import HandOver
from sparsegen.kv.policy import Policy, Sizes, Step
from sparsegen.kv.quantized import RESIDUAL, KVCodec
from sparsegen.kv.rope import KeyRotation, roll_deltas
from sparsegen.kv.store import SlotStore, store_view


def room_for(budget: int) -> int:
    """Slots a layer that keeps every new token holds free beyond what it holds (a sixteenth, so
    its buffers stay within about 6% of its tokens' bytes; decoding past it grows them)."""
    return max(1, budget // 16)


class PolicyLayer(HandOver, CacheLayerMixin):
    """One attention layer's KV cache under a policy.

    `cumulative_length` is the logical length (tokens seen, what `generate()` builds positions
    from); `size` is the number of tokens physically held. `hole` [b, h, 1], when set, is the
    slot in [0, size] evicted last and free for the next token. `head_of`, once a head-adaptive
    policy has compressed the prompt, tags the slots of the flattened heads (`kv.ragged`).
    With a `codec`, keys and values are held as its byte rows (`kv.quantized`) and read back in
    `dtype`, the model's. The tokens are held in a `kv.store.SlotStore`; keys, values, positions,
    scores, head tags and the ring are read from it, never written from outside.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    _BATCHED = ("hole", "sink_keys")

    def __init__(
        self,
        policy: Policy,
        rotation: KeyRotation | None = None,
        layer_idx: int | None = None,
        pinned: int = 0,
        layers: int = 1,
        rope: KeyRotation | None = None,
        codec: KVCodec | None = None,
    ) -> None:
        self.is_initialized = False  # transformers' layer fields: keys and values are the store's
        self.store: SlotStore | None = None
        self.policy = policy
        self.codec = codec
        self.layers = layers
        self.rope = rope or rotation  # a rolling layer knows the frequencies too
        self.pinned = pinned
        self.layer_idx = layer_idx
        self.awaiting_attention = False
        self.rotation = rotation
        self.cumulative_length = 0
        self.size = 0
        self.hole: torch.Tensor | None = None
        self.sizes: Sizes | None = None
        self.sink_keys: torch.Tensor | None = None
        self.kv_heads = 0
        self.check_padding = True
        self.new_tokens = 0
        self.compressed = False

    # -- what the store holds, read-only -------------------------------------------------------
    keys, values, positions, scores = (store_view(n) for n in ("keys", "values", "positions", "scores"))
    head_of, recent_keys, recent_values = (store_view(n) for n in ("head_of", "recent_keys", "recent_values"))

    # -- transformers' layer interface -------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.kv_heads = key_states.shape[1]
        self.store = SlotStore.empty(key_states, value_states, self.codec)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.awaiting_attention:
            raise SparsegenError(
                "a policy cache layer was updated but its attention never ran through sparsegen's attention "
                "function: run the model inside `with sparsegen.kv.policy_attention(model):`"
            )
        self.awaiting_attention = True
        n = key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.sizes is None and self.cumulative_length + n > self.pinned:
            self.sizes = self.resolve_sizes(self.cumulative_length + n)
        new_positions = torch.arange(self.cumulative_length, self.cumulative_length + n, device=self.device)
        new_positions = new_positions.expand(*key_states.shape[:2], n)
        self.store.remember(key_states, value_states, new_positions)
        stored_keys, stored_values = self.store.stored("keys", key_states), self.store.stored("values", value_states)
        if self.head_of is not None:
            key_states, value_states = ragged.spread(key_states), ragged.spread(value_states)
            self._append(ragged.spread(stored_keys), ragged.spread(stored_values), ragged.spread(new_positions))
            size, b = self.size, stored_keys.shape[0]
            self.head_of[:, :, size - n * self.kv_heads : size] = ragged.new_head_tags(b, self.kv_heads, n, self.device)
        elif self.hole is not None and n == 1:
            self._fill_hole(stored_keys, stored_values, new_positions)
        else:
            if self.hole is not None:
                self._close_hole()
            self._append(stored_keys, stored_values, new_positions)
        self.cumulative_length += n
        self.new_tokens = n
        keys = self._keys_for_attention(self._read("keys", key_states))
        return keys, self._read("values", value_states)

    def _read(self, name: str, new: torch.Tensor | None) -> torch.Tensor:
        """The held "keys" or "values" as numbers (`SlotStore.read_one`); this call's own tokens
        `new`, when more than a codec's ring holds (a prompt chunk), are put back at full precision."""
        held = self.store.read_one(name, self.cumulative_length, self.size, self.dtype)
        if self.codec is not None and new is not None and new.shape[2] > RESIDUAL:  # the new tokens are the last slots
            held[:, :, self.size - new.shape[2] :] = new
        return held

    def resolve_sizes(self, held: int) -> Sizes | None:
        """The policy's budget for this layer once its first prompt is read (`held` tokens with the
        pinned prefix, which comes on top, kept as sinks)."""
        prompt_length = held - self.pinned
        sizes = self.policy.sizes(prompt_length)
        if sizes is not None:
            sizes = self.policy.layer_sizes(sizes, prompt_length, self.layer_idx or 0, self.layers)
        if sizes is None or not self.pinned:
            return sizes
        return Sizes(sizes.sinks + self.pinned, sizes.heavy, sizes.recent)

    def _keys_for_attention(self, keys: torch.Tensor) -> torch.Tensor:
        """The held keys as read (`_read`), rolled where positions are rolling."""
        if self.rotation is None or self.cumulative_length == self.size:
            return keys
        if not self.policy.contiguous:
            head_of = None if self.head_of is None else self.head_of[:, :, : self.size]
            return self.rotation.roll(
                keys, roll_deltas(self.positions[:, :, : self.size], self.cumulative_length, head_of=head_of)
            )
        # A contiguous policy holds the sinks plus a run of the newest tokens:
        # only the sinks move, all by the same delta. Sinks keep slots [0, sinks) (never evicted,
        # compaction keeps slot order). At full precision they are rotated in the buffer itself,
        # from a pristine copy; under a codec `keys` is a fresh decoded copy each call (the sinks
        # from the ring while they are that new, from their bytes after), rotated as read.
        sinks = min(self.sizes.sinks, self.size)
        if sinks:
            if self.codec is None and self.sink_keys is None:
                self.sink_keys = keys[:, :, :sinks].clone()
            pristine = keys[:, :, :sinks] if self.codec is not None else self.sink_keys  # rotate writes a new tensor
            keys[:, :, :sinks] = self.rotation.roll_sinks(pristine, self.cumulative_length - self.size)
        return keys

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Every held token is in the past of every new query: a causal mask over
        # (held + new) with this offset is exact whatever the held tokens are.
        return self.size + query_length, self.cumulative_length - self.size

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = self.hole = self.sink_keys = None
        self.is_initialized = False
        self.cumulative_length = self.size = 0
        self.sizes = None
        self.check_padding = True
        self.new_tokens = 0
        self.compressed = False
        self.awaiting_attention = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def _select_batch(self, index: torch.Tensor) -> None:
        self._map_rows(lambda tensor: tensor.index_select(0, index.to(tensor.device)))

    def _map_rows(self, rows) -> None:
        """Replace each per-row tensor by `rows(tensor)` (rows selected, repeated)."""
        if not self.is_initialized:
            return
        self.store.map_rows(rows)
        for name in self._BATCHED:
            if getattr(self, name) is not None:
                setattr(self, name, rows(getattr(self, name)))

    # -- policy mechanics -------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.store.capacity

    def _fill_hole(self, key_states, value_states, new_positions) -> None:
        self.store.put(self.hole, key_states, value_states, new_positions)
        self.hole = None
        self.size += 1

    def _close_hole(self) -> None:
        """Compact [0, size] minus the hole into [0, size)."""
        index = torch.arange(self.size, device=self.device).expand(*self.hole.shape[:2], -1)
        index = index + (index >= self.hole).long()
        self._keep(index, self.capacity)
        self.hole = None

    def _keep(self, index: torch.Tensor, capacity: int) -> None:
        """Keep the slots `index` [b, h, m], compacted into new buffers of `capacity` slots."""
        self.store.keep(index, capacity)
        self.size = index.shape[-1]

    def _append(self, key_states, value_states, new_positions) -> None:
        n, size = key_states.shape[-2], self.size
        if size + n > self.capacity:
            if self.compressed:  # keeps every new token: grow by a sixteenth, to stay near what it holds
                grown = size + n + room_for(size + n)
            else:
                limit = self.policy.held_at_most(self.sizes.largest) if self.sizes is not None else float("inf")
                grown = int(max(size + n, min(limit, max(2 * self.capacity, 64))))
            self.store.grow(grown)
        self.store.write(size, key_states, value_states, new_positions)
        self.size = size + n

    def after_attention(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        scaling: float,
        weights=None,
        received: dict | None = None,
        reconstruction: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
    ) -> None:
        """Let the policy update its scores from this attention call, then evict down to the budget.

        A prefill-only policy compresses once, after the first call, and keeps every later token.
        `received` shares `Step.received`'s results between policies replaying one recorded call
        (`decode.shared`); it must belong to these very queries and keys. `reconstruction` is
        `Step.reconstruction`, for a replayed prompt. `values` are the held values as attention
        read them (`update`'s), needed when a codec holds them.
        """
        self.awaiting_attention = False
        if self.compressed:
            return
        held = slice(0, self.size)
        step = Step(
            positions=self.positions[:, :, held],
            keys=keys,
            values=self._read("values", None) if values is None else values,
            scores=self.scores[:, :, held],
            query=query,
            scaling=scaling,
            seen=self.cumulative_length,
            new=self.new_tokens,
            sizes=self.sizes,
            weights=weights,
            rope=self.rope,
            layer=self.layer_idx or 0,
            reconstruction=reconstruction,
            _received={} if received is None else received,
        )
        update_scores(self.policy, step)
        if self.sizes is None:
            return
        if self.policy.prefill_only:
            self.compressed = True
        if self.size < self.policy.held_at_most(self.sizes.largest):  # room for the next token: evict later
            return
        priority = priorities(self.policy, step, self.pinned)
        budget = self.sizes.budget
        if self.policy.head_adaptive:
            self.hold_packed(ragged.pack(self.held_slots(), ragged.select_across_heads(priority, budget)))
        elif self.size - budget == 1 and not self.compressed:
            self.hole = victim(priority)
            self.size -= 1
        else:
            capacity = budget + room_for(budget) if self.compressed else self.policy.held_at_most(budget)
            self._keep(keep_best(priority, budget), capacity)

    def held_slots(self) -> dict[str, torch.Tensor]:
        """The held part of the per-slot buffers (with `head_of` where heads are held flat), by name."""
        return self.store.tensors(self.size)

    def hold_packed(self, packed: dict[str, torch.Tensor]) -> None:
        """Hold `ragged.pack`'s flat slots from now on, with room for new tokens (one slot per head each)."""
        total = packed["head_of"].shape[-1]
        self.store = SlotStore(**packed, codec=self.codec, **self.store.ring(), kv_heads=self.kv_heads)
        self.store.grow(total + self.kv_heads * room_for(total // self.kv_heads))
        self.size = total

    def own_attention(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float):
        """This call's attention where the layer computes it itself (over flattened heads,
        `kv.ragged.attend`), or None: the model's attention function computes it."""
        if self.head_of is None:
            return None
        head_of, positions = self.head_of[:, :, : self.size], self.positions[:, :, : self.size]
        seen, q = self.cumulative_length, query.shape[2]
        query_positions = torch.arange(seen - q, seen, device=query.device).view(1, 1, q, 1)
        mask = ragged.visible(head_of, positions, query.shape[1], self.kv_heads, query_positions)
        return ragged.attend(query, keys, values, mask, scaling)

    @property
    def tokens_per_head(self) -> int:
        """Tokens held per KV head (on average, where heads share the layer's budget)."""
        return self.size // self.kv_heads if self.head_of is not None else self.size

    def kept_positions(self) -> list[list[list[int]]]:
        """Sorted positions each (row, KV head) holds: [b][h] lists, whatever the layout."""
        if self.head_of is None:
            return self.held_positions().tolist()
        return ragged.per_head(self.head_of[:, :, : self.size], self.positions[:, :, : self.size], self.kv_heads)

    def held_positions(self) -> torch.Tensor:
        """Original positions of the tokens held now, sorted, [b, h, size]."""
        if self.head_of is not None:
            raise SparsegenError("this layer's heads hold different counts: read them with kept_positions()")
        positions = self.positions[:, :, : self.size + (self.hole is not None)]
        if self.hole is not None:
            positions = positions.scatter(2, self.hole, -1)
            positions = positions.sort(-1).values[:, :, 1:]
        return positions.sort(-1).values
