"""Preallocated, fixed-shape KV buffers for the decode step, and one attention call over them.

Each attention layer holds `capacity` slots per row and KV head. A slot's position is the token's
position in its row's text, or `EMPTY` (free), or `DEAD` (beyond this row's budget, never used):
rows of different lengths and budgets share one shape, and padding never enters a cache. A step
writes the new token into `slot` (chosen by the last step), attends over every live slot, lets
the policy score, and picks the next slot: the first free one, else the lowest keep-priority (the
eviction). Every shape is fixed, so one compiled graph serves every later token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsegen.kv.base import KEEP, Policy, Sizes, Step
from sparsegen.kv.rope import KeyRotation

EMPTY = -1
DEAD = -2


def scores_of(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """query [b, h, g, d] . keys [b, h, n, d] -> [b, h, g, n], computed in fp32 (CPUs without bf16
    instructions run bf16 matmuls far slower than converting first)."""
    return query.float() @ keys.float().transpose(-1, -2)


def weighted_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs [b, h, g, n] fp32 . values [b, h, n, d] -> [b, h, g, d] in fp32."""
    return probs @ values.float()


@dataclass
class LayerState:
    """One attention layer's slots: keys/values [b, h, C, d], positions/scores [b, h, C], slot [b, h, 1].

    `evicting` layers score and evict each step; the others keep every token (dense, or a
    prefill-only policy after its compression). `rotation` is set for rolling positions;
    `sinks` > 0 with `contiguous` rotates only slots [0, sinks), which hold the first tokens.
    """

    policy: Policy
    sizes: Sizes
    evicting: bool
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    slot: torch.Tensor
    rotation: KeyRotation | None = None
    contiguous: bool = False
    sinks: int = 0

    def write(self, key: torch.Tensor, value: torch.Tensor, position: torch.Tensor) -> None:
        """Put the new token's key/value [b, h, 1, d] at `position` [b] into each row's free slot."""
        b, h, _, d = key.shape
        index = self.slot.unsqueeze(-1).expand(b, h, 1, d)
        self.keys.scatter_(2, index, key.to(self.keys.dtype))
        self.values.scatter_(2, index, value.to(self.values.dtype))
        self.positions.scatter_(2, self.slot, position.view(b, 1, 1).expand(b, h, 1))
        self.scores.scatter_(2, self.slot, 0.0)

    def logits(self, query: torch.Tensor, seen: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention logits of the grouped query [b, h, g, d] over every slot, and the keys as
        attended (rolled where positions are rolling)."""
        keys = self.keys
        if self.rotation is None:
            return scores_of(query, keys) * scaling, keys
        live = self.positions >= 0
        shift = seen - live.sum(-1, keepdim=True)
        if self.contiguous:
            if not self.sinks:
                return scores_of(query, keys) * scaling, keys
            sinks = self.rotation.rotate(keys[:, :, : self.sinks], shift.expand(-1, -1, self.sinks))
            parts = (scores_of(query, sinks), scores_of(query, keys[:, :, self.sinks :]))
            return torch.cat(parts, -1) * scaling, keys
        order = torch.where(live, self.positions, torch.iinfo(torch.long).max).argsort(-1)
        rank = order.argsort(-1)
        delta = torch.where(live, shift + rank - self.positions, 0)
        keys = self.rotation.rotate(keys, delta)
        return scores_of(query, keys) * scaling, keys

    def attend(self, query: torch.Tensor, scaling: float, seen: torch.Tensor) -> torch.Tensor:
        """Attention of the new queries [b, hq, 1, d] over the live slots, then the policy's step.
        `seen` [b, 1, 1] counts each row's tokens including the new one. Returns [b, 1, hq, d]."""
        b, hq, _, d = query.shape
        h = self.keys.shape[1]
        grouped = query.view(b, h, hq // h, d)
        logits, keys = self.logits(grouped, seen, scaling)
        live = self.positions >= 0
        probs = logits.masked_fill(~live.unsqueeze(2), float("-inf")).softmax(-1)
        out = weighted_values(probs, self.values)
        self.choose_next_slot(query, keys, probs, scaling, seen)
        return out.to(query.dtype).view(b, hq, 1, d).transpose(1, 2)

    def choose_next_slot(self, query, keys, probs, scaling: float, seen: torch.Tensor) -> None:
        """Score, then free the lowest-priority slot if the row is over budget (else use a free one)."""
        if self.evicting:
            b, hq = query.shape[:2]
            step = Step(
                positions=self.positions,
                keys=keys,
                values=self.values,
                scores=self.scores,
                query=query,
                scaling=scaling,
                seen=seen,
                new=1,
                sizes=self.sizes,
                weights=probs.view(b, hq, 1, -1),
            )
            scores = self.policy.score(step)
            if scores is not None:
                self.scores.copy_(scores)
            priority = self.policy.priority(step).float()
        else:
            priority = torch.full_like(self.scores, KEEP)
        priority = priority.masked_fill(self.positions == DEAD, KEEP)
        priority = priority.masked_fill(self.positions == EMPTY, float("-inf"))
        self.slot.copy_(priority.argmin(-1, keepdim=True))
        self.positions.scatter_(2, self.slot, EMPTY)


@dataclass
class StaticKV:
    """Every layer's `LayerState` (None for a layer without attention state), passed to each
    attention call as the `static_kv` keyword, with each row's token count so far."""

    layers: list[LayerState]
    seen: torch.Tensor

    def kv_bytes(self) -> int:
        """Bytes of the preallocated key and value buffers (all rows, all slots)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))

    def live_tokens(self) -> torch.Tensor:
        """Tokens held per row after the last step's eviction, in the first layer."""
        return (self.layers[0].positions[:, 0] >= 0).sum(-1)
