"""The transformers `Cache` of a model under a KV policy: its policy layers, with the model's own
sliding-window layers beside them (Gemma 3); held sizes, bytes, and checkpoints."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from sparsegen.errors import SparsegenError
from sparsegen.kv.cache import PolicyLayer
from sparsegen.kv.policy import Policy
from sparsegen.kv.quantized import RING_SLOTS
from sparsegen.kv.spec import KVSpec


class PolicyCache(Cache):
    """A transformers `Cache` whose full-attention layers apply the KV spec `spec` (its position
    resolved: "original" or "rolling"; `make_cache` builds one)."""

    def __init__(self, layers: list[CacheLayerMixin], spec: KVSpec) -> None:
        super().__init__(layers=layers)
        self.spec = spec

    @property
    def policy(self) -> Policy:
        return self.spec.policy

    @property
    def position(self) -> str:
        return self.spec.placement

    @property
    def kv_bits(self) -> int | None:
        """The bits keys and values are held in (None: the model's numbers)."""
        return self.spec.kv_bits

    def physical_length(self) -> int | list[int]:
        """Tokens actually held: one int if all layers agree, else one per layer."""
        lengths = [
            layer.tokens_per_head
            if isinstance(layer, PolicyLayer)
            else (layer.keys.shape[-2] if layer.is_initialized else 0)
            for layer in self.layers
        ]
        return lengths[0] if len(set(lengths)) == 1 else lengths

    def policy_layers(self) -> list[PolicyLayer]:
        return [layer for layer in self.layers if isinstance(layer, PolicyLayer)]

    def pool_layers(self, held: int, scores: list[torch.Tensor | None]) -> None:
        """Fix each policy layer's budget before a prompt that leaves `held` tokens is replayed into
        this fresh cache, from every layer's scores of it at once (`scores`: one per layer, None
        where a layer has no policy), as the policy pools them (`Policy.pooled_sizes`)."""
        layers = self.policy_layers()
        own = [layer.resolve_sizes(held) for layer in layers]
        if any(sizes is None for sizes in own):
            return
        scored = [score for layer, score in zip(self.layers, scores, strict=True) if isinstance(layer, PolicyLayer)]
        for layer, sizes in zip(layers, self.policy.pooled_sizes(own, scored), strict=True):
            layer.sizes = sizes

    def kv_bytes(self) -> int:
        """Bytes of keys and values physically held (all layers)."""
        total = 0
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            held = layer.size if isinstance(layer, PolicyLayer) else layer.keys.shape[-2]
            for tensor in (layer.keys, layer.values):
                total += tensor[:, :, :held].numel() * tensor.element_size()
            for ring in (getattr(layer, "recent_keys", None), getattr(layer, "recent_values", None)):
                total += 0 if ring is None else ring.numel() * ring.element_size()
        return total

    def state_dict(self) -> dict:
        """Every layer's state (tensors and plain values), for checkpoints that resume a stream."""
        return {"policy": self.policy.describe(), "layers": [layer_state(layer) for layer in self.layers]}

    def load_state_dict(self, state: dict) -> None:
        if state["policy"] != self.policy.describe() or len(state["layers"]) != len(self.layers):
            raise SparsegenError(f"this checkpoint is of {state['policy']}, not of {self.policy.describe()}")
        for layer, saved in zip(self.layers, state["layers"], strict=True):
            load_layer_state(layer, saved)

    def crop(self, tokens_to_remove: int) -> None:
        raise SparsegenError("a policy cache cannot be cropped (assisted/speculative decoding is not supported)")

    def __repr__(self) -> str:
        return f"PolicyCache({self.policy.describe()}, position={self.position}, layers={len(self.layers)})"


_SLIDING_STATE = ("keys", "values", "cumulative_length", "is_initialized")


def layer_state(layer: CacheLayerMixin) -> dict:
    """Tensors and plain values only: loads with `torch.load(weights_only=True)`."""
    if isinstance(layer, PolicyLayer):
        return layer.checkpoint()
    return {name: getattr(layer, name, None) for name in _SLIDING_STATE}  # transformers' sliding layer


def load_layer_state(layer: CacheLayerMixin, state: dict) -> None:
    """Let `layer` hold what `layer_state` saved; a policy layer's KV bits must be the checkpoint's."""
    if not isinstance(layer, PolicyLayer):
        for name in _SLIDING_STATE:
            setattr(layer, name, state[name])
        if layer.keys is not None:
            layer.dtype, layer.device = layer.keys.dtype, layer.keys.device
        return
    held = (state.get("kv_bits"), state.get("kv_rotated", False))  # checkpoints before rotation: unrotated
    wanted = (None, False) if layer.codec is None else (layer.codec.bits, layer.codec.rotated)
    if held != wanted:
        raise SparsegenError(f"this checkpoint holds KV in {_bits(*held)}, this cache in {_bits(*wanted)}")
    ring = state.get("recent_keys")
    if layer.codec is not None and state.get("keys") is not None and (ring is None or ring.shape[2] != RING_SLOTS):
        raise SparsegenError(
            "this checkpoint's rounded KV comes from an older sparsegen (its ring of full-precision tokens "
            f"holds {0 if ring is None else ring.shape[2]}, not {RING_SLOTS}): start the stream again"
        )
    layer.restore(state)


def _bits(bits: int | None, rotated: bool) -> str:
    """How a checkpoint or cache holds its KV, for the mismatch error."""
    return "full precision" if bits is None else f"{bits} bits" + (", rotated" if rotated else "")
