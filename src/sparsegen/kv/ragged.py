"""Head-adaptive layers: one budget per layer shared by its KV heads, held in exactly its bytes.

When heads keep different numbers of tokens (AdaKV, DuoAttention), a [b, h, n, d] buffer would
hold the largest head's count for every head. Instead the layer flattens its heads: keys and
values are [b, 1, T, d] with a head tag per slot, T the layer's total budget (the largest row's,
where rows keep different totals: the others hold free slots, so rows stack). Each query attends
to the slots of its own KV head, under a mask: attention reads T slots per query instead of T / h,
for memory that is the budget's and no more.
Head-adaptive policies compress the prompt once (prefill-only); later tokens are appended h at a
time, one slot per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsegen.kv.store import EMPTY


def select_across_heads(priority: torch.Tensor, per_head: int | torch.Tensor) -> torch.Tensor:
    """Which slots a layer keeps when its heads share `per_head * h` slots (an int, or one count
    per row [b, 1, 1]): the highest priorities of the whole layer, per row. priority [b, h, n] ->
    bool [b, h, n]."""
    b, h, n = priority.shape
    per_row = isinstance(per_head, torch.Tensor)
    most = int(per_head.max()) if per_row else per_head
    chosen = priority.reshape(b, h * n).topk(most * h, dim=-1).indices
    keep = torch.zeros(b, h * n, dtype=torch.bool, device=priority.device)
    if not per_row:
        return keep.scatter_(1, chosen, True).view(b, h, n)
    taken = torch.arange(most * h, device=priority.device) < per_head.view(b, 1) * h  # each row's own count
    return keep.scatter_(1, chosen, taken).view(b, h, n)


def pack(tensors: dict[str, torch.Tensor], keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """The kept slots of per-head tensors ([b, h, n] or [b, h, n, d]) as one flat head [b, 1, T, ...],
    plus `head_of` [b, 1, T]; T the most any row keeps, a row that keeps fewer holding free slots
    after its own (position `EMPTY`, tagged by head in turn, so that a step can fill them)."""
    b, h, n = keep.shape
    flat = keep.reshape(b, h * n)
    counts = flat.sum(1)
    total = int(counts.max())
    index = (~flat).to(torch.uint8).argsort(dim=1, stable=True)[:, :total]  # row-major: heads in order
    free = torch.arange(total, device=keep.device) >= counts.unsqueeze(1)
    head_of = torch.where(free, torch.arange(total, device=keep.device) % h, index // n)
    packed = {"head_of": head_of.unsqueeze(1)}
    for name, tensor in tensors.items():
        rest = tensor.shape[3:]
        source = tensor.reshape(b, h * n, *rest)
        gather_index = index.view(b, total, *([1] * len(rest))).expand(b, total, *rest)
        packed[name] = source.gather(1, gather_index).unsqueeze(1)
    if bool(free.any()):
        packed["positions"] = packed["positions"].masked_fill(free.unsqueeze(1), EMPTY)
    return packed


def spread(new: torch.Tensor) -> torch.Tensor:
    """New tokens' per-head tensor [b, h, n, ...] as flat slots [b, 1, n * h, ...], token-major."""
    b, h, n = new.shape[:3]
    return new.transpose(1, 2).reshape(b, 1, n * h, *new.shape[3:])


def new_head_tags(b: int, h: int, n: int, device: torch.device) -> torch.Tensor:
    """`head_of` for `spread` tokens: [b, 1, n * h]."""
    return torch.arange(h, device=device).repeat(n).expand(b, 1, n * h)


def visible(
    head_of: torch.Tensor, positions: torch.Tensor, query_heads: int, kv_heads: int, query_positions: torch.Tensor
) -> torch.Tensor:
    """Which flat slots (tagged by `head_of`, at `positions` [b, 1, T], free where negative) each
    query head sees: its KV head's held slots at or before the query's position (`query_positions`
    broadcast to [b, 1, q, 1]). Returns bool [b, hq, q, T]: the one mask of flat attention, in the
    drop-in cache and the fast path."""
    group = query_heads // kv_heads
    own_head = torch.arange(query_heads, device=head_of.device).div(group, rounding_mode="floor").view(1, -1, 1, 1)
    at = positions.unsqueeze(2)
    return (head_of.unsqueeze(2) == own_head) & (at >= 0) & (at <= query_positions)


def attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of query [b, hq, q, d] over flat slots keys/values [b, 1, T, d], each query seeing
    the slots `mask` [b, hq, q, T] marks (`visible`). Returns [b, q, hq, d], as transformers'
    attention functions do."""
    b, hq = query.shape[:2]
    out = F.scaled_dot_product_attention(
        query,
        keys.expand(b, hq, *keys.shape[2:]).to(query.dtype),
        values.expand(b, hq, *values.shape[2:]).to(query.dtype),
        attn_mask=mask,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous()


def unpack(
    tensors: dict[str, torch.Tensor], head_of: torch.Tensor, kv_heads: int, fills: dict[str, float]
) -> dict[str, torch.Tensor]:
    """Flat slots back to per-head tensors [b, h, W, ...], W the largest head's count, each head's
    slots in their flat order and the rest `fills[name]` (the fast path's fixed-shape slots)."""
    b, _, total = head_of.shape
    tags = head_of[:, 0]
    order = tags.argsort(dim=-1, stable=True)
    heads = tags.gather(1, order)
    counts = F.one_hot(tags, kv_heads).sum(1)  # [b, h]
    starts = counts.cumsum(-1) - counts
    rank = torch.arange(total, device=tags.device) - starts.gather(1, heads)
    rows = torch.arange(b, device=tags.device)[:, None].expand(b, total)
    width = int(counts.max())
    out = {}
    for name, tensor in tensors.items():
        rest = tensor.shape[3:]
        source = tensor[:, 0].gather(1, order.view(b, total, *([1] * len(rest))).expand(b, total, *rest))
        spread_out = tensor.new_full((b, kv_heads, width, *rest), fills[name])
        spread_out[rows, heads, rank] = source
        out[name] = spread_out
    return out


def per_head(head_of: torch.Tensor, positions: torch.Tensor, kv_heads: int) -> list[list[list[int]]]:
    """Sorted positions each (row, head) holds: [b][h] lists (free slots left out)."""
    held = positions >= 0
    return [
        [sorted(positions[row, 0][(head_of[row, 0] == head) & held[row, 0]].tolist()) for head in range(kv_heads)]
        for row in range(positions.shape[0])
    ]
