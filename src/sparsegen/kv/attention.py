"""The attention functions a policy cache runs under: sdpa or eager, then eviction.

transformers calls `cache.update()` right before the attention function of the same layer and
passes the keys `update()` returned straight to it. A policy layer tags those keys with itself
(`tag`), so the registered attention function finds its layer through its own call's arguments:
it computes the attention as usual, then hands the layer this call's queries, keys and weights, and
the layer lets its policy score and evict down to the budget.

The fast decode path (`sparsegen.decode`) calls the model with a `static_kv` keyword instead of a
cache: the same function then writes, attends and evicts in that state's fixed-shape buffers.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from sparsegen.errors import SparsegenError

PREFIX = "sparsegen_"
BASE_IMPLEMENTATIONS = {"sdpa": (sdpa_attention_forward, sdpa_mask), "eager": (eager_attention_forward, eager_mask)}
_LAYER = "_sparsegen_layer"


def tag(keys: torch.Tensor, layer) -> torch.Tensor:
    """Mark the keys a policy layer hands to attention with that layer (a fresh view each call)."""
    setattr(keys, _LAYER, layer)
    return keys


def tagged_layer(keys: torch.Tensor, module):
    """The policy layer whose keys these are, checked against the attention module's layer index."""
    layer = getattr(keys, _LAYER, None)
    index = getattr(module, "layer_idx", None)
    if layer is not None and None not in (index, layer.layer_idx) and index != layer.layer_idx:
        raise SparsegenError(f"attention layer {module.layer_idx} got the keys of cache layer {layer.layer_idx}")
    return layer


def attention_received(query: torch.Tensor, key: torch.Tensor, scaling: float, max_elements: int = 1 << 24):
    """Attention probability each key received, summed over new queries and each GQA group.

    query [b, hq, q, d] are the newest q tokens, key [b, hkv, s, d] the held keys followed by
    those q; causal among the new ones. Returns float32 [b, hkv, s]. Queries go in chunks so a
    long prefill never materialises the whole q x s matrix; keys are never copied.
    """
    b, hq, q, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    group = hq // hkv
    grouped = query.view(b, hkv, group, q, d)
    keys_t = key.transpose(-1, -2)
    total = torch.zeros(b, hkv, s, dtype=torch.float32, device=query.device)
    step = max(1, max_elements // max(1, b * hq * s))
    key_index = torch.arange(s, device=query.device)
    for start in range(0, q, step):
        stop = min(q, start + step)
        rows = grouped[:, :, :, start:stop].reshape(b, hkv, group * (stop - start), d)
        logits = (rows @ keys_t).float() * scaling  # [b, hkv, group * n, s], rows group-major
        if q > 1:
            last_visible = (s - q + torch.arange(start, stop, device=query.device)).repeat(group)
            logits.masked_fill_(key_index > last_visible[:, None], float("-inf"))
        total += logits.softmax(-1).sum(dim=2)
    return total


def _make_attention(base):
    def attention(module, query, key, value, attention_mask, scaling=None, static_kv=None, **kwargs):
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        if static_kv is not None:
            state = static_kv.layers[module.layer_idx]
            state.write(key, value, static_kv.seen - 1)
            return state.attend(query, scaling, static_kv.seen.view(-1, 1, 1)), None
        layer = tagged_layer(key, module)
        out, weights = base(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if layer is not None:
            if layer.check_padding:
                layer.refuse_padding(attention_mask, query.shape[-2])
            layer.after_attention(query, key, scaling, weights)
        return out, weights

    return attention


for _name, (_forward, _mask) in BASE_IMPLEMENTATIONS.items():
    AttentionInterface.register(PREFIX + _name, _make_attention(_forward))
    AttentionMaskInterface.register(PREFIX + _name, _mask)


def use_policy_attention(model: torch.nn.Module) -> None:
    """Switch `model` to the sparsegen wrapper of its attention implementation (sdpa or eager)."""
    current = model.config._attn_implementation
    if current.startswith(PREFIX):
        return
    if current not in BASE_IMPLEMENTATIONS:
        raise SparsegenError(
            f"attention implementation {current!r} is not supported by KV policies; load the model with "
            "attn_implementation='sdpa' or 'eager'"
        )
    model.set_attn_implementation(PREFIX + current)


def restore_attention(model: torch.nn.Module) -> None:
    """Undo `use_policy_attention`: the model's own attention implementation again."""
    current = model.config._attn_implementation
    if current.startswith(PREFIX):
        model.set_attn_implementation(current[len(PREFIX) :])
