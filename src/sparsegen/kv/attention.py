"""The attention functions a policy cache runs under: sdpa or eager, then eviction.

transformers hands each attention module the cache (`cache`) and passes the module's
other keywords on to the attention function. Inside `with policy_attention(model):` the model
runs sparsegen's wrapper of its attention implementation, and a forward pre-hook on every attention
module adds the module's own policy layer as the `policy_layer` keyword, so the attention function
gets its layer as an argument: it computes the attention as usual, then hands the layer this
call's queries, keys and weights, and the layer lets its policy score and evict down to the
budget. Leaving the block undoes both; nothing is switched or registered at import.

The fast decode path (`sparsegen.decode`) calls the model with a `static_kv` keyword instead of a
cache: the same function then writes, attends and evicts in that state's fixed-shape buffers.
A packed read of several prompts (`decode.reading.read_packed`) passes `packed` instead: the function
then runs once per prompt's span, each with that prompt's own cache, as a read of it alone would.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from sparsegen.errors import SparsegenError
from sparsegen.kv.cache import PolicyLayer

PREFIX = "sparsegen_"
BASE_IMPLEMENTATIONS = {"sdpa": (sdpa_attention_forward, sdpa_mask), "eager": (eager_attention_forward, eager_mask)}


def policy_layer_of(cache, index: int | None):
    """Layer `index` of a policy cache, or None (no cache, another kind of cache or layer)."""
    layers = getattr(cache, "layers", None)
    if layers is None or index is None or index >= len(layers) or not isinstance(layers[index], PolicyLayer):
        return None
    return layers[index]


def _hand_policy_layer(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of an attention module: its layer of a policy cache, as `policy_layer`."""
    layer = policy_layer_of(kwargs.get("cache"), getattr(module, "layer_idx", None))
    return None if layer is None else (args, {**kwargs, "policy_layer": layer})


def _fit_mask(mask: torch.Tensor, keys: int, queries: int) -> torch.Tensor:
    """The model's one mask, cut to this layer's `keys` held keys when layers hold different counts
    (PyramidKV): every held key is in the past of every new query, so the held part is one visible
    column repeated and only the last `queries` columns (causal among the new tokens) differ."""
    if mask.shape[-1] == keys or keys < queries:
        return mask
    held = mask[..., :1].expand(*mask.shape[:-1], keys - queries)
    return torch.cat([held, mask[..., -queries:]], dim=-1)


def _refuse_padding(mask: torch.Tensor | None) -> None:
    """A key column masked for every query is padding, which a policy cache cannot evict right."""
    if mask is None or mask.dim() != 4:
        return
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    if not visible.any(dim=-2).all():
        raise SparsegenError(
            "padded batches are not supported by KV policies: batch prompts of equal length, or run them one at a time"
        )


@dataclass
class PackedPrompts:
    """Prompts packed end to end in one forward: prompt i spans `bounds[i]` of the sequence and is
    read into `caches[i]`, a fresh policy cache of its own."""

    caches: list
    bounds: list[tuple[int, int]]


def _attend_packed(attention, base, module, query, key, value, packed: PackedPrompts, scaling, kwargs):
    """Each prompt's span attends to itself only: written to its own cache, then attended and
    scored by `attention` exactly as a read of that prompt alone (causal within the span)."""
    outs = []
    for cache, (start, end) in zip(packed.caches, packed.bounds, strict=True):
        keys, values = cache.update(key[:, :, start:end], value[:, :, start:end], module.layer_idx)
        mask = None  # sdpa: causal by itself when queries and keys are the same span
        if base is eager_attention_forward:
            mask = torch.full((end - start, end - start), torch.finfo(query.dtype).min, device=query.device)
            mask = mask.triu(1)[None, None].to(query.dtype)
        layer = policy_layer_of(cache, module.layer_idx)
        out, _ = attention(module, query[:, :, start:end], keys, values, mask, scaling, policy_layer=layer, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1)  # [batch, tokens, heads, head_dim], as transformers' functions return


def _make_attention(base):
    def attention(
        module,
        query,
        key,
        value,
        attention_mask,
        scaling=None,
        static_kv=None,
        policy_layer=None,
        packed=None,
        **kwargs,
    ):
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        if packed is not None:
            return _attend_packed(attention, base, module, query, key, value, packed, scaling, kwargs), None
        if static_kv is not None:
            state = static_kv.layers[module.layer_idx]
            state.write(key, value, static_kv.seen - 1)
            return state.attend(query, scaling, static_kv.seen.view(-1, 1, 1)), None
        out = None if policy_layer is None else policy_layer.own_attention(query, key, value, scaling)
        if out is not None:  # heads of different lengths, or a re-reading that records what it attends to
            policy_layer.after_attention(query, key, scaling, values=value)
            return out, None
        if policy_layer is not None and attention_mask is not None:
            attention_mask = _fit_mask(attention_mask, key.shape[-2], query.shape[-2])
        out, weights = base(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if policy_layer is not None:
            if policy_layer.check_padding:
                policy_layer.check_padding = False
                _refuse_padding(attention_mask)
            policy_layer.after_attention(query, key, scaling, weights, values=value)
        return out, weights

    return attention


@functools.cache
def _register() -> None:
    """Name sparsegen's attention functions in transformers' registries (once, on first use)."""
    for name, (forward, mask) in BASE_IMPLEMENTATIONS.items():
        AttentionInterface.register(PREFIX + name, _make_attention(forward))
        AttentionMaskInterface.register(PREFIX + name, mask)


def is_policy_attention(model: torch.nn.Module) -> bool:
    """Whether `model` runs sparsegen's attention now (inside `policy_attention`)."""
    return model.config._attn_implementation.startswith(PREFIX)


def require_policy_attention(model: torch.nn.Module) -> None:
    """The fast path's KV reaches attention only through sparsegen's attention function (any
    other one ignores `static_kv` and would attend over one token): refuse to step without it."""
    if not is_policy_attention(model):
        raise SparsegenError(
            f"the model's attention is {model.config._attn_implementation!r}, which cannot read the fast path's KV: "
            "decode inside `with sparsegen.kv.policy_attention(model):` (generate() enters it for you)"
        )


def check_supported(model: torch.nn.Module) -> str:
    """The model's attention implementation, when KV policies can wrap it (sdpa or eager)."""
    current = model.config._attn_implementation.removeprefix(PREFIX)
    if current not in BASE_IMPLEMENTATIONS:
        raise SparsegenError(
            f"attention implementation {current!r} is not supported by KV policies; load the model with "
            "attn_implementation='sdpa' or 'eager'"
        )
    return current


@contextmanager
def policy_attention(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run `model` under KV policies for the block: its attention implementation (sdpa or eager)
    is switched to sparsegen's wrapper (same numbers) and each attention module is hooked to hand
    its policy layer to it; on exit both are undone and the model is as it came in. Nested blocks
    leave the switching to the outermost one."""
    if is_policy_attention(model):
        yield model
        return
    current = check_supported(model)
    _register()
    model.set_attn_implementation(PREFIX + current)
    handles = [
        module.register_forward_pre_hook(_hand_policy_layer, with_kwargs=True)
        for module in model.modules()
        if isinstance(getattr(module, "layer_idx", None), int) and hasattr(module, "q_proj")
    ]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(current)
