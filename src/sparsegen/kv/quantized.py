"""Keys and values held in 8 or 4 bits: each token's vector rounded in groups of channels.

A held token's key (or value) for one head becomes one row of bytes: its codes (one byte a number
at 8 bits, two numbers a byte at 4) followed by each group's fp16 scale and minimum. A row depends
on its own token only, so the cache's slots stay independent: eviction, slot reuse, compaction,
rows joining and leaving move byte rows exactly as they move float rows, and nothing is ever
rounded twice. KIVI rounds keys per channel across tokens; that ties a token's codes to the
group of tokens it was rounded with, which eviction breaks up, so keys are rounded per token here,
as transformers' quantized cache does by default. As KIVI does, the newest `RESIDUAL` tokens of
each row are also kept at full precision, in a ring indexed by position, and read from there
while they are that new (with per-token groups alone, int4 keys moved SmolLM2's perplexity by
+2.9% token by token; with the ring, +0.4%); so are all the tokens a forward reads itself (a
prompt chunk longer than the ring).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsegen.errors import SparsegenError

BITS = (8, 4)
SCALE_BYTES = 4
"""A group's fp16 scale and fp16 minimum."""
RESIDUAL = 32
"""The newest tokens of a row read at full precision (KIVI's residual; its group size)."""


@dataclass(frozen=True)
class KVCodec:
    """How a head's key or value vector of `dim` numbers is stored: `bits` (8 or 4) a number,
    asymmetric rounding in groups of `group` channels (the largest divisor of `dim` up to 32)."""

    bits: int
    group: int = 32

    def __post_init__(self) -> None:
        checked_bits(self.bits)

    @classmethod
    def for_dim(cls, bits: int, dim: int) -> KVCodec:
        group = next(g for g in range(min(32, dim), 0, -1) if dim % g == 0)
        return cls(bits, group)

    def width(self, dim: int) -> int:
        """Bytes of one stored vector of `dim` numbers."""
        return dim * self.bits // 8 + dim // self.group * SCALE_BYTES

    def dim_of(self, width: int) -> int:
        """The vector length a stored row of `width` bytes holds."""
        return width * 8 * self.group // (self.bits * self.group + 8 * SCALE_BYTES)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] floats -> [..., width(dim)] bytes."""
        *lead, dim = x.shape
        groups = x.float().reshape(*lead, dim // self.group, self.group)
        low = groups.amin(-1, keepdim=True).half()
        levels = (1 << self.bits) - 1
        scale = ((groups.amax(-1, keepdim=True) - low.float()) / levels).clamp_min(1e-5).half()
        codes = ((groups - low.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
        codes = codes.reshape(*lead, dim)
        if self.bits == 4:
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        params = torch.cat([scale, low], -1).reshape(*lead, dim // self.group * 2).view(torch.uint8)
        return torch.cat([codes, params], -1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[..., width] bytes -> [..., dim] numbers in `dtype`."""
        *lead, width = rows.shape
        dim = self.dim_of(width)
        code_bytes = dim * self.bits // 8
        codes = rows[..., :code_bytes]
        if self.bits == 4:
            codes = torch.stack([codes & 15, codes >> 4], -1)
        codes = codes.reshape(*lead, dim // self.group, self.group).float()
        params = rows[..., code_bytes:].contiguous().view(torch.float16).float()
        params = params.reshape(*lead, dim // self.group, 2, 1)
        return (codes * params[..., 0, :] + params[..., 1, :]).reshape(*lead, dim).to(dtype)


def remember(recent: torch.Tensor, states: torch.Tensor, positions: torch.Tensor) -> None:
    """Write new tokens' keys or values [b, h, n, d] at `positions` [b, h, n] into the ring
    `recent` [b, h, RESIDUAL, d] (slot = position mod RESIDUAL; only the newest RESIDUAL land)."""
    size = recent.shape[2]
    states, positions = states[:, :, -size:], positions[:, :, -size:]
    index = positions.remainder(size).unsqueeze(-1).expand(*positions.shape, states.shape[-1])
    recent.scatter_(2, index, states.to(recent.dtype))


def with_residual(
    decoded: torch.Tensor,
    positions: torch.Tensor,
    seen: int | torch.Tensor,
    recent: torch.Tensor,
    head_of: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decoded` held rows [b, h, n, d] with the slots whose position is among each row's newest
    RESIDUAL (of `seen` tokens) read from the ring instead. `head_of` tags the slots of heads held
    flat (`kv.ragged`: h = 1, the ring's heads side by side)."""
    size = recent.shape[2]
    newest = (positions >= 0) & (positions >= seen - size)
    index = positions.remainder(size)
    if head_of is not None:
        index, recent = index + head_of * size, recent.reshape(recent.shape[0], 1, -1, recent.shape[-1])
    ring = recent.gather(2, index.unsqueeze(-1).expand(*index.shape, recent.shape[-1]))
    return torch.where(newest.unsqueeze(-1), ring.to(decoded.dtype), decoded)


def checked_bits(bits: int | None) -> int | None:
    """`bits` if sparsegen can hold KV in that many (None: full precision); else a one-line error."""
    if bits is not None and bits not in BITS:
        raise SparsegenError(f"kv_bits must be one of {BITS} (or None for full precision), got {bits!r}")
    return bits


def codec_for(bits: int | None, dim: int) -> KVCodec | None:
    """The codec for `bits` (None: keys and values stay at full precision)."""
    return None if bits is None else KVCodec.for_dim(bits, dim)
