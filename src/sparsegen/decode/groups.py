"""Rows of several policies in one decode step: each policy's rows keep a `LayerState` of their own.

A RULER sample decodes every policy x ratio over the same question; as one batch per policy, each
step reads the model's weights once per policy (4-row batches are bound by reading the weights).
Here one forward carries every row: each layer hands each group its rows' keys, values and
queries, and gathers their outputs back in batch order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsegen.decode.state import LayerState
from sparsegen.errors import SparsegenError


@dataclass
class RowGroups:
    """One layer's rows in groups: `groups[i]` holds the batch rows `rows[i]` (in that order)."""

    groups: list[LayerState]
    rows: list[torch.Tensor]

    def parts(self) -> list[LayerState]:
        return self.groups

    def write(self, key: torch.Tensor, value: torch.Tensor, position: torch.Tensor) -> None:
        for group, rows in zip(self.groups, self.rows, strict=True):
            group.write(key[rows], value[rows], position[rows])

    def attend(self, query: torch.Tensor, scaling: float, seen: torch.Tensor) -> torch.Tensor:
        b, hq, _, d = query.shape
        out = query.new_empty(b, 1, hq, d)
        for group, rows in zip(self.groups, self.rows, strict=True):
            out[rows] = group.attend(query[rows], scaling, seen[rows])
        return out

    def select(self, keep: torch.Tensor) -> None:
        """Keep only batch rows `keep` (indices, in that order); a group left without rows goes."""
        owner = {row: (index, local) for index, rows in enumerate(self.rows) for local, row in enumerate(rows.tolist())}
        picks: list[list[int]] = [[] for _ in self.groups]
        places: list[list[int]] = [[] for _ in self.groups]
        for place, row in enumerate(keep.tolist()):
            index, local = owner[row]
            picks[index].append(local)
            places[index].append(place)
        device = self.rows[0].device
        kept = [(group, pick, place) for group, pick, place in zip(self.groups, picks, places, strict=True) if pick]
        for group, pick, _ in kept:
            group.select(torch.tensor(pick, device=device))
        self.groups = [group for group, _, _ in kept]
        self.rows = [torch.tensor(place, device=device) for _, _, place in kept]

    def extend(self, other) -> None:
        raise SparsegenError("rows join a batch of one policy's rows only (decode one group of policies at a time)")

    def hand_back(self, row: int, seen: int, layer, dtype: torch.dtype) -> None:
        raise SparsegenError("a row decoded among other policies' rows holds no cache of its own to hand back")

    def kv_bytes(self) -> int:
        return sum(group.kv_bytes() for group in self.groups)

    def live_tokens(self) -> torch.Tensor:
        b = sum(rows.numel() for rows in self.rows)
        out = torch.zeros(b, dtype=torch.long, device=self.rows[0].device)
        for group, rows in zip(self.groups, self.rows, strict=True):
            out[rows] = group.live_tokens()
        return out
