"""The bytes a model's KV takes: a token's keys and values over all layers, in the decoder's dtype
or rounded to `kv_bits` (`kv.quantized`), and a row's, with the ring of its newest tokens; what
admission, the benches and the memory bounds count."""

from __future__ import annotations

import torch

from sparsegen.kv.quantized import RING_SLOTS, codec_for


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype = torch.float32, kv_bits: int | None = None) -> int:
    """Bytes one token's keys and values take over all layers, stored as `dtype` (the decoder's
    slots are fp32 by default) or in `kv_bits` (`kv.quantized`): what admission and memory
    bounds count."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    codec = codec_for(kv_bits, head_dim)
    vector = head_dim * (torch.finfo(dtype).bits // 8) if codec is None else codec.width(head_dim)
    return 2 * config.num_hidden_layers * heads * vector


def kv_ring_bytes(model: torch.nn.Module, kv_bits: int | None, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the full-precision ring of first and newest tokens a row rounded to `kv_bits` keeps
    beside its slots (`RING_SLOTS` tokens in `dtype`); none at full precision."""
    return 0 if kv_bits is None else RING_SLOTS * kv_bytes_per_token(model, dtype)


def kv_row_bytes(model: torch.nn.Module, tokens: int, kv_bits: int | None = None) -> int:
    """Bytes of KV a row holding `tokens` takes in the decoder's slots (fp32, or `kv_bits` plus its ring)."""
    return tokens * kv_bytes_per_token(model, kv_bits=kv_bits) + kv_ring_bytes(model, kv_bits)
