"""The one table of KV policies the tests run over, and a brute-force reference for each.

A row gives a policy's small budget (evicts in the tests), a large one (covers any test text, so
the policy must equal the dense model), how to draw random budgets, and its reference: plain
Python over explicit sets of positions, attention computed naively per query. Adding a policy
adds one row here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Ref:
    """A policy in plain Python: how scores follow each step's attention, and keep-priorities."""

    priority: Callable  # (pos, score, key, cache) -> float; higher is kept
    update: Callable = lambda scores, received, cache: None  # received: one {pos: prob} per new query
    prefill_only: bool = False
    alpha: float | None = None  # head-adaptive (AdaKV): the layer's heads share their budget, this safeguard each


@dataclass
class Row:
    small: dict
    large: dict
    draw: Callable  # (sinks, heavy, recent) -> budget parts, for property tests
    ref: Ref | None = None
    settings: dict = field(default_factory=dict)

    @property
    def bounded(self) -> bool:
        """Stays within its budget while decoding (prefill-only policies keep every new token)."""
        return self.ref is not None and not self.ref.prefill_only


def _accumulate(scores, received, cache):
    for row in received:
        for pos, prob in row.items():
            scores[pos] += prob


def _last_query(scores, received, cache):
    for pos in scores:
        scores[pos] = received[-1].get(pos, 0.0)


def _snapkv_scores(scores, received, cache):
    window = received[-min(cache.sizes["recent"], len(received)) :]
    for pos in scores:  # the window itself is kept whole and not pooled with the rest
        scores[pos] = sum(row.get(pos, 0.0) for row in window)
    order = sorted(pos for pos in scores if not _recent(pos, cache))
    summed = [sum(row.get(pos, 0.0) for row in window) for pos in order]
    half = cache.settings.get("kernel", 5) // 2
    for i, pos in enumerate(order):
        scores[pos] = sum(summed[j] for j in range(i - half, i + half + 1) if 0 <= j < len(order)) / (2 * half + 1)


def _keydiff_scores(scores, received, cache):
    """Minus each key's cosine to the mean of the held keys' unit vectors."""
    units = {pos: cache.key_of(pos).double() / cache.key_of(pos).double().norm() for pos in scores}
    anchor = sum(units.values()) / len(units)
    for pos, unit in units.items():
        scores[pos] = -float(unit @ anchor / anchor.norm())


HEAD_DIM = 8  # the driven keys' and queries' size (tests/test_kv_policies.py)
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))


def _rope_matrix(position: float) -> torch.Tensor:
    """RoPE at `position` as an explicit matrix (half-split layout: dims i and i + d/2 turn together)."""
    half = HEAD_DIM // 2
    matrix = torch.zeros(HEAD_DIM, HEAD_DIM, dtype=torch.float64)
    for i in range(half):
        angle = position * float(INV_FREQ[i])
        matrix[i, i] = matrix[i + half, i + half] = math.cos(angle)
        matrix[i, i + half], matrix[i + half, i] = -math.sin(angle), math.sin(angle)
    return matrix


def _expected_attention_scores(scores, received, cache):
    """Each key's attention under a Gaussian model of the group's queries (before RoPE, sinks left
    out), turned by RoPE's mean rotation over the next `future` positions; times the value's norm."""
    settings = {"future": 512, "covariance": True, "value_norm": True, "epsilon": 0.0, **cache.settings}
    sinks, scale = cache.sizes.get("sinks", 0), HEAD_DIM**-0.5
    future = range(cache.length, cache.length + settings["future"])
    turn = sum(_rope_matrix(t) for t in future) / len(future)
    counted = [i for i, p in enumerate(cache.new_positions) if p >= sinks] or range(len(cache.new_positions))
    weights = {pos: 0.0 for pos in scores}
    for group_queries in cache.new_queries():
        pre = [_rope_matrix(-cache.new_positions[i]) @ group_queries[i] for i in counted]
        mean = sum(pre) / len(pre)
        spread = sum(torch.outer(q - mean, q - mean) for q in pre) / len(pre)
        mean, spread = turn @ mean, turn @ spread @ turn.T
        logits = {}
        for pos in scores:
            if pos >= sinks:
                key = cache.key_of(pos).double()
                quadratic = float(key @ spread @ key) if settings["covariance"] else 0.0
                logits[pos] = float(key @ mean) * scale + 0.5 * scale**2 * quadratic
        if not logits:  # nothing but sinks
            continue
        top = max(logits.values())
        total = sum(math.exp(x - top) for x in logits.values())
        for pos, x in logits.items():
            weights[pos] += math.exp(x - top) / total / len(cache.new_queries())
    for pos in scores:
        norm = float(cache.value_of(pos).double().norm()) if settings["value_norm"] else 1.0
        scores[pos] = (weights[pos] + settings["epsilon"]) * norm if settings["value_norm"] else weights[pos]


def _triattention_scores(scores, received, cache):
    """Each competing key's attention, for each query head of the group, at logits averaged over the
    future positions newest + 1, 2, 4, ..., `future`: the centre of the call's queries before RoPE
    (sinks left out of a prompt's) turned by RoPE to that position, dotted with the key, plus each
    band's mean query magnitude beyond the centre's times the key's; averaged over the group."""
    future = {"future": 4096, **cache.settings}["future"]
    sinks, scale, half = cache.sizes.get("sinks", 0), HEAD_DIM**-0.5, HEAD_DIM // 2
    ahead = [cache.length - 1 + 2**k for k in range(future.bit_length())]
    counted = [i for i, p in enumerate(cache.new_positions) if p >= sinks] or range(len(cache.new_positions))
    competing = [pos for pos in scores if not (_sink(pos, cache) or _recent(pos, cache))]
    weights = dict.fromkeys(scores, 0.0)
    for group_queries in cache.new_queries():
        pre = [_rope_matrix(-cache.new_positions[i]) @ group_queries[i] for i in counted]
        mean = sum(pre) / len(pre)
        bands = [sum(math.hypot(q[f], q[f + half]) for q in pre) / len(pre) for f in range(half)]
        logits = {}
        for pos in competing:
            key = cache.key_of(pos).double()
            trig = sum(float((_rope_matrix(t) @ mean) @ key) for t in ahead) / len(ahead)
            spread = sum(
                max(0.0, bands[f] - math.hypot(mean[f], mean[f + half])) * math.hypot(key[f], key[f + half])
                for f in range(half)
            )
            logits[pos] = (trig + spread) * scale
        if logits:
            top = max(logits.values())
            total = sum(math.exp(x - top) for x in logits.values())
            for pos, x in logits.items():
                weights[pos] += math.exp(x - top) / total / len(cache.new_queries())
    scores.update(weights)


def _duo_scores(scores, received, cache):
    """Every token of a head scores the head's share of its window's attention beyond sinks and window."""
    window = received[-min(cache.sizes["recent"], len(received)) :]
    total = sum(p for row in window for p in row.values())
    far = sum(p for row in window for pos, p in row.items() if not (_sink(pos, cache) or _recent(pos, cache)))
    for pos in scores:
        scores[pos] = far / total


def _rkv_scores(scores, received, cache):
    """R-KV: a token's score is its largest cosine (at least 0) to any key after it, each new key in
    turn against every held key before it; the priority of the competing tokens (neither sinks nor
    recent) is lambda * minmax(importance) - (1 - lambda) * minmax(score), the importance the
    attention of the newest `window` queries."""
    settings = {"importance": 0.1, "window": 8, **cache.settings}
    for new in cache.new_positions:
        later = cache.key_of(new).double()
        for pos in scores:
            if pos < new:
                key = cache.key_of(pos).double()
                scores[pos] = max(scores[pos], float(key @ later / (key.norm() * later.norm())))
    window = received[-settings["window"] :]
    importance = {pos: sum(row.get(pos, 0.0) for row in window) for pos in scores}
    competing = [pos for pos in scores if not (_sink(pos, cache) or _recent(pos, cache))]

    def minmax(values):
        low, high = min((values[p] for p in competing), default=0.0), max((values[p] for p in competing), default=0.0)
        return {p: (values[p] - low) / (high - low) if high > low else 0.0 for p in competing}

    weight, important, redundant = settings["importance"], minmax(importance), minmax(scores)
    cache.rkv = {p: weight * important[p] - (1 - weight) * redundant[p] for p in competing}


def _recent(pos, cache):
    return pos >= cache.length - cache.sizes.get("recent", 0)


def _sink(pos, cache):
    return pos < cache.sizes.get("sinks", 0)


def _h2o(pos, score, key, cache):
    if _sink(pos, cache) or _recent(pos, cache):
        return math.inf
    return score / (cache.length - pos) if cache.settings.get("normalize") else score


TABLE: dict[str, Row] = {
    "full": Row({}, {}, lambda s, h, r: {}),
    "window": Row(
        {"recent": 5}, {"recent": 500}, lambda s, h, r: {"recent": r}, Ref(lambda pos, score, key, cache: float(pos))
    ),
    "streaming": Row(
        {"sinks": 2, "recent": 4},
        {"sinks": 4, "recent": 500},
        lambda s, h, r: {"sinks": s, "recent": r},
        Ref(lambda pos, score, key, cache: math.inf if _sink(pos, cache) else float(pos)),
    ),
    "h2o": Row(
        {"heavy": 3, "recent": 3},
        {"heavy": 250, "recent": 250},
        lambda s, h, r: {"heavy": h, "recent": r},
        Ref(_h2o, _accumulate),
    ),
    "streaming_h2o": Row(
        {"sinks": 1, "heavy": 3, "recent": 2},
        {"sinks": 4, "heavy": 250, "recent": 250},
        lambda s, h, r: {"sinks": s, "heavy": h, "recent": r},
        Ref(_h2o, _accumulate),
    ),
    "tova": Row(
        {"heavy": 5},
        {"heavy": 500},
        lambda s, h, r: {"heavy": h + r},
        Ref(lambda pos, score, key, cache: score, _last_query),
    ),
    "snapkv": Row(
        {"heavy": 3, "recent": 3},
        {"heavy": 500, "recent": 8},
        lambda s, h, r: {"heavy": h, "recent": r},
        Ref(lambda pos, score, key, cache: math.inf if _recent(pos, cache) else score, _snapkv_scores, True),
    ),
    "keydiff": Row(
        {"heavy": 5},
        {"heavy": 500},
        lambda s, h, r: {"heavy": h + r + 1},  # keeping 1 of 2 keys is a tie: each is as far from their mean
        Ref(lambda pos, score, key, cache: score, _keydiff_scores, True),
    ),
    "pyramidkv": Row(  # one layer here: SnapKV's choice (the layer budgets are tested on models)
        {"heavy": 3, "recent": 3},
        {"heavy": 500, "recent": 8},
        lambda s, h, r: {"heavy": h, "recent": r},
        Ref(lambda pos, score, key, cache: math.inf if _recent(pos, cache) else score, _snapkv_scores, True),
    ),
    "expected_attention": Row(
        {"sinks": 1, "heavy": 4},
        {"sinks": 4, "heavy": 500},
        lambda s, h, r: {"sinks": s, "heavy": h + r},
        Ref(lambda pos, score, key, cache: math.inf if _sink(pos, cache) else score, _expected_attention_scores, True),
    ),
    "adakv": Row(  # one pool per layer: the kept sets of all heads are chosen together
        {"sinks": 1, "heavy": 4},
        {"sinks": 4, "heavy": 500},
        lambda s, h, r: {"sinks": s, "heavy": h + r},
        Ref(
            lambda pos, score, key, cache: math.inf if _sink(pos, cache) else score,
            _expected_attention_scores,
            True,
            alpha=0.2,
        ),
    ),
    "duo_attention": Row(  # whole heads by retrieval share, the newest first at the boundary
        {"sinks": 1, "heavy": 3, "recent": 2},
        {"sinks": 4, "heavy": 250, "recent": 250},
        lambda s, h, r: {"sinks": s, "heavy": h, "recent": max(r, 1)},
        Ref(
            lambda pos, score, key, cache: (
                math.inf if _sink(pos, cache) or _recent(pos, cache) else score + 1e-6 * pos / cache.length
            ),
            _duo_scores,
            True,
            alpha=0.0,
        ),
    ),
    "rkv": Row(
        {"sinks": 1, "heavy": 3, "recent": 2},
        {"sinks": 4, "heavy": 250, "recent": 250},
        lambda s, h, r: {"sinks": s, "heavy": h, "recent": r},
        Ref(
            lambda pos, score, key, cache: math.inf if _sink(pos, cache) or _recent(pos, cache) else cache.rkv[pos],
            _rkv_scores,
        ),
    ),
    "triattention": Row(
        {"sinks": 1, "heavy": 3, "recent": 2},
        {"sinks": 4, "heavy": 250, "recent": 250},
        lambda s, h, r: {"sinks": s, "heavy": h, "recent": r},
        Ref(
            lambda pos, score, key, cache: math.inf if _sink(pos, cache) or _recent(pos, cache) else score,
            _triattention_scores,
        ),
    ),
    "kvzip": Row(  # scored by the model re-reading the prompt: its reference is tests/test_kv_kvzip.py
        {"sinks": 1, "heavy": 4},
        {"sinks": 4, "heavy": 500},
        lambda s, h, r: {"sinks": s, "heavy": h + r},
    ),
    "knorm": Row(
        {"heavy": 5},
        {"heavy": 500},
        lambda s, h, r: {"heavy": h + r},
        Ref(lambda pos, score, key, cache: -float(key.double().norm()), prefill_only=True),
    ),
}
EVICTING = [name for name, row in TABLE.items() if row.ref is not None]


def generate_drop_in(model, ids: torch.Tensor, cache, new: int, frame=None) -> list[int]:
    """transformers' generate() over a policy cache, greedy, one row: the eager engine the fast path
    must equal. A policy that scores the prompt by re-reading it (KVzip) is handed the prompt by
    `read` (as its docs say), then generate() continues the cache from the first new token."""
    from sparsegen.decode.reading import read
    from sparsegen.kv.attention import policy_attention

    start = ids.shape[1]
    with policy_attention(model), torch.inference_mode():  # read's tensors are inference tensors
        if cache.policy.reconstructs:
            ids = torch.cat([ids, read(model, ids, cache, frame=frame).argmax(-1, keepdim=True)], 1)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=new - (ids.shape[1] - start),
            do_sample=False,
        )
    return out[0, start:].tolist()


class ReferenceCache:
    """Keeps, per (batch, kv head), an explicit list of positions and a score per position."""

    def __init__(self, policy: str, sizes: dict, batch: int, kv_heads: int, settings: dict | None = None) -> None:
        self.ref = TABLE[policy].ref
        self.sizes, self.settings = sizes, settings or {}
        self.budget = sum(sizes.values())
        self.kept = [[[] for _ in range(kv_heads)] for _ in range(batch)]
        self.scores = [[{} for _ in range(kv_heads)] for _ in range(batch)]
        self.length = self.steps = 0

    def step(self, keys: torch.Tensor, queries: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """keys (values): the full table [b, hkv, T, d] (new ones included); queries [b, hq, n, d] of
        the new tokens."""
        b_count, hq, n, d = queries.shape
        hkv = keys.shape[1]
        group = hq // hkv
        new = list(range(self.length, self.length + n))
        self.length += n
        self.steps += 1
        if self.ref.prefill_only and self.steps > 1:
            for b in range(b_count):
                for h in range(hkv):
                    self.kept[b][h].extend(new)
                    self.scores[b][h].update(dict.fromkeys(new, 0.0))
            return
        for b in range(b_count):
            for h in range(hkv):
                kept, scores = self.kept[b][h], self.scores[b][h]
                kept.extend(new)
                for p in new:
                    scores[p] = 0.0
                received = []
                for i, p in enumerate(new):
                    visible = [k for k in kept if k <= p]
                    row = dict.fromkeys(visible, 0.0)
                    for g in range(group):
                        q = queries[b, h * group + g, i].double()
                        logits = [float(q @ keys[b, h, k].double()) / math.sqrt(d) for k in visible]
                        top = max(logits)
                        weights = [math.exp(x - top) for x in logits]
                        total = sum(weights)
                        for k, w in zip(visible, weights, strict=True):
                            row[k] += w / total
                    received.append(row)
                self.key_of = lambda pos, b=b, h=h: keys[b, h, pos]
                self.value_of = lambda pos, b=b, h=h: values[b, h, pos]
                self.new_positions = new
                self.new_queries = lambda b=b, h=h: [
                    [queries[b, h * group + g, i].double() for i in range(n)] for g in range(group)
                ]
                self.ref.update(scores, received, self)
                over = len(kept) >= self.budget + self.settings.get("compress_every", 1)  # then down to the budget
                while self.ref.alpha is None and over and len(kept) > self.budget:
                    victim = min(kept, key=lambda k: self.ref.priority(k, scores[k], keys[b, h, k], self))
                    kept.remove(victim)
                    del scores[victim]
            if self.ref.alpha is not None and len(self.kept[b][0]) > self.budget:
                self._keep_across_heads(b, keys)

    def _keep_across_heads(self, b: int, keys: torch.Tensor) -> None:
        """AdaKV: every head's top alpha share of the budget, then the layer's best of the rest."""
        guaranteed = max(1, int(self.ref.alpha * self.budget)) if self.ref.alpha else 0
        ranked = []
        for h, kept in enumerate(self.kept[b]):
            prio = {k: self.ref.priority(k, self.scores[b][h][k], keys[b, h, k], self) for k in kept}
            for rank, k in enumerate(sorted(kept, key=lambda k: -prio[k])):
                ranked.append((math.inf if rank < guaranteed else prio[k], h, k))
        chosen = sorted(ranked, key=lambda item: -item[0])[: self.budget * len(self.kept[b])]
        for h in range(len(self.kept[b])):
            mine = {k for _, head, k in chosen if head == h}
            self.kept[b][h] = [k for k in self.kept[b][h] if k in mine]
            self.scores[b][h] = {k: v for k, v in self.scores[b][h].items() if k in mine}
