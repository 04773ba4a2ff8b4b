"""make_cache: the `Cache` of a model under a KV policy, one layer per attention layer."""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import CacheLayerMixin

from sparsegen.errors import SparsegenError
from sparsegen.kv.attention import check_supported
from sparsegen.kv.cache import PolicyLayer
from sparsegen.kv.policy import Policy
from sparsegen.kv.policy_cache import PolicyCache
from sparsegen.kv.quantized import codec_for
from sparsegen.kv.rope import KeyRotation
from sparsegen.kv.spec import KVSpec


def _layer_types(config) -> list[str]:
    text_config = config.get_text_config(decoder=True)
    types = getattr(text_config, "layer_types", None)
    return list(types) if types else ["full_attention"] * text_config.num_hidden_layers


def make_cache(
    model: torch.nn.Module,
    kv: KVSpec | str | Policy = "streaming",
    *,
    pinned: int = 0,
    layer_class: type[PolicyLayer] = PolicyLayer,
) -> PolicyCache:
    """A `Cache` for `model.generate(..., cache=cache)` that applies a KV policy.

    `kv` is a `KVSpec` (`KVSpec.of("h2o", budget=128, kv_bits=4)`: the policy with its budget, the
    keys' positions, the KV's bits), or a bare policy name (`full`, `window`, `streaming`, `h2o`,
    ...) or `Policy`, meaning that policy at its defaults. The first `pinned` tokens (a soft prompt
    read before the text) are never evicted and come on top of the budget. `layer_class` is the
    class of the policy layers (`decode.shared` records the prefill with its own). Full-attention
    layers get the policy; sliding-window layers (Gemma 3) keep their own window.
    The cache evicts only while the model runs inside
    `with sparsegen.kv.policy_attention(model):` (sparsegen's attention hands each layer its
    attention); outside it the cache refuses its second update with a one-line error.
    """
    from sparsegen.kv.rope import find_inv_freq

    kv = KVSpec.coerce(kv)
    policy, position = kv.policy, kv.placement
    check_supported(model)
    config = model.config.get_text_config(decoder=True)
    inv_freq = find_inv_freq(model)
    if inv_freq is None:
        raise SparsegenError(
            f"{type(model).__name__} has no rotary position embedding; KV policies support rotary decoders "
            "(Llama, Qwen2, Mistral, Gemma 3, ...)"
        )
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if position == "rolling" and rope_type in ("dynamic", "longrope"):
        raise SparsegenError(f"rolling positions need position-independent RoPE frequencies, not {rope_type!r}")
    rope = KeyRotation(inv_freq)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    codec = codec_for(kv.kv_bits, head_dim, kv.kv_rotated)
    rotation = rope if position == "rolling" else None
    layers: list[CacheLayerMixin] = []
    types = _layer_types(model.config)
    for index, layer_type in enumerate(types):
        if layer_type == "full_attention":
            layers.append(
                layer_class(policy, rotation, layer_idx=index, pinned=pinned, layers=len(types), rope=rope, codec=codec)
            )
        elif layer_type == "sliding_attention":
            from transformers.cache_utils import DynamicSlidingWindowLayer

            layers.append(DynamicSlidingWindowLayer(sliding_window=config.sliding_window))
        else:
            raise SparsegenError(f"layer type {layer_type!r} is not supported by KV policies")
    if not any(isinstance(layer, PolicyLayer) for layer in layers):
        raise SparsegenError("the model has no full-attention layer for a KV policy to apply to")
    return PolicyCache(layers, dataclasses.replace(kv, position=position))
