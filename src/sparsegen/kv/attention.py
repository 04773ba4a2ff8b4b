"""The attention functions a policy cache runs under: sdpa or eager, then eviction.

transformers hands each attention module the cache (`cache`) and passes the module's
other keywords on to the attention function. Inside `with policy_attention(model):` the model
runs sparsegen's wrapper of its attention implementation, and every call of it is run by an
`AttentionEngine`, the one `attention_engine` keyword a model call may carry:

- `PolicyLayerEngine` (the drop-in cache): a forward pre-hook on every attention module hands the
  module's own layer of the policy cache to a call that names no engine, so
  `model(..., cache=cache)` computes the attention as usual, then the layer lets its policy score
  and evict down to the budget;
- `PackedEngine` (`model(..., attention_engine=PackedEngine(caches, bounds))`, `decode.reading.read_packed`):
  several prompts packed in one forward, each span attended and written as a read of it alone;
- the fast decode path's engine (`decode.engine.StaticKVEngine`): the same function then writes,
  attends and evicts in that state's fixed-shape buffers.

A call with no engine is the model's own attention. Leaving the block undoes the switch and the
hooks; nothing is switched or registered at import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from sparsegen.errors import SparsegenError
from sparsegen.kv.cache import PolicyLayer
from sparsegen.kv.prompt_attention import sdpa_or_span

PREFIX = "sparsegen_"
BASE_IMPLEMENTATIONS = {"sdpa": (sdpa_or_span, sdpa_mask), "eager": (eager_attention_forward, eager_mask)}


def policy_layer_of(cache, index: int | None):
    """Layer `index` of a policy cache, or None (no cache, another kind of cache or layer)."""
    layers = getattr(cache, "layers", None)
    if layers is None or index is None or index >= len(layers) or not isinstance(layers[index], PolicyLayer):
        return None
    return layers[index]


def _hand_cache_engine(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of an attention module: a call that names no engine runs its layer of a
    policy cache (`PolicyLayerEngine`)."""
    if kwargs.get("attention_engine") is not None:
        return None
    engine = cache_engine(kwargs.get("cache"), getattr(module, "layer_idx", None))
    return None if engine is None else (args, {**kwargs, "attention_engine": engine})


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


class AttentionEngine:
    """What runs one call of sparsegen's attention function: where the call's keys and values go
    and what happens after the attention. A model call names its engine as `attention_engine`
    (or, for a policy cache, the module's hook does), so the call site shows which one is live."""

    def attend(
        self,
        base: Callable,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention output [b, q, heads, d] and its weights (or None), as transformers'
        functions return them; `base` is the model's own attention function (sdpa or eager),
        `kwargs` the call's other keywords for it."""
        raise NotImplementedError


@dataclass
class PolicyLayerEngine(AttentionEngine):
    """The drop-in cache: the attention as the model computes it (or as `layer` computes it, for
    heads of different lengths and a re-reading that records), then `layer`'s policy scores and
    evicts."""

    layer: PolicyLayer

    def attend(self, base, module, query, key, value, mask, scaling, kwargs):
        layer = self.layer
        out = layer.own_attention(query, key, value, scaling)
        if out is not None:
            layer.after_attention(query, key, scaling, values=value)
            return out, None
        if mask is not None:
            mask = _fit_mask(mask, key.shape[-2], query.shape[-2])
        out, weights = base(module, query, key, value, mask, scaling=scaling, **kwargs)
        if layer.check_padding:
            layer.check_padding = False
            _refuse_padding(mask)
        layer.after_attention(query, key, scaling, weights, values=value)
        return out, weights


def cache_engine(cache, index: int | None) -> PolicyLayerEngine | None:
    """The engine of layer `index` of a policy cache, or None (no cache, another kind of cache or layer)."""
    layer = policy_layer_of(cache, index)
    return None if layer is None else PolicyLayerEngine(layer)


@dataclass
class PackedEngine(AttentionEngine):
    """Prompts packed end to end in one forward: prompt i spans `bounds[i]` of the sequence and is
    read into `caches[i]`, a fresh policy cache of its own. Each span attends to itself only:
    written to its own cache, then attended and scored exactly as a read of that prompt alone
    (causal within the span)."""

    caches: list
    bounds: list[tuple[int, int]]

    def attend(self, base, module, query, key, value, mask, scaling, kwargs):
        outs = []
        for cache, (start, end) in zip(self.caches, self.bounds, strict=True):
            keys, values = cache.update(key[:, :, start:end], value[:, :, start:end], module.layer_idx)
            causal = None  # sdpa: causal by itself when queries and keys are the same span
            if base is eager_attention_forward:
                causal = torch.full((end - start, end - start), torch.finfo(query.dtype).min, device=query.device)
                causal = causal.triu(1)[None, None].to(query.dtype)
            span = query[:, :, start:end]
            engine = cache_engine(cache, module.layer_idx)
            if engine is None:
                out, _ = base(module, span, keys, values, causal, scaling=scaling, **kwargs)
            else:
                out, _ = engine.attend(base, module, span, keys, values, causal, scaling, kwargs)
            outs.append(out)
        return torch.cat(outs, dim=1), None  # [batch, tokens, heads, head_dim], as transformers' functions return


def _make_attention(base: Callable) -> Callable:
    def attention(module, query, key, value, attention_mask, scaling=None, attention_engine=None, **kwargs):
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        if attention_engine is None:
            return base(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        return attention_engine.attend(base, module, query, key, value, attention_mask, scaling, kwargs)

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
    other one ignores its `attention_engine` and would attend over one token): refuse to step
    without it."""
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
    a call that names no engine its policy layer's (`PolicyLayerEngine`); on exit both are undone
    and the model is as it came in. Nested blocks leave the switching to the outermost one."""
    if is_policy_attention(model):
        yield model
        return
    current = check_supported(model)
    _register()
    model.set_attn_implementation(PREFIX + current)
    handles = [
        module.register_forward_pre_hook(_hand_cache_engine, with_kwargs=True)
        for module in model.modules()
        if isinstance(getattr(module, "layer_idx", None), int) and hasattr(module, "q_proj")
    ]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(current)
