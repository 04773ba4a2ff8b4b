"""Rolling positions: give held keys positions within the cache by rotating them by a delta.

RoPE composes (R(a) R(b) = R(a + b)), so a key stored as rotated to its original position p is
moved to position p' by one more rotation of p' - p. Stored keys never change; each step rotates a
fresh copy of the keys whose delta is non-zero, so rounding does not accumulate.

The query keeps its own position in the text. Positions within the cache are anchored so that
the newest held token keeps its own position; since RoPE depends only on query - key distances,
this equals StreamingLLM's numbering 0..size-1 with the query at `size`, and it leaves a
contiguous recent window untouched (only sinks and heavy hitters are rotated).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


TABLE_REACH = 32768
"""The longest delta a CPU looks up in `KeyRotation`'s table (34 MB at rotary dim 64, 67 at 128):
past it, a delta's angles are computed, so the table stops growing however long a stream runs."""


class KeyRotation:
    """Rotates keys by position deltas with a model's RoPE frequencies (half-split layout)."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq.detach().float()
        self.rotary_dim = 2 * self.inv_freq.numel()
        self._reach = 0
        self._table: torch.Tensor | None = None  # cos then sin [2 * reach + 1, 2 * rotary_dim] of deltas -reach..reach

    def cos_sin(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every delta's angles [..., rotary_dim]. On a CPU, eagerly, deltas within
        `TABLE_REACH` are looked up in a table of every delta so far (a step's deltas repeat:
        computing them was most of a rolling step's cost); a compiled graph and a GPU compute them
        (fused, or cheap there; the table's size check would stall a GPU), and so does a CPU for a
        longer delta (a stream's sinks, moved on by every token seen: a table reaching that far
        would grow with the stream: 4 GB by two million tokens)."""
        if torch.compiler.is_compiling() or not delta.is_cpu:
            return self._angles(delta)
        reach = int(delta.abs().max()) if delta.numel() else 0
        if reach > TABLE_REACH:
            return self._angles(delta)
        table, reach = self.table(reach)
        rows = table.index_select(0, (delta + reach).flatten()).view(*delta.shape, -1)
        return rows[..., : self.rotary_dim], rows[..., self.rotary_dim :]

    def table(self, reach: int) -> tuple[torch.Tensor, int]:
        """The cos then sin [2 * reach' + 1, 2 * rotary_dim] of every delta -reach'..reach', grown
        to cover `reach` (at most `TABLE_REACH`), and its reach'."""
        if self._table is None or reach > self._reach:
            self._reach = min(max(2 * reach, 1024), TABLE_REACH)
            self._table = torch.cat(self._angles(torch.arange(-self._reach, self._reach + 1)), -1)
        return self._table, self._reach

    def _angles(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angle = delta.unsqueeze(-1).float() * self.inv_freq.to(delta.device)
        return torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Rotate `keys` [..., head_dim] by `delta` positions (same leading shape)."""
        cos, sin = self.cos_sin(delta)
        rot, rest = keys[..., : self.rotary_dim].float(), keys[..., self.rotary_dim :]
        rotated = (rot * cos + rotate_half(rot) * sin).to(keys.dtype)
        return torch.cat((rotated, rest), -1) if rest.shape[-1] else rotated

    def roll_sinks(self, keys: torch.Tensor, shift: int | torch.Tensor) -> torch.Tensor:
        """A contiguous policy's sinks `keys` [b, h, s, d] moved by `shift` (an int, or [b, h, 1]):
        the tokens seen beyond those held. Such a policy holds the sinks and a run of the newest
        tokens, which keeps its own positions: `roll_deltas` of that layout, without ranking slots."""
        if isinstance(shift, int):
            return self.rotate(keys, torch.tensor(shift, device=keys.device))
        return self.rotate(keys, shift.expand(-1, -1, keys.shape[2]))

    def roll(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """`keys` [b, h, n, d] with those whose `delta` (`roll_deltas`) is not zero rotated by it:
        a copy (the stored keys never change), or `keys` themselves where none moves."""
        moved = delta.nonzero(as_tuple=True)
        if moved[0].numel() == 0:
            return keys
        out = keys.clone()
        out[moved] = self.rotate(keys[moved], delta[moved])
        return out


def roll_deltas(
    positions: torch.Tensor,
    seen: int | torch.Tensor,
    live: torch.Tensor | None = None,
    head_of: torch.Tensor | None = None,
) -> torch.Tensor:
    """How far each held key moves [b, h, n] from its original position (`positions`) to its
    place within the cache: the held tokens of each row and head in order, the newest at `seen - 1`
    (`seen`: tokens read, an int or [b, 1, 1]). Slots not `live` (free or unused; all live when
    None) do not move. `head_of` [b, 1, n] tags flat slots of heads sharing a budget (`kv.ragged`):
    each head rolls on its own. The one rule for rolling positions, in every path that holds keys."""
    live = torch.ones_like(positions, dtype=torch.bool) if live is None else live
    if head_of is not None:
        rank, count = _ranks_per_head(positions, seen, head_of, live)
        return torch.where(live, seen - count + rank - positions, 0)
    count = live.sum(-1, keepdim=True)
    return torch.where(live, seen - count + held_ranks(live, positions, seen) - positions, 0)


def held_ranks(live: torch.Tensor, positions: torch.Tensor, seen: int | torch.Tensor) -> torch.Tensor:
    """Each live slot's rank among its row's live slots by position [b, h, n]: on a CPU, eagerly,
    by counting the live positions below it (far cheaper than two sorts a layer each step); else
    by sorting (a traced graph; a GPU, which the count's size check would stall)."""
    if torch.compiler.is_compiling() or not positions.is_cpu:
        return torch.where(live, positions, torch.iinfo(torch.long).max).argsort(-1).argsort(-1)
    top = int(seen.max()) if isinstance(seen, torch.Tensor) else int(seen)  # above every held position
    index = torch.where(live, positions, top)
    marks = positions.new_zeros(*positions.shape[:2], top + 1).scatter_(2, index, live.long())
    return (marks.cumsum(-1) - marks).gather(2, index)


def _ranks_per_head(
    positions: torch.Tensor, seen: int | torch.Tensor, head_of: torch.Tensor, live: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each flat slot's rank among its head's `live` slots by position (the others after them),
    and its head's count of live slots [b, 1, n]. Every shape is the slots' (no head count read
    from the tensors), so a compiled step traces it whole."""
    order = (head_of * (seen + 1) + torch.where(live, positions, seen)).argsort(-1)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
    )
    heads = head_of.gather(-1, order).contiguous()  # sorted: each head's slots a run
    start = torch.searchsorted(heads, head_of.contiguous())
    end = torch.searchsorted(heads, head_of.contiguous(), right=True)
    held = torch.nn.functional.pad(live.gather(-1, order).long().cumsum(-1), (1, 0))
    return rank - start, held.gather(-1, end) - held.gather(-1, start)


def find_inv_freq(model: torch.nn.Module) -> torch.Tensor | None:
    """The RoPE inverse frequencies of a model's full-attention layers, or None without RoPE."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            inv_freq = getattr(module, "full_attention_inv_freq", None)
            if inv_freq is None:
                inv_freq = getattr(module, "inv_freq", None)
            if inv_freq is not None:
                return inv_freq
    return None
