"""Attention products over the held KV without a float copy of the cache.

`held_scores` is each query's dot product with each held key, `held_mix` the attention
probabilities times the held values, both over byte rows with the ring of first and newest tokens
(`kv.quantized`; 8 and 4 bits, `reads_bytes`; a rotated codec's rows are multiplied in its rotated
space, the query and ring rotated in and the mixed values rotated out); `rolled_scores` the products
with full-precision keys rotated to rolling positions on the fly (`kv.rope`); `slot_attention` a
decode step's whole attention over fp32 or fp16 slots (scores, softmax and value sum in one pass, free
slots never read). Ops registered with torch's
dispatcher from C++ (`kernels/kv_int.cpp`; one opaque call in a compiled step, with a meta implementation
for tracing; callable once `kernels_available()`) that decode or rotate one row at a time into a
buffer that stays in L1.
The C++ is built on first use with the machine's compiler; where it cannot be built
(`kernels_available()` is False, said once; `sparsegen.kernels`) the fast path decodes or rotates
the whole cache and multiplies in torch instead.
"""

from __future__ import annotations

import torch

from sparsegen.kernels import load_kv_int
from sparsegen.kv.quantized import SINKS, KVCodec, row_centre
from sparsegen.kv.rope import TABLE_REACH, KeyRotation

KERNEL_BITS = (8, 4)
"""The widths the C++ products read; rows in other widths are decoded in torch."""


def kernels_available() -> bool:
    """Whether the C++ products are built (on a CPU; a GPU decodes in torch)."""
    return load_kv_int() is not None


def reads_bytes(codec: KVCodec) -> bool:
    """Whether `held_scores` and `held_mix` read `codec`'s rows (else the caller decodes them)."""
    return codec.bits in KERNEL_BITS


def _slots(positions: torch.Tensor, seen: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [b, h, n] and seen (one count a row) as the kernels read them."""
    seen = torch.as_tensor(seen, device=positions.device).reshape(-1).expand(positions.shape[0])
    return positions.contiguous(), seen.long().contiguous()


def held_scores(query, keys, codec: KVCodec, positions, seen, recent_keys) -> torch.Tensor:
    """query [b, h, g, d] . every slot's key as read (`kv.quantized.with_residual`): a slot of one
    of its row's first or newest tokens (of `seen`) from the ring `recent_keys` [b, h, RING_SLOTS, d],
    the others decoded; 0 at free slots. fp32 [b, h, g, n]. Rows held less their row's key centre c
    (`row_centre`) are multiplied as they are and q.c added to their products inside the kernel (the
    ring's keys are whole)."""
    positions, seen = _slots(positions, seen)
    # q.c [b, h, g], one per query and head (a product and a sum: as a matmul, the step recompiled as rows varied)
    shift = (query.float() * row_centre(recent_keys).unsqueeze(-2)).sum(-1)
    rotated, ring = (codec.rotate(t).contiguous() for t in (query, recent_keys.float()))  # q.k = (qM).(kM)
    return torch.ops.sparsegen.kv_scores(
        rotated, keys, ring, positions, seen, shift.contiguous(), codec.bits, codec.group, SINKS
    )


def held_mix(probs, values, codec: KVCodec, positions, seen, recent_values) -> torch.Tensor:
    """probs [b, h, g, n] x every slot's value as read (the first and newest from the ring
    `recent_values` [b, h, RING_SLOTS, d], the others decoded; free slots skipped): fp32 [b, h, g, d]."""
    positions, seen = _slots(positions, seen)
    ring = codec.rotate(recent_values).contiguous()
    probs = probs.float().contiguous()
    mixed = torch.ops.sparsegen.kv_mix(probs, values, ring, positions, seen, codec.bits, codec.group, SINKS)
    return codec.unrotate(mixed)  # sum(p vM) M^T = sum(p v)


def rolled_scores(query: torch.Tensor, keys: torch.Tensor, delta: torch.Tensor, rotation: KeyRotation) -> torch.Tensor:
    """query [b, h, g, d] . every fp32 key [b, h, n, d] rotated by its delta [b, h, n] (rolling
    positions, `kv.rope`), without writing the rotated keys: fp32 [b, h, g, n]. A delta past the
    table's `TABLE_REACH` (a heavy hitter kept from far back in a long stream) rotates the keys."""
    reach = int(delta.abs().max()) if delta.numel() else 0
    if reach > TABLE_REACH:
        return query.float() @ rotation.rotate(keys, delta).float().transpose(-1, -2)
    table, reach = rotation.table(reach)
    return torch.ops.sparsegen.rolled_scores(query.float().contiguous(), keys, delta.contiguous(), table, reach)


def slot_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scaling: float
) -> torch.Tensor:
    """softmax(scaling * query [b, h, g, d] . keys [b, h, n, d]) . values over each row's live
    slots (positions [b, h, n] >= 0; keys and values fp32 or fp16), fp32 [b, h, g, d]: one call
    for what is otherwise two products, a mask and a softmax over every slot."""
    return torch.ops.sparsegen.slot_attention(
        query.float().contiguous(), keys.contiguous(), values.contiguous(), positions.contiguous(), scaling
    )
