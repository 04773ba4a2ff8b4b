"""The attention of a prompt read on a CPU: `sparsegen::span_attention` (the C++ kernel in
`kernels/span_attention.h`; in bf16 2-4x torch's flash attention from 48 to 4,096 tokens, in fp32
1.1-2.3x up to 1,024: docs/benchmarks.md, "Prompt reads") wherever sdpa would run plain causal
attention, of a fresh prompt or of a chunk after the keys a cache holds, sdpa itself everywhere
else, and in bf16 where the CPU has AMX (torch's flash attention multiplies on its tiles: 2.0-2.3x
the kernel from 128 to 512 tokens on an Intel Xeon, docs/benchmarks.md). Policy attention
(`kv.attention`) runs this in sdpa's place."""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sparsegen.kernels import load_float_rows
from sparsegen.models import cpu_flags

DIM_MULTIPLE = 16
"""Head sizes the kernel takes: whole vectors of 16 lanes (every model here: 64, 128, 256)."""
FLOAT_SPAN_MAX = 1024
"""The most fp32 keys the kernel takes: past them its keys and scores leave the L2 cache and
torch's flash attention, which walks the keys in blocks, is as fast (docs/benchmarks.md)."""


def sdpa_or_span(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """sdpa's attention (same arguments, same result up to the order of sums): the kernel where sdpa
    would attend plain causally, each query to the keys up to its own among the last keys (no mask
    and as many keys as queries, or a boolean mask of just that; no dropout, softcap or position
    bias) on bf16 CPU tensors without AMX (fp32 up to `FLOAT_SPAN_MAX` keys), eagerly and with no
    gradient; sdpa otherwise."""
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if _takes_span(module, query, key, value, attention_mask, dropout, is_causal, kwargs):
        op = torch.ops.sparsegen.span_attention
        out = torch.stack([op(q, k, v, scaling) for q, k, v in zip(query, key, value, strict=True)])
        return out.transpose(1, 2).contiguous(), None  # [batch, queries, heads, dim], as sdpa's returns
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def _takes_span(module, query, key, value, mask, dropout, is_causal, kwargs) -> bool:
    if torch.compiler.is_compiling():
        return False  # a traced graph keeps sdpa, and no guard on the shapes below
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    queries, keys = query.shape[2], key.shape[2]
    plain = causal and dropout == 0 and 1 < queries <= keys
    if not plain or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return False  # a decode step's single query leaves here
    if query.dtype == torch.bfloat16 and "amx_bf16" in cpu_flags():
        return False  # torch's flash attention runs on AMX's tiles
    tensors = (query, key, value)
    dtype = torch.bfloat16 if query.dtype == torch.bfloat16 or keys > FLOAT_SPAN_MAX else torch.float32
    cpu = all(t.is_cpu and t.dtype == dtype for t in tensors) and query.shape[-1] % DIM_MULTIPLE == 0
    wants_gradient = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not cpu or wants_gradient or not _bottom_right_causal(mask, queries, keys):
        return False
    return load_float_rows() is not None


def _bottom_right_causal(mask: torch.Tensor | None, queries: int, keys: int) -> bool:
    """Whether `mask` lets query i see exactly the keys up to its own place among the last `queries`
    keys, in every row: no mask over the queries' own keys (sdpa's causal, which aligns top-left, so
    only with as many keys as queries), or transformers' boolean mask of a chunk read after a
    cache's keys; not padding, a window or a float mask. Checked by value (a boolean per score,
    a few percent of the attention's time), since nothing else says what a mask holds."""
    if mask is None:
        return queries == keys
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2:] != (queries, keys):
        return False
    columns = torch.arange(keys, device=mask.device)
    return bool((mask == (columns <= columns[keys - queries :, None])).all())
