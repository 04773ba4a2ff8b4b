"""Keys and values held in 8 or 4 bits: each token's vector rounded in groups of channels.

A held token's key (or value) for one head becomes one row of bytes: its codes (one byte a number
at 8 bits, two numbers a byte at 4) followed by each group's fp16 scale and minimum. A row depends
on its own token only, so the cache's slots stay independent: eviction, slot reuse, compaction,
rows joining and leaving move byte rows exactly as they move float rows, and nothing is ever
rounded twice. KIVI rounds keys per channel across tokens; that ties a token's codes to the
group of tokens it was rounded with, which eviction breaks up, so keys are rounded per token here,
as transformers' quantized cache does by default. The tokens being read in the same forward (a
prompt, the token in flight) are attended at full precision, as KIVI's residual is; they are
stored rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsegen.errors import SparsegenError

BITS = (8, 4)
SCALE_BYTES = 4
"""A group's fp16 scale and fp16 minimum."""


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


def checked_bits(bits: int | None) -> int | None:
    """`bits` if sparsegen can hold KV in that many (None: full precision); else a one-line error."""
    if bits is not None and bits not in BITS:
        raise SparsegenError(f"kv_bits must be one of {BITS} (or None for full precision), got {bits!r}")
    return bits


def codec_for(bits: int | None, dim: int) -> KVCodec | None:
    """The codec for `bits` (None: keys and values stay at full precision)."""
    return None if bits is None else KVCodec.for_dim(bits, dim)
