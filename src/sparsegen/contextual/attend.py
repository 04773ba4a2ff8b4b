"""The attention forward that the sparse attention modules share: transformers' own, from the point
where the queries, keys and values exist (norms, rotary, the cache, the registered attention function)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from sparsegen.kv.attention import cache_engine


def rotary(attention: nn.Module) -> Callable:
    """The model's own `apply_rotary_pos_emb` (found in the attention class's module)."""
    return sys.modules[type(attention).__module__].apply_rotary_pos_emb


def attend(
    attention: nn.Module,
    rotate: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attention`'s output before o_proj [b, t, heads, head_dim] and its weights, from query, key and
    value [b, heads, t, head_dim] as the projections give them. A policy cache's layer goes to the
    attention function as its `attention_engine`, as the hook of `kv.attention` passes it to the
    module this one replaces."""
    if hasattr(attention, "q_norm"):
        query, key = attention.q_norm(query), attention.k_norm(key)
    query, key = rotate(query, key, *position_embeddings)
    if cache is not None:
        key, value = cache.update(key, value, attention.layer_idx)
    config = attention.config
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)
    engine = cache_engine(cache, attention.layer_idx)
    if engine is not None:
        kwargs["attention_engine"] = engine
    kwargs.setdefault("sliding_window", getattr(attention, "sliding_window", getattr(config, "sliding_window", None)))
    return interface(attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling, **kwargs)
