"""One context's keys and values read once per step by every row that kept part of it.

A RULER sample's policies each keep a subset of the same context (`kv.shared.SharedPrefill`):
decoding them as copies reads every row's copy each step, tens of rows x thousands of tokens. Here
the rows' queries meet the context's keys in one product per head (a matrix product, not a
matrix-vector product per row), each row masked to the tokens its policy kept; the softmax runs
over those and the row's own tokens (question and answer) together, as over a copy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv.slots import EMPTY, HeldSlots, gather_slots


@dataclass
class ContextRows:
    """A context's keys and values [h, S, d], shared by the rows; live [b, h, S]: the context
    tokens each row holds."""

    keys: torch.Tensor
    values: torch.Tensor
    live: torch.Tensor

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def logits(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query [b, h, g, d] -> fp32 logits [b, h, g, S], -inf where a row does not hold the token."""
        b, h, g, d = query.shape
        flat = query.to(self.keys.dtype).transpose(0, 1).reshape(h, b * g, d)
        scores = (flat @ self.keys.transpose(-1, -2)).float().view(h, b, g, -1).transpose(0, 1)
        return (scores * scaling).masked_fill(~self.live.unsqueeze(2), float("-inf"))

    def mix(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [b, h, g, S] fp32 over the context -> [b, h, g, d] fp32."""
        b, h, g, n = probs.shape
        flat = probs.to(self.values.dtype).transpose(0, 1).reshape(h, b * g, n)
        return (flat @ self.values).float().view(h, b, g, -1).transpose(0, 1)

    def select(self, rows: torch.Tensor) -> None:
        self.live = self.live[rows].contiguous()

    def extend(self, other: ContextRows) -> None:
        if other.keys is not self.keys:
            raise SparsegenError("rows reading different shared contexts cannot share a batch: decode each apart")
        self.live = torch.cat([self.live, other.live])


def split_context(part: HeldSlots, length: int) -> tuple[torch.Tensor, HeldSlots]:
    """A prefilled part's context tokens (positions below `length`) as a mask [b, h, length], and
    the part holding only its own tokens after them (free slots where a row or head has fewer)."""
    positions = part.positions
    in_context = (positions >= 0) & (positions < length)
    b, h = positions.shape[:2]
    counts = positions.new_zeros(b, h, length)
    counts.scatter_add_(2, torch.where(in_context, positions, 0), in_context.long())
    own = positions >= length
    order = (~own).to(torch.uint8).argsort(dim=-1, stable=True)[..., : int(own.sum(-1).max())]
    kept = own.gather(2, order)
    tokens = {name: gather_slots(getattr(part, name), order) for name in ("keys", "values", "scores")}
    tokens["positions"] = torch.where(kept, positions.gather(2, order), EMPTY)
    return counts > 0, replace(part, **tokens)
