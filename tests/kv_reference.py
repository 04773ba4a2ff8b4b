"""Brute-force references for KV policies: plain Python over explicit sets of positions."""

from __future__ import annotations

import math

import torch


def reference_priority(
    policy: str, pos: int, score: float, length: int, sinks: int, recent: int, normalize: bool
) -> float:
    if policy in ("streaming", "streaming_h2o") and pos < sinks:
        return math.inf
    if policy == "window" or policy == "streaming":
        return float(pos)
    if pos >= length - recent:
        return math.inf
    return score / (length - pos) if normalize else score


class ReferenceCache:
    """Keeps, per (batch, kv head), an explicit list of positions and accumulated attention.

    Attention is computed naively from the full key table: softmax(q k^T / sqrt(d)) of each new
    query over the kept keys at or before its position, summed over the query heads of the group.
    """

    def __init__(
        self, policy: str, sinks: int, heavy: int, recent: int, batch: int, kv_heads: int, normalize: bool = False
    ) -> None:
        self.policy, self.sinks, self.heavy, self.recent = policy, sinks, heavy, recent
        self.budget = sinks + heavy + recent
        self.normalize = normalize
        self.kept = [[[] for _ in range(kv_heads)] for _ in range(batch)]
        self.scores = [[{} for _ in range(kv_heads)] for _ in range(batch)]
        self.length = 0

    def step(self, keys: torch.Tensor, queries: torch.Tensor) -> None:
        """keys: the full table [b, hkv, T, d] (new ones included); queries [b, hq, n, d] of the new tokens."""
        b_count, hq, n, d = queries.shape
        hkv = keys.shape[1]
        group = hq // hkv
        new = list(range(self.length, self.length + n))
        self.length += n
        for b in range(b_count):
            for h in range(hkv):
                kept, scores = self.kept[b][h], self.scores[b][h]
                kept.extend(new)
                for p in new:
                    scores[p] = 0.0
                for i, p in enumerate(new):
                    visible = [k for k in kept if k <= p]
                    for g in range(group):
                        q = queries[b, h * group + g, i].double()
                        logits = [float(q @ keys[b, h, k].double()) / math.sqrt(d) for k in visible]
                        top = max(logits)
                        weights = [math.exp(x - top) for x in logits]
                        total = sum(weights)
                        for k, w in zip(visible, weights, strict=True):
                            scores[k] += w / total
                while len(kept) > self.budget:
                    victim = min(
                        kept,
                        key=lambda k: reference_priority(
                            self.policy, k, scores[k], self.length, self.sinks, self.recent, self.normalize
                        ),
                    )
                    kept.remove(victim)
                    del scores[victim]
