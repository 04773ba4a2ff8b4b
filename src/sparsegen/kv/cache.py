"""The cache layer that applies a policy, and the transformers `Cache` built from such layers.

Each layer preallocates its buffers at the budget plus one slot. While decoding, the new token is
written into the slot freed by the last eviction (no copying of the cache), attention runs over
the budget plus the token in flight, and the lowest-priority slot becomes the next free slot.
Slot order does not matter to attention once every slot carries its original position.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from sparsegen.errors import SparsegenError
from sparsegen.kv.policy import KEEP, Policy, Sizes, Step
from sparsegen.kv.rope import KeyRotation


def _gather(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """buffer [b, h, n, ...] gathered along dim 2 by index [b, h, m]."""
    if buffer.dim() == 4:
        index = index.unsqueeze(-1).expand(-1, -1, -1, buffer.shape[-1])
    return buffer.gather(2, index)


class PolicyLayer(CacheLayerMixin):
    """One attention layer's KV cache under a policy.

    `cumulative_length` is the logical length (tokens seen, what `generate()` builds positions
    from); `size` is the number of tokens physically held. `hole` [b, h, 1], when set, is the
    slot in [0, size] evicted last and free for the next token.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    _BATCHED = ("keys", "values", "positions", "scores", "hole", "sink_keys")

    def __init__(
        self,
        policy: Policy,
        rotation: KeyRotation | None = None,
        layer_idx: int | None = None,
        pinned: int = 0,
        layers: int = 1,
        rope: KeyRotation | None = None,
    ) -> None:
        super().__init__()
        self.policy = policy
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
        self.positions: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        self.sink_keys: torch.Tensor | None = None
        self.check_padding = True
        self.new_tokens = 0
        self.compressed = False

    # -- transformers' layer interface -------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, _ = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_empty(b, h, 0, key_states.shape[-1])
        self.values = value_states.new_empty(b, h, 0, value_states.shape[-1])
        self.positions = torch.empty(b, h, 0, dtype=torch.long, device=self.device)
        self.scores = torch.empty(b, h, 0, dtype=torch.float32, device=self.device)
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
            self.sizes = self._resolve_sizes(self.cumulative_length + n - self.pinned)
        new_positions = torch.arange(self.cumulative_length, self.cumulative_length + n, device=self.device)
        new_positions = new_positions.expand(*key_states.shape[:2], n)
        if self.hole is not None and n == 1:
            self._fill_hole(key_states, value_states, new_positions)
        else:
            if self.hole is not None:
                self._close_hole()
            self._append(key_states, value_states, new_positions)
        self.cumulative_length += n
        self.new_tokens = n
        return self._keys_for_attention(), self.values[:, :, : self.size]

    def _resolve_sizes(self, prompt_length: int) -> Sizes | None:
        """The policy's budget for this layer and the first prompt after the pinned prefix, which
        comes on top (kept as sinks)."""
        sizes = self.policy.sizes(prompt_length)
        if sizes is not None:
            sizes = self.policy.layer_sizes(sizes, prompt_length, self.layer_idx or 0, self.layers)
        if sizes is None or not self.pinned:
            return sizes
        return Sizes(sizes.sinks + self.pinned, sizes.heavy, sizes.recent)

    def _keys_for_attention(self) -> torch.Tensor:
        keys = self.keys[:, :, : self.size]
        if self.rotation is None or self.cumulative_length == self.size:
            return keys
        if not self.policy.contiguous:
            return self.rotation.roll(keys, self.positions[:, :, : self.size], self.cumulative_length)
        # A contiguous policy holds the sinks plus a run of the newest tokens:
        # only the sinks move, all by the same delta. Sinks keep slots [0, sinks) (never evicted,
        # compaction keeps slot order), so they are rotated in place from a pristine copy.
        sinks = min(self.sizes.sinks, self.size)
        if sinks:
            if self.sink_keys is None:
                self.sink_keys = keys[:, :, :sinks].clone()
            delta = torch.tensor(self.cumulative_length - self.size, device=self.device)
            keys[:, :, :sinks] = self.rotation.rotate(self.sink_keys, delta)
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
        self.keys = self.values = self.positions = self.scores = self.hole = self.sink_keys = None
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
        if self.is_initialized:
            for name in self._BATCHED:
                tensor = getattr(self, name)
                if tensor is not None:
                    setattr(self, name, tensor.repeat_interleave(repeats, dim=0))

    def _select_batch(self, index: torch.Tensor) -> None:
        if self.is_initialized:
            for name in self._BATCHED:
                tensor = getattr(self, name)
                if tensor is not None:
                    setattr(self, name, tensor.index_select(0, index.to(tensor.device)))

    # -- checkpoints ------------------------------------------------------------------------
    _STATE = (
        "keys",
        "values",
        "positions",
        "scores",
        "hole",
        "sink_keys",
        "cumulative_length",
        "size",
        "check_padding",
        "new_tokens",
        "compressed",
        "is_initialized",
    )

    def state_dict(self) -> dict:
        """Tensors and plain values only: loads with `torch.load(weights_only=True)`."""
        state = {name: getattr(self, name, None) for name in self._STATE}
        state["sizes"] = None if self.sizes is None else [self.sizes.sinks, self.sizes.heavy, self.sizes.recent]
        return state

    def load_state_dict(self, state: dict) -> None:
        for name in self._STATE:
            setattr(self, name, state[name])
        self.sizes = None if state["sizes"] is None else Sizes(*state["sizes"])
        self.awaiting_attention = False
        if self.keys is not None:
            self.dtype, self.device = self.keys.dtype, self.keys.device

    # -- policy mechanics -------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def _fill_hole(self, key_states, value_states, new_positions) -> None:
        index = self.hole
        self.keys.scatter_(2, index.unsqueeze(-1).expand_as(key_states), key_states)
        self.values.scatter_(2, index.unsqueeze(-1).expand_as(value_states), value_states)
        self.positions.scatter_(2, index, new_positions)
        self.scores.scatter_(2, index, 0.0)
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
        kept = index.shape[-1]
        for name in ("keys", "values", "positions", "scores"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, *old.shape[3:])
            new[:, :, :kept] = _gather(old, index)
            setattr(self, name, new)
        self.size = kept

    def _append(self, key_states, value_states, new_positions) -> None:
        n, size = key_states.shape[-2], self.size
        if size + n > self.capacity:
            limit = self.sizes.budget + 1 if self.sizes is not None and not self.compressed else float("inf")
            grown = int(max(size + n, min(limit, max(2 * self.capacity, 64))))
            self._keep(torch.arange(size, device=self.device).expand(*key_states.shape[:2], -1), grown)
        self.keys[:, :, size : size + n] = key_states
        self.values[:, :, size : size + n] = value_states
        self.positions[:, :, size : size + n] = new_positions
        self.scores[:, :, size : size + n] = 0.0
        self.size = size + n

    def after_attention(
        self, query: torch.Tensor, keys: torch.Tensor, scaling: float, weights=None, received: dict | None = None
    ) -> None:
        """Let the policy update its scores from this attention call, then evict down to the budget.

        A prefill-only policy compresses once, after the first call, and keeps every later token.
        `received` shares `Step.received`'s results between policies replaying one recorded call
        (`kv.shared`); it must belong to these very queries and keys.
        """
        self.awaiting_attention = False
        if self.compressed:
            return
        held = slice(0, self.size)
        step = Step(
            positions=self.positions[:, :, held],
            keys=keys,
            values=self.values[:, :, held],
            scores=self.scores[:, :, held],
            query=query,
            scaling=scaling,
            seen=self.cumulative_length,
            new=self.new_tokens,
            sizes=self.sizes,
            weights=weights,
            rope=self.rope,
            _received={} if received is None else received,
        )
        scores = self.policy.score(step)
        if scores is not None:
            self.scores[:, :, held] = scores
            step.scores = self.scores[:, :, held]
        if self.sizes is None:
            return
        if self.policy.prefill_only:
            self.compressed = True
        if self.size <= self.sizes.budget:
            return
        priority = self.policy.priority(step)
        if self.pinned:
            priority = priority.masked_fill(step.positions < self.pinned, KEEP)
        if self.size - self.sizes.budget == 1 and not self.compressed:
            self.hole = priority.argmin(-1, keepdim=True)
            self.size -= 1
        else:
            keep = priority.topk(self.sizes.budget, dim=-1).indices.sort(-1).values
            self._keep(keep, self.capacity if self.compressed else self.sizes.budget + 1)

    def refuse_padding(self, mask: torch.Tensor | None, query_length: int) -> None:
        """A key column masked for every query is padding, which a policy cache cannot evict right."""
        self.check_padding = False
        if mask is None or mask.dim() != 4:
            return
        visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        if not visible.any(dim=-2).all():
            raise SparsegenError(
                "padded batches are not supported by KV policies: batch prompts of equal length, "
                "or run them one at a time"
            )

    def held_positions(self) -> torch.Tensor:
        """Original positions of the tokens held now, sorted, [b, h, size]."""
        positions = self.positions[:, :, : self.size + (self.hole is not None)]
        if self.hole is not None:
            positions = positions.scatter(2, self.hole, -1)
            positions = positions.sort(-1).values[:, :, 1:]
        return positions.sort(-1).values


class PolicyCache(Cache):
    """A transformers `Cache` whose full-attention layers apply a KV policy."""

    def __init__(self, layers: list[CacheLayerMixin], policy: Policy, position: str) -> None:
        super().__init__(layers=layers)
        self.policy = policy
        self.position = position

    def physical_length(self) -> int | list[int]:
        """Tokens actually held: one int if all layers agree, else one per layer."""
        lengths = [
            layer.size if isinstance(layer, PolicyLayer) else (layer.keys.shape[-2] if layer.is_initialized else 0)
            for layer in self.layers
        ]
        return lengths[0] if len(set(lengths)) == 1 else lengths

    def policy_layers(self) -> list[PolicyLayer]:
        return [layer for layer in self.layers if isinstance(layer, PolicyLayer)]

    def kv_bytes(self) -> int:
        """Bytes of keys and values physically held (all layers)."""
        total = 0
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            held = layer.size if isinstance(layer, PolicyLayer) else layer.keys.shape[-2]
            for tensor in (layer.keys, layer.values):
                total += tensor[:, :, :held].numel() * tensor.element_size()
        return total

    def state_dict(self) -> dict:
        """Every layer's state (tensors and plain values), for checkpoints that resume a stream."""
        return {"policy": self.policy.describe(), "layers": [_layer_state(layer) for layer in self.layers]}

    def load_state_dict(self, state: dict) -> None:
        if state["policy"] != self.policy.describe() or len(state["layers"]) != len(self.layers):
            raise SparsegenError(f"this checkpoint is of {state['policy']}, not of {self.policy.describe()}")
        for layer, saved in zip(self.layers, state["layers"], strict=True):
            _load_layer_state(layer, saved)

    def crop(self, tokens_to_remove: int) -> None:
        raise SparsegenError("a policy cache cannot be cropped (assisted/speculative decoding is not supported)")

    def __repr__(self) -> str:
        return f"PolicyCache({self.policy.describe()}, position={self.position}, layers={len(self.layers)})"


_SLIDING_STATE = ("keys", "values", "cumulative_length", "is_initialized")


def _layer_state(layer: CacheLayerMixin) -> dict:
    if isinstance(layer, PolicyLayer):
        return layer.state_dict()
    return {name: getattr(layer, name, None) for name in _SLIDING_STATE}  # transformers' sliding layer


def _load_layer_state(layer: CacheLayerMixin, state: dict) -> None:
    if isinstance(layer, PolicyLayer):
        layer.load_state_dict(state)
        return
    for name in _SLIDING_STATE:
        setattr(layer, name, state[name])
    if layer.keys is not None:
        layer.dtype, layer.device = layer.keys.dtype, layer.keys.device
