"""The KV codec's round trip in float64 (`kv.quantized`), share by share: the reference its tests
compare the codec with."""

from __future__ import annotations

import torch

from sparsegen.kv.quantized import CLIP_TOLERANCE, CLIPS


def round_trip_reference(
    x: torch.Tensor, bits: int, group: int, r: torch.Tensor, shares: tuple[float, ...] | None = None
) -> torch.Tensor:
    """The codec's round trip in float64, share by share: rotate by `r`; per group of `group`
    numbers, of the ranges min-max shrunk about its middle by each share in CLIPS[bits], round to
    the widest leaving within CLIP_TOLERANCE of the least squared error (fp16 minimum and step);
    decode; un-rotate.
    `shares=(1.0,)`: min-max rounding."""
    y = x.double() @ r
    groups = y.reshape(*y.shape[:-1], -1, group)
    levels = (1 << bits) - 1
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    middle, half = (low + high) / 2, (high - low) / 2
    candidates = []
    for share in shares or CLIPS[bits]:
        first = (middle - half * share).half().double()
        step = ((middle + half * share - first) / levels).clamp_min(1e-5).half().double()
        back = ((groups - first) / step).round().clamp(0, levels) * step + first
        candidates.append((back, (back - groups).square().sum(-1, keepdim=True)))
    least = torch.stack([error for _, error in candidates]).amin(0)
    best = candidates[-1][0]
    for back, error in reversed(candidates):  # the widest range within the tolerance of the least error
        best = torch.where(error <= least * (1 + CLIP_TOLERANCE), back, best)
    return best.reshape(y.shape) @ r.T
