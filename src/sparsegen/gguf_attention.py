"""A GGUF model's attention projections that share a block format, run as one product.

A decode step's query, key and value products are small (the default model's key and value rows are
62 KB of Q4_1 blocks each) and most of such a product's time is its call: rounding the input to int8,
the threads' fork and join, the dispatch (`quant.gguf_blocks.GGUFLinear.joined`). The loader gives each
known attention module whose projections are GGUF blocks one joined layer per block format among
them (the default model: q, k and v in Q4_1; the 1.5B model: q and k in Q4_K, v alone in Q6_K) and a
forward that runs those, then the model's own attention from the point where the queries, keys and
values exist (`contextual.attend.attend`: norms, rotary, the cache, the registered attention
function). The separate projections stay, their blocks views of the joined ones, for the code that
runs them one by one (the contextual heads, TEAL, the hooks that read them).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from sparsegen.contextual.attend import attend, rotary
from sparsegen.quant.gguf_blocks import GGUFLinear

ATTENTION_CLASSES = frozenset({"LlamaAttention", "Qwen2Attention", "MistralAttention"})
"""Attention modules whose forward is q/k/v projections, rotary, the cache, attention, o_proj (as `attend`
runs it); others (Gemma's soft-capping) keep their own."""
PROJECTIONS = ("q_proj", "k_proj", "v_proj")
JOIN = "__"
"""Joins the projection names of a joined layer's key in `joined_projections`."""


def projection_groups(attention: nn.Module) -> list[tuple[str, ...]]:
    """`attention`'s q/k/v projection names grouped by block format, where at least two share one."""
    if type(attention).__name__ not in ATTENTION_CLASSES:
        return []
    layers = {name: getattr(attention, name, None) for name in PROJECTIONS}
    if not all(isinstance(layer, GGUFLinear) and layer.on_kernel for layer in layers.values()):
        return []
    groups: dict[tuple, list[str]] = {}
    for name, layer in layers.items():
        groups.setdefault((layer.qtype, layer.paneled), []).append(name)
    return [tuple(names) for names in groups.values() if len(names) > 1]


def join_projections(model: nn.Module) -> int:
    """Give each attention module of `model` with projections to join (`projection_groups`) its joined
    layers (`joined_projections`) and the forward that runs them; returns how many modules changed."""
    changed = 0
    for module in model.modules():
        groups = projection_groups(module)
        if not groups:
            continue
        joined = {JOIN.join(names): GGUFLinear.joined([getattr(module, name) for name in names]) for names in groups}
        module.joined_projections = nn.ModuleDict(joined)
        module.forward = types.MethodType(joined_forward, module)
        changed += 1
    return changed


def joined_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention module's forward with its joined projections: one product per block format."""
    shape = hidden_states.shape[:-1]
    states = {}
    for key, layer in self.joined_projections.items():
        names = key.split(JOIN)
        pieces = layer(hidden_states).split([getattr(self, name).out_features for name in names], -1)
        states.update(zip(names, pieces, strict=True))
    for name in PROJECTIONS:
        if name not in states:
            states[name] = getattr(self, name)(hidden_states)
    query, key, value = (states[name].view(*shape, -1, self.head_dim).transpose(1, 2) for name in PROJECTIONS)
    out, weights = attend(self, rotary(self), query, key, value, position_embeddings, attention_mask, cache, **kwargs)
    return self.o_proj(out.reshape(*shape, -1).contiguous()), weights
