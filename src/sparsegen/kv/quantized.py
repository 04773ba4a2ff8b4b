"""Keys and values held in 8, 4, 3 or 2 bits: each token's vector rotated, then rounded in groups of channels.

A held token's key (or value) for one head becomes one row of bytes: its codes (one byte a number
at 8 bits, two numbers a byte at 4, four at 2, eight in three bytes at 3) followed by each group's
fp16 scale and minimum. A row depends on its own token only, so the cache's slots stay
independent: eviction, slot reuse, compaction, rows joining and leaving move byte rows exactly as
they move float rows, and nothing is ever rounded twice. KIVI rounds keys per channel across
tokens; that ties a token's codes to the group of tokens it was rounded with, which eviction breaks
up, so keys are rounded per token here, as transformers' quantized cache does by default. As KIVI
does, the newest `RESIDUAL` tokens of each row are also kept at full precision, in a ring indexed
by position, and read from there while they are that new (with per-token groups alone, int4 keys
moved SmolLM2's perplexity by +2.9% token by token; with the ring, +0.4%); so are all the tokens
a forward reads itself (a prompt chunk longer than the ring). The same ring keeps each row's first
`SINKS` tokens for good, read from there at every step: attention sinks draw much of many heads'
attention, so their rounding error weighs on every later token, and their keys set the row's
centre (`row_centre`).

A `rotated` codec multiplies each vector by a fixed orthogonal matrix (`rotation`: a normalised
Hadamard transform with fixed random signs, QuaRot's and llama.cpp's) before rounding and by its
transpose after decoding: the rotation spreads a few large channels over all of them, so a group's
range, and with it the rounding step, shrinks. It lives inside the codec only: RoPE is applied
before the cache sees a key, and what attention and the policies' eviction scores read is the
decoded, un-rotated key or value, so it composes with every policy and position mode. The byte
products (`kv.kernels`) use q.k = (qM).(kM) and sum(p v M) M^T = sum(p v) instead of un-rotating
every row.

Keys are rounded less their row's centre (`row_centre`: the mean key of the row's first tokens
after the first, read from the ring) and decoded plus it. Keys share a large constant part that
varies little from token to token (RoPE barely turns its slowest channel pairs: Qwen2.5's key bias
there reaches 354); rounded per token it sets each group's step, and taking it off cuts the
rounding error of SmolLM2's keys by a third at 4, 3 and 2 bits (docs/benchmarks.md). The centre
is a row's own, fixed once its first `SINKS` tokens are written (no token rounded before that is
ever read from its bytes), and it travels with the row's ring through every move of rows, so
eviction and batching never change what a token decodes to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparsegen.errors import SparsegenError

BITS = (8, 4, 3, 2)
SCALE_BYTES = 4
"""A group's fp16 scale and fp16 minimum."""
RESIDUAL = 32
"""The newest tokens of a row read at full precision (KIVI's residual; its group size)."""
SINKS = 16
"""A row's first tokens, read at full precision for good; its centre is their mean key but the first's."""
RING_SLOTS = SINKS + RESIDUAL
"""Ring slots a row keeps: positions 0..SINKS-1 in slots 0..SINKS-1, then the newest RESIDUAL by
position mod RESIDUAL (`ring_index`)."""
SIGN_SEED = 0x5EED
"""The seed of the rotation's fixed signs: part of the stored format, never to change."""
CLIPS = {8: (1.0,), 4: (1.0,), 3: (1.0,), 2: (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)}
"""Per width, the shares of a group's range (about its middle) tried as its rounding range, the
one leaving the least squared error kept (within `CLIP_TOLERANCE`). At 2 bits a group's extremes
stretch its 4 levels far apart, and clipping them pays: on SmolLM2 (1,024 tokens, rotated, full
cache) +39% perplexity against fp32 KV fell to +7.5% on Milton, +53% to +15% on Paul Graham's
essays (docs/benchmarks.md). At 3 and 4 bits it did not: clipping to 0.9 helped on Milton and hurt
on the essays (int3 +2.7% -> +4.4%), so those widths keep min-max."""
CLIP_TOLERANCE = 1e-3
"""A narrower range is chosen only if it rounds with less squared error by more than this share,
so that float noise in a vector's last bits (another batch shape, another engine) never decides
between two ranges of nearly equal error."""


def rotation(dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The orthogonal [dim, dim] matrix M a rotated codec stores x @ M with: diag(signs) @ H, H the
    normalised Hadamard matrix over blocks of the largest power of two dividing `dim` (the whole
    vector at head dims 64 and 128; block-diagonal at 96 or 80), the signs fixed pseudo-random
    (`SIGN_SEED`). Built from plain ops (no generator, no cache), so a compiled step traces it."""
    block = dim & -dim
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    h = torch.block_diag(*[h] * (dim // block)) / math.sqrt(block)
    return torch.tensor(_signs(dim), device=device).unsqueeze(1) * h


def _signs(dim: int) -> list[float]:
    """`dim` fixed pseudo-random signs: the top bit of a 64-bit LCG (Knuth's MMIX constants)."""
    state, signs = SIGN_SEED, []
    for _ in range(dim):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        signs.append(-1.0 if state >> 63 else 1.0)
    return signs


def packing(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte unit of `bits`-bit codes: 8 -> (1, 1), 4 -> (2, 1),
    2 -> (4, 1), 3 -> (8, 3). A unit's codes are one little-endian integer, code j at bit j*bits."""
    codes = 8 // math.gcd(8, bits)
    return codes, codes * bits // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., dim] codes below 2**bits (uint8) -> [..., dim * bits / 8] bytes (`packing`)."""
    if bits == 8:
        return codes
    n, m = packing(bits)
    *lead, dim = codes.shape
    shifts = torch.arange(n, device=codes.device, dtype=torch.int32) * bits
    word = (codes.reshape(*lead, dim // n, n).int() << shifts).sum(-1, keepdim=True, dtype=torch.int32)
    octets = (word >> torch.arange(m, device=codes.device, dtype=torch.int32) * 8) & 255
    return octets.to(torch.uint8).reshape(*lead, dim // n * m)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack`'s inverse: [..., dim * bits / 8] bytes -> [..., dim] codes (uint8)."""
    if bits == 8:
        return packed
    n, m = packing(bits)
    *lead, size = packed.shape
    shifts = torch.arange(m, device=packed.device, dtype=torch.int32) * 8
    word = (packed.reshape(*lead, size // m, m).int() << shifts).sum(-1, keepdim=True, dtype=torch.int32)
    codes = (word >> torch.arange(n, device=packed.device, dtype=torch.int32) * bits) & ((1 << bits) - 1)
    return codes.to(torch.uint8).reshape(*lead, size // m * n)


@dataclass(frozen=True)
class KVCodec:
    """How a head's key or value vector of `dim` numbers is stored: `bits` (8, 4, 3 or 2) a number,
    asymmetric rounding in groups of `group` channels (the largest divisor of `dim` up to 32),
    after the `rotation` where `rotated`. Codecs that differ in any of those fields hold different
    bytes."""

    bits: int
    group: int = 32
    rotated: bool = True

    def __post_init__(self) -> None:
        checked_bits(self.bits)

    @classmethod
    def for_dim(cls, bits: int, dim: int, rotated: bool = True) -> KVCodec:
        """The codec for vectors of `dim` numbers; one-line error where `bits` cannot pack them."""
        unit = packing(checked_bits(bits))[0]
        if dim % unit:
            raise SparsegenError(
                f"{bits}-bit KV packs {unit} numbers at a time; head dim {dim} is not a multiple of {unit}"
            )
        group = next(g for g in range(min(32, dim), 0, -1) if dim % g == 0)
        return cls(bits, group, rotated)

    def width(self, dim: int) -> int:
        """Bytes of one stored vector of `dim` numbers."""
        return dim * self.bits // 8 + dim // self.group * SCALE_BYTES

    def dim_of(self, width: int) -> int:
        """The vector length a stored row of `width` bytes holds."""
        return width * 8 * self.group // (self.bits * self.group + 8 * SCALE_BYTES)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> x @ M in fp32 (`rotation`; x itself where not `rotated`)."""
        return x.float() @ rotation(x.shape[-1], x.device) if self.rotated else x.float()

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """`rotate`'s inverse: y @ M^T in fp32."""
        return y.float() @ rotation(y.shape[-1], y.device).T if self.rotated else y.float()

    def encode(self, x: torch.Tensor, centre: torch.Tensor | None = None) -> torch.Tensor:
        """[..., h, n, dim] floats -> [..., h, n, width(dim)] bytes, less `centre` [..., h, dim] first."""
        *lead, dim = x.shape
        if centre is not None:
            x = x.float() - centre.unsqueeze(-2)
        groups = self.rotate(x).reshape(*lead, dim // self.group, self.group)
        low, scale = self._ranges(groups)
        levels = (1 << self.bits) - 1
        codes = ((groups - low.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
        params = torch.cat([scale, low], -1).reshape(*lead, dim // self.group * 2).view(torch.uint8)
        return torch.cat([pack(codes.reshape(*lead, dim), self.bits), params], -1)

    def _ranges(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's fp16 minimum and step [..., groups, 1]: of the ranges `CLIPS[bits]` shrink
        its min-max range to, the widest whose rounding leaves within `CLIP_TOLERANCE` of the least
        squared error (a constant group keeps min-max and decodes exactly; min-max alone above 2
        bits)."""
        levels = (1 << self.bits) - 1
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        if len(CLIPS[self.bits]) == 1:  # min-max
            low = low.half()
            return low, ((high - low.float()) / levels).clamp_min(1e-5).half()
        shares = torch.tensor(CLIPS[self.bits], device=groups.device)
        middle, half = (low + high) / 2, (high - low) / 2
        lows = (middle - half * shares).half()  # [..., groups, clips]
        steps = ((middle + half * shares - lows.float()) / levels).clamp_min(1e-5).half()
        each, first = groups.unsqueeze(-2), lows.float().unsqueeze(-1)  # [..., groups, 1 | clips, group]
        rounded = ((each - first) / steps.float().unsqueeze(-1)).round_().clamp_(0, levels)
        error = (rounded * steps.float().unsqueeze(-1) + first - each).square_().sum(-1)
        near_best = error <= error.amin(-1, keepdim=True) * (1 + CLIP_TOLERANCE)
        best = near_best.int().argmax(-1, keepdim=True)  # the widest range within the tolerance
        return lows.gather(-1, best), steps.gather(-1, best)

    def decode(
        self,
        rows: torch.Tensor,
        dtype: torch.dtype = torch.float32,
        centre: torch.Tensor | None = None,
        head_of: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[..., h, n, width] bytes -> [..., h, n, dim] numbers in `dtype`, un-rotated, `centre`
        [..., h, dim] put back (with heads held flat, `centre` [b, heads, dim] and each slot's head's
        by `head_of` [b, 1, n])."""
        if centre is not None:
            if head_of is None:
                shift = centre.unsqueeze(-2)
            else:  # each slot its own head's: [b, 1, n, d]
                shift = centre[torch.arange(head_of.shape[0], device=head_of.device).view(-1, 1, 1), head_of]
            return (self.decode(rows) + shift).to(dtype)
        *lead, width = rows.shape
        dim = self.dim_of(width)
        code_bytes = dim * self.bits // 8
        codes = unpack(rows[..., :code_bytes], self.bits).reshape(*lead, dim // self.group, self.group).float()
        params = rows[..., code_bytes:].contiguous().view(torch.float16).float()
        params = params.reshape(*lead, dim // self.group, 2, 1)
        return self.unrotate((codes * params[..., 0, :] + params[..., 1, :]).reshape(*lead, dim)).to(dtype)

    def read(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        seen: int | torch.Tensor,
        recent: torch.Tensor,
        head_of: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        centre: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Held byte `rows` [b, h, n, width] at `positions` as numbers: decoded with their `centre`
        [b, h, d], each row's first and newest tokens (of `seen`) read from the `recent` ring at full
        precision instead (`with_residual`). The one quantized read of the drop-in cache and the fast path."""
        return with_residual(self.decode(rows, dtype, centre, head_of), positions, seen, recent, head_of)


def ring_index(positions: torch.Tensor) -> torch.Tensor:
    """The ring slot of each position [...]: a first token's own (0..SINKS-1), else SINKS + position
    mod RESIDUAL (a free slot's, position < 0, is 0: never read)."""
    return torch.where(positions < SINKS, positions.clamp_min(0), SINKS + positions.remainder(RESIDUAL))


def remember(recent: torch.Tensor, states: torch.Tensor, positions: torch.Tensor) -> None:
    """Write new tokens' keys or values [b, h, n, d] at `positions` [b, h, n] into the ring
    `recent` [b, h, RING_SLOTS, d] (`ring_index`): the newest RESIDUAL of them, and any of the first SINKS
    positions a longer chunk holds before those."""
    newest, at = states[:, :, -RESIDUAL:], positions[:, :, -RESIDUAL:]
    index = ring_index(at).unsqueeze(-1).expand(*at.shape, states.shape[-1])
    recent.scatter_(2, index, newest.to(recent.dtype))
    if states.shape[2] > RESIDUAL:  # a chunk: its first tokens may lie before its newest RESIDUAL
        match = positions.unsqueeze(-1) == torch.arange(SINKS, device=positions.device)  # [b, h, n, SINKS]
        where = match.int().argmax(2).unsqueeze(-1).expand(-1, -1, -1, states.shape[-1])
        first = states.gather(2, where).to(recent.dtype)
        recent[:, :, :SINKS] = torch.where(match.any(2).unsqueeze(-1), first, recent[:, :, :SINKS])


def row_centre(recent_keys: torch.Tensor) -> torch.Tensor:
    """Each row's key centre [b, h, d] (fp32) from its ring [b, h, RING_SLOTS, d]: the mean key of its
    positions 1..SINKS-1 (the first token, an attention sink, is often far from the others)."""
    return recent_keys[:, :, 1:SINKS].float().mean(2)


def with_residual(
    decoded: torch.Tensor,
    positions: torch.Tensor,
    seen: int | torch.Tensor,
    recent: torch.Tensor,
    head_of: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decoded` held rows [b, h, n, d] with the slots of each row's first SINKS positions and of
    its newest RESIDUAL (of `seen` tokens) read from the ring instead. `head_of` tags the slots of
    heads held flat (`kv.ragged`: h = 1, the ring's heads side by side)."""
    in_ring = (positions >= 0) & ((positions < SINKS) | (positions >= seen - RESIDUAL))
    index = ring_index(positions)
    if head_of is not None:
        index, recent = index + head_of * RING_SLOTS, recent.reshape(recent.shape[0], 1, -1, recent.shape[-1])
    ring = recent.gather(2, index.unsqueeze(-1).expand(*index.shape, recent.shape[-1]))
    return torch.where(in_ring.unsqueeze(-1), ring.to(decoded.dtype), decoded)


def checked_bits(bits: int | None) -> int | None:
    """`bits` if sparsegen can hold KV in that many (None: full precision); else a one-line error."""
    if bits is not None and bits not in BITS:
        raise SparsegenError(f"kv_bits must be one of {BITS} (or None for full precision), got {bits!r}")
    return bits


def codec_for(bits: int | None, dim: int, rotated: bool = True) -> KVCodec | None:
    """The codec for `bits` (None: keys and values stay at full precision), rotated: the rotation
    measured better or even at every width (docs/benchmarks.md, "Rotated KV")."""
    return None if bits is None else KVCodec.for_dim(bits, dim, rotated)
