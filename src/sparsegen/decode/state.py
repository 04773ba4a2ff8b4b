"""Preallocated, fixed-shape KV buffers for the decode step, and one attention call over them.

Each attention layer holds `capacity` slots per row and KV head. A slot's position is the token's
position in its row's text, or `EMPTY` (free), or `DEAD` (beyond this row's budget, never used):
rows of different lengths and budgets share one shape, and padding never enters a cache. A step
writes the new token into `slot` (chosen by the last step), attends over every live slot, lets
the policy score, and picks the next slot: the first free one, else the lowest keep-priority (the
eviction). Every shape is fixed, so one compiled graph serves every later token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from sparsegen.decode.context import ContextRows
from sparsegen.errors import SparsegenError
from sparsegen.kv import ragged
from sparsegen.kv.cache import PolicyLayer
from sparsegen.kv.evict import lowest, priorities, update_scores, victim
from sparsegen.kv.kernels import held_mix, held_scores, rolled_scores, slot_attention
from sparsegen.kv.policy import KEEP, PARTS, Policy, Sizes, Step
from sparsegen.kv.rope import KeyRotation, roll_deltas
from sparsegen.kv.slots import HeldSlots, take_slots
from sparsegen.kv.store import DEAD, EMPTY, RING, SlotStore, append_rows, put_in_slots, select_rows, store_view


def scores_of(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """query [b, h, g, d] . keys [b, h, n, d] -> [b, h, g, n] in fp32. A CPU converts the keys
    first (CPUs without bf16 instructions run bf16 matmuls far slower); a GPU multiplies in the
    cache's dtype, accumulating in fp32, so a step reads the cache once at its own width."""
    if keys.is_cpu:
        return query.float() @ keys.float().transpose(-1, -2)
    return (query.to(keys.dtype) @ keys.transpose(-1, -2)).float()


def weighted_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs [b, h, g, n] fp32 . values [b, h, n, d] -> [b, h, g, d] in fp32 (in the cache's
    dtype on a GPU, as `scores_of`)."""
    if values.is_cpu:
        return probs @ values.float()
    return (probs.to(values.dtype) @ values).float()


@dataclass
class LayerState:
    """One attention layer's slots (a `kv.store.SlotStore`: keys/values [b, h, C, d],
    positions/scores [b, h, C]) and each row's next slot [b, h, 1].

    `evicting` layers score and evict each step; the others keep every token (dense, or a
    prefill-only policy after its compression). `rope` and `layer` are the policy's `Step.rope`
    and `Step.layer`. `rotation` is set for rolling positions;
    `sinks` > 0 with `contiguous` rotates only slots [0, sinks), which hold the first tokens.
    With a `codec`, keys and values are its byte rows, decoded for each step's attention, and
    `recent_keys`, `recent_values` [b, h, RESIDUAL, d] the ring of each row's newest tokens at full
    precision (`kv.quantized`); `byte_products` multiplies the byte rows directly, `rolled_products`
    rotates full-precision keys to rolling positions inside the product (`kv.kernels`; eager steps),
    `fused_attention` attends over fp32 or fp16 slots in one call where no policy reads the probabilities.
    With a `context`, the slots hold each row's own tokens and the rows also attend over the part
    of one shared context each kept (`decode.context`). With `head_of` [b, 1, C], the heads of a
    head-adaptive policy are held flat (`kv.ragged`): keys, values [b, 1, C, d], positions, scores
    [b, 1, C], each slot tagged by its head, and `slot` [b, 1, h] each head's next slot.
    """

    policy: Policy
    sizes: Sizes
    evicting: bool
    store: SlotStore
    slot: torch.Tensor
    rotation: KeyRotation | None = None
    rope: KeyRotation | None = None
    layer: int = 0
    contiguous: bool = False
    sinks: int = 0
    byte_products: bool = False
    rolled_products: bool = False
    fused_attention: bool = False
    context: ContextRows | None = None

    # what the store holds, read-only
    keys, values, positions, scores = (store_view(n) for n in ("keys", "values", "positions", "scores"))
    codec, head_of, recent_keys, recent_values = (store_view(n) for n in ("codec", "head_of", *RING))

    @property
    def kv_heads(self) -> int:
        """KV heads per row (flat heads are tagged, not a dimension)."""
        return self.store.heads

    def select(self, order: list[int]) -> None:
        """Keep the rows `order` (old indices, in their new order; rows leave the batch between
        steps), in place (`SlotStore.select`): the buffers keep their storage for rows that join later."""
        self.store.select(order)
        select_rows(self.slot, order)
        self.sizes = Sizes(*(getattr(self.sizes, part)[order] for part in PARTS))
        if self.context is not None:
            self.context.select(torch.tensor(order, dtype=torch.long, device=self.keys.device))

    def grow(self, capacity: int) -> None:
        """Add slots up to `capacity`: free (EMPTY) where rows keep every token, else DEAD (beyond
        each row's budget); every row's next slot stays where it was."""
        self.store.grow(capacity, DEAD if self.evicting and self.context is None else EMPTY)

    def extend(self, other: LayerState) -> None:
        """Append `other`'s rows (rows join the batch between steps)."""
        if (self.head_of is None) != (other.head_of is None):
            raise SparsegenError("rows holding their heads flat cannot share a batch with rows holding them apart")
        capacity = max(self.store.capacity, other.store.capacity)
        self.grow(capacity)
        other.grow(capacity)
        self.store.extend(other.store)
        self.slot = append_rows(self.slot, other.slot)
        self.sizes = Sizes(*(torch.cat([getattr(self.sizes, p), getattr(other.sizes, p)]) for p in PARTS))
        self.sinks = max(self.sinks, other.sinks)
        self.evicting |= other.evicting and other.context is not None  # rows of a shared context may mix
        if (self.context is None) != (other.context is None):
            raise SparsegenError("rows reading a shared context cannot share a batch with rows that do not")
        if self.context is not None:
            self.context.extend(other.context)

    def hand_back(self, row: int, seen: int, layer: CacheLayerMixin, dtype: torch.dtype) -> None:
        """Write `row`'s held tokens into a fresh cache `layer` of the same policy (a conversation
        kept between requests, continued through the policy cache)."""
        if self.context is not None:
            raise SparsegenError("a row reading a shared context holds no cache of its own to hand back")
        index = slice(row, row + 1)
        if isinstance(layer, PolicyLayer):
            sizes = Sizes(*(int(getattr(self.sizes, part)[row]) for part in PARTS))
            tokens = {name: t[index] for name, t in self.store.tensors().items()}
            if self.codec is None:
                tokens["keys"], tokens["values"] = tokens["keys"].to(dtype), tokens["values"].to(dtype)
            ring = {name: t[index] for name, t in self.store.ring().items()}
            store = SlotStore(**tokens, codec=self.codec, **ring, kv_heads=self.kv_heads)
            take_slots(layer, HeldSlots(store, self.policy, sizes, self.evicting), seen, dtype)
            return
        # a sliding-window layer holds its live tokens in position order
        live = self.positions[row] >= 0
        order = (~live).to(torch.uint8).argsort(dim=-1, stable=True)[:, : int(live[0].sum())]
        order = order.gather(1, self.positions[row].gather(1, order).argsort(-1))
        keys, values = (
            buffer[row].gather(1, order[..., None].expand(-1, -1, buffer.shape[3]))[None].to(dtype)
            for buffer in (self.keys, self.values)
        )
        layer.keys, layer.values, layer.is_initialized = keys, values, True
        layer.dtype, layer.device = keys.dtype, keys.device
        layer.cumulative_length = seen

    def write(self, key: torch.Tensor, value: torch.Tensor, position: torch.Tensor) -> None:
        """Put the new token's key/value [b, h, 1, d] at `position` [b] into each row's free slot."""
        b, h = key.shape[:2]
        self.store.remember(key, value, position.view(b, 1, 1).expand(b, h, 1))
        key, value = self.store.stored("keys", key), self.store.stored("values", value)
        if self.head_of is not None:  # one slot per head, token-major
            key, value = ragged.spread(key), ragged.spread(value)
        self.store.put(self.slot, key, value, position.view(b, 1, 1).expand(self.slot.shape))

    def read(self, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's key and value as numbers (`SlotStore.read`; of `seen` [b, 1, 1] tokens, the
        one just written among them)."""
        return self.store.read(seen)

    def logits(
        self, query: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention logits of the grouped query [b, h, g, d] over every slot's `keys`, and the
        keys as attended (rolled where positions are rolling)."""
        if self.rotation is None:
            return scores_of(query, keys) * scaling, keys
        live = self.positions >= 0
        if self.contiguous:
            if not self.sinks:
                return scores_of(query, keys) * scaling, keys
            sinks = self.rotation.roll_sinks(keys[:, :, : self.sinks], seen - live.sum(-1, keepdim=True))
            parts = (scores_of(query, sinks), scores_of(query, keys[:, :, self.sinks :]))
            return torch.cat(parts, -1) * scaling, keys
        delta = roll_deltas(self.positions, seen, live)
        if self.rolled_products and not torch.compiler.is_compiling():  # no rotated copy (`kv.kernels`)
            return rolled_scores(query, keys, delta, self.rotation) * scaling, None
        keys = self.rotation.rotate(keys, delta)
        return scores_of(query, keys) * scaling, keys

    def attend(self, query: torch.Tensor, scaling: float, seen: torch.Tensor) -> torch.Tensor:
        """Attention of the new queries [b, hq, 1, d] over the live slots, then the policy's step.
        `seen` [b, 1, 1] counts each row's tokens including the new one. Returns [b, 1, hq, d]."""
        if self.head_of is not None:
            return self._attend_flat(query, scaling, seen)
        b, hq, _, d = query.shape
        h = self.keys.shape[1]
        grouped = query.view(b, h, hq // h, d)
        if self.fused_attention and not self.evicting and self.rotation is None and self.context is None:
            out = slot_attention(grouped, self.keys, self.values, self.positions, scaling)
            self.choose_next_slot(query, None, None, None, scaling, seen)
            return out.to(query.dtype).reshape(b, hq, 1, d).transpose(1, 2)
        if self.byte_products:  # no float copy of the cache; no policy scoring while decoding reads it
            keys = values = None
            logits = self._byte_logits(grouped, seen) * scaling
        else:
            keys, values = self.read(seen)
            logits, keys = self.logits(grouped, keys, seen, scaling)
        live = self.positions >= 0
        logits = logits.masked_fill(~live.unsqueeze(2), float("-inf"))
        if self.context is not None:  # the shared context's logits first, then the row's own tokens'
            shift = None if self.context.rotation is None else seen - self.context.held(live)
            probs = torch.cat([self.context.logits(grouped, scaling, shift), logits], -1).softmax(-1)
            shared, own = probs.split([self.context.length, logits.shape[-1]], -1)
            out = self.context.mix(shared) + weighted_values(own, values)
        else:
            probs = logits.softmax(-1)
            if self.byte_products:
                out = held_mix(probs, self.values, self.codec, self.positions, seen, self.recent_values)
            else:
                out = weighted_values(probs, values)
        self.choose_next_slot(query, keys, values, probs, scaling, seen)
        return out.to(query.dtype).reshape(b, hq, 1, d).transpose(1, 2)

    def _attend_flat(self, query: torch.Tensor, scaling: float, seen: torch.Tensor) -> torch.Tensor:
        """`attend` over heads held flat: each query head over its KV head's live slots (`kv.ragged`),
        keys rolled where positions are rolling; every new token kept (head-adaptive policies
        compress the prompt only)."""
        keys, values = self.read(seen)
        if self.rotation is not None:
            keys = self.rotation.rotate(keys, roll_deltas(self.positions, seen, self.positions >= 0, self.head_of))
        mask = ragged.visible(self.head_of, self.positions, query.shape[1], self.kv_heads, (seen - 1).unsqueeze(-1))
        out = ragged.attend(query, keys, values, mask, scaling)
        self.slot.copy_(first_free(self.positions, self.head_of, self.kv_heads))
        return out

    def _byte_logits(self, query: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """`logits` over the byte rows (unscaled): the kernels' products, the rolled sinks of a
        contiguous policy from their decoded keys."""
        scores = held_scores(query, self.keys, self.codec, self.positions, seen, self.recent_keys)
        if self.rotation is None or not self.sinks:
            return scores
        keys = self.store.read_one("keys", seen, self.sinks)
        rotated = self.rotation.roll_sinks(keys, seen - (self.positions >= 0).sum(-1, keepdim=True))
        return torch.cat([scores_of(query, rotated), scores[..., self.sinks :]], -1)

    def choose_next_slot(self, query, keys, values, probs, scaling: float, seen: torch.Tensor) -> None:
        """Score, then free the lowest-priority slot if the row is over budget (else use a free one).
        `probs` [b, h, g, n]: the attention over the shared context, if any, then over the slots."""
        if self.evicting and self.context is not None:
            weights = probs.view(*query.shape[:2], 1, -1)
            step = {"query": query, "scaling": scaling, "seen": seen, "new": 1, "weights": weights, "keys": keys}
            step |= {"rope": self.rope, "layer": self.layer}
            self.slot.copy_(self.context.evict(self.sizes, self.positions, self.scores, step))
            return
        if self.evicting:
            b, hq = query.shape[:2]
            step = Step(
                positions=self.positions,
                keys=keys,
                values=values,
                scores=self.scores,
                query=query,
                scaling=scaling,
                seen=seen,
                new=1,
                sizes=self.sizes,
                weights=probs.view(b, hq, 1, -1),
                rope=self.rope,
                layer=self.layer,
            )
            update_scores(self.policy, step)
            priority = priorities(self.policy, step)
            if self.policy.compress_every > 1:
                free_lowest(self.positions, priority, self.policy.compress_every)
        else:
            priority = torch.full_like(self.scores, KEEP)
        self.slot.copy_(victim(priority, held=self.positions != DEAD, free=self.positions == EMPTY))
        put_in_slots(self.positions, self.slot, EMPTY)  # the chosen slot is free for the next token


def free_lowest(positions: torch.Tensor, priority: torch.Tensor, count: int) -> None:
    """Where a row and head has no free slot left, free its `count` held slots of lowest
    `priority` at once (`Policy.compress_every`; `victim` then takes one of them for the next
    token), in place in `positions` [b, h, C]; rows with room keep theirs. Fixed shapes: one
    compiled step whether or not a row compresses."""
    full = ~(positions == EMPTY).any(-1, keepdim=True)
    given_up = lowest(priority, positions >= 0, count)
    positions.scatter_(2, given_up, torch.where(full, EMPTY, positions.gather(2, given_up)))


def first_free(positions: torch.Tensor, head_of: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Each head's next slot where heads are held flat [b, 1, h]: its first free one (`victim`)."""
    b = positions.shape[0]
    free = (positions == EMPTY) & (head_of == torch.arange(kv_heads, device=head_of.device).view(1, -1, 1))
    return victim(torch.full(free.shape, KEEP, device=free.device), free=free).view(b, 1, kv_heads)
