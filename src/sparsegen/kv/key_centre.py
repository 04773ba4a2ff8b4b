"""Each layer's key centre: the constant share of its keys that a KV codec takes off before rounding.

A key-projection bias b (Qwen2 and Qwen2.5 carry one; the 1.5B's first layer reaches 354 in one
channel) is added to every token's key before RoPE turns each channel pair by its position's
angle. In the slowest bands the angle barely moves over a context, so the bias stays a large
constant there, and rounded per token it sets each group's step for numbers a hundred times
smaller (int4 KV multiplied the 1.5B's perplexity by 41). The centre is, pair by pair, the constant
nearest to b turned by every position 0..P (least squares, P the model's positions): b scaled by
the mean cosine and sine of the pair's angle. It is b itself in the slow bands and fades to 0 where
RoPE turns b around many times. Derived from the weights alone, so a cache of the same model
always rounds the same way; what is taken off is put back on decoding, so the centre's value
touches only how finely keys are rounded, never what attention reads.
"""

from __future__ import annotations

import torch

from sparsegen.models import decoder_layers


def key_centres(model: torch.nn.Module, inv_freq: torch.Tensor) -> list[torch.Tensor | None]:
    """Per decoder layer, its keys' centre [kv heads, head dim] (fp32), or None where the key
    projection has no bias or a norm follows it (Qwen3's, Gemma 3's: the bias is not added as is)."""
    config = model.config.get_text_config(decoder=True)
    reach = float(getattr(config, "max_position_embeddings", 0) or 4096)
    centres: list[torch.Tensor | None] = []
    for layer in decoder_layers(model):
        attention = getattr(layer, "self_attn", None)
        bias = getattr(getattr(attention, "k_proj", None), "bias", None)
        if not isinstance(bias, torch.Tensor) or getattr(attention, "k_norm", None) is not None:
            centres.append(None)
            continue
        head_dim = getattr(attention, "head_dim", None) or bias.numel() // config.num_key_value_heads
        centres.append(turned_mean(bias.detach().float().reshape(-1, head_dim), inv_freq.float(), reach))
    return centres


def turned_mean(bias: torch.Tensor, inv_freq: torch.Tensor, reach: float) -> torch.Tensor:
    """[h, d] biases, RoPE in the half-split layout over the first 2 * len(inv_freq) channels:
    each rotated pair (x, y) averaged over the angles 0..inv_freq * reach, the rest as it is."""
    half = inv_freq.numel()
    angle = inv_freq.to(bias.device) * reach
    mean_cos, mean_sin = torch.sin(angle) / angle, 2 * torch.sin(angle / 2).square() / angle  # 1 - cos, stably
    x, y, rest = bias[:, :half], bias[:, half : 2 * half], bias[:, 2 * half :]
    return torch.cat([x * mean_cos - y * mean_sin, x * mean_sin + y * mean_cos, rest], -1)
