"""One context's keys and values read once per step by every row that kept part of it.

A RULER sample's policies each keep a subset of the same context (`decode.shared.SharedPrefill`):
decoding them as copies reads every row's copy each step, tens of rows x thousands of tokens. Here
the rows' queries meet the context's keys in one product per head (a matrix product, not a
matrix-vector product per row), each row masked to the tokens its policy kept; the softmax runs
over those and the row's own tokens (question and answer) together, as over a copy.

Rows whose policy evicts while decoding read the context the same way (at original positions,
or at rolling positions keeping the sinks and a run of the newest tokens, the sinks moved):
the policy scores the context tokens a row holds and its own together, and once the row holds
more than its budget the lowest-priority of them leaves, a context token by clearing its mark.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv.evict import lowest, priorities, update_scores
from sparsegen.kv.policy import PARTS, Policy, Sizes, Step
from sparsegen.kv.rope import KeyRotation
from sparsegen.kv.slots import HeldSlots
from sparsegen.kv.spec import policy_step_settings
from sparsegen.kv.store import EMPTY, gather_slots


@dataclass
class ContextRows:
    """A context's keys and values [h, S, d], shared by the rows; live [b, h, S]: the context
    tokens each row holds; scores [b, h, S]: the running scores of them; `rules`: the policy each
    row evicts by while decoding, None where it keeps every new token."""

    keys: torch.Tensor
    values: torch.Tensor
    live: torch.Tensor
    scores: torch.Tensor
    rules: tuple[Policy | None, ...]
    rolls: tuple[bool, ...]
    rotation: KeyRotation | None = None
    sinks: int = 0
    groups: list[tuple[Policy, slice | torch.Tensor]] = field(init=False)
    rolling: slice | torch.Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        self._index()

    def _index(self) -> None:
        self.groups = _groups(self.rules, self.live.device)
        rows = [row for row, rolls in enumerate(self.rolls) if rolls]
        self.rolling = _rows(rows, self.live.device) if rows and self.sinks else None

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def logits(self, query: torch.Tensor, scaling: float, shift: torch.Tensor | None = None) -> torch.Tensor:
        """query [b, h, g, d] -> fp32 logits [b, h, g, S], -inf where a row does not hold the token.
        Rows at rolling positions see the first `sinks` tokens moved by `shift` [b, h, 1] (the
        tokens a row has seen beyond those it holds): their newest run keeps its own positions."""
        b, h, g, d = query.shape
        flat = query.to(self.keys.dtype).transpose(0, 1).reshape(h, b * g, d)
        scores = (flat @ self.keys.transpose(-1, -2)).float().view(h, b, g, -1).transpose(0, 1) * scaling
        if self.rolling is not None:
            rows, moved = self.rolling, shift[self.rolling]
            first = self.keys[:, : self.sinks].expand(moved.shape[0], -1, -1, -1)
            rolled = self.rotation.roll_sinks(first, moved)
            scores[rows, :, :, : self.sinks] = (query[rows].float() @ rolled.float().transpose(-1, -2)) * scaling
        return scores.masked_fill_(~self.live.unsqueeze(2), float("-inf"))

    def held(self, own: torch.Tensor) -> torch.Tensor:
        """Tokens each row and head holds [b, h, 1]: its context tokens and its `own` live slots."""
        return self.live.sum(-1, keepdim=True) + own.sum(-1, keepdim=True)

    def mix(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [b, h, g, S] fp32 over the context -> [b, h, g, d] fp32."""
        b, h, g, n = probs.shape
        flat = probs.to(self.values.dtype).transpose(0, 1).reshape(h, b * g, n)
        return (flat @ self.values).float().view(h, b, g, -1).transpose(0, 1)

    def select(self, rows: torch.Tensor) -> None:
        self.live, self.scores = self.live[rows].contiguous(), self.scores[rows].contiguous()
        self.rules, self.rolls = (tuple(kept[row] for row in rows.tolist()) for kept in (self.rules, self.rolls))
        self._index()

    def extend(self, other: ContextRows) -> None:
        if other.keys is not self.keys:
            raise SparsegenError("rows reading different shared contexts cannot share a batch: decode each apart")
        self.live, self.scores = torch.cat([self.live, other.live]), torch.cat([self.scores, other.scores])
        if other.sinks and self.sinks and other.sinks != self.sinks:
            raise SparsegenError("rows with different numbers of sinks at rolling positions cannot share a batch")
        self.rules, self.rolls, self.sinks = (
            self.rules + other.rules,
            self.rolls + other.rolls,
            max(self.sinks, other.sinks),
        )
        self.rotation = self.rotation or other.rotation
        self._index()

    def evict(self, sizes: Sizes, positions: torch.Tensor, scores: torch.Tensor, step: dict) -> torch.Tensor:
        """Each evicting row's policy step over the context tokens it holds and its own slots
        (`positions`, `scores` [b, h, C], updated in place; `step`: the rest of the `Step`,
        `weights` over context then own slots): a row over budget drops its lowest-priority token.
        Returns each row's next own slot [b, h, 1]."""
        for rule, rows in self.groups:
            live, own = self.live[rows], positions[rows]
            b, h, length = live.shape
            index = torch.arange(length, device=own.device).expand(b, h, length)
            keys = step["keys"]  # a policy that scores keys reads the context's then the row's own
            part = Step(
                positions=torch.cat([index.masked_fill(~live, EMPTY), own], -1),
                keys=torch.cat([self.keys.expand(b, -1, -1, -1), keys[rows]], 2) if rule.reads_keys else None,
                values=None,
                scores=torch.cat([self.scores[rows], scores[rows]], -1),
                sizes=Sizes(*(getattr(sizes, name)[rows] for name in PARTS)),
                **{name: value[rows] if name in PER_ROW else value for name, value in step.items() if name != "keys"},
            )
            update_scores(rule, part)
            held = part.positions >= 0
            given_up = lowest(priorities(rule, part), held, rule.compress_every)
            over = held.sum(-1, keepdim=True) >= rule.held_at_most(part.sizes.budget)
            held.scatter_(2, given_up, held.gather(2, given_up) & ~over)
            self.live[rows], self.scores[rows] = held[..., :length], part.scores[..., :length]
            scores[rows], positions[rows] = part.scores[..., length:], own.masked_fill(~held[..., length:], EMPTY)
        return (positions == EMPTY).int().argmax(-1, keepdim=True)


PER_ROW = ("query", "seen", "weights")


def _groups(rules: tuple[Policy | None, ...], device: torch.device) -> list[tuple[Policy, slice | torch.Tensor]]:
    """The evicting rows by the rule for rows of one step (`kv.spec.policy_step_settings`: every
    setting but the heavy and recent counts, each row's sizes its own)."""
    groups: dict[tuple, list[int]] = {}
    for row, rule in enumerate(rules):
        if rule is not None:
            groups.setdefault(policy_step_settings(rule), []).append(row)
    return [(rules[rows[0]], _rows(rows, device)) for rows in groups.values()]


def _rows(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """Rows of the batch as a slice where they are consecutive (a view), else as an index."""
    if rows == list(range(rows[0], rows[-1] + 1)):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, device=device)


def split_context(part: HeldSlots, length: int) -> tuple[torch.Tensor, torch.Tensor, HeldSlots]:
    """A prefilled part's context tokens (positions below `length`) as a mask [b, h, length] and
    their scores, and the part holding only its own tokens after them (free slots where a row or
    head has fewer)."""
    positions = part.positions
    in_context = (positions >= 0) & (positions < length)
    b, h = positions.shape[:2]
    at = torch.where(in_context, positions, 0)
    counts = positions.new_zeros(b, h, length).scatter_add_(2, at, in_context.long())
    scores = part.scores.new_zeros(b, h, length).scatter_add_(2, at, part.scores.masked_fill(~in_context, 0))
    own = positions >= length
    order = (~own).to(torch.uint8).argsort(dim=-1, stable=True)[..., : int(own.sum(-1).max())]
    kept = own.gather(2, order)
    tokens = {name: gather_slots(getattr(part, name), order) for name in ("keys", "values", "scores")}
    tokens["positions"] = torch.where(kept, positions.gather(2, order), EMPTY)
    return counts > 0, scores, replace(part, store=replace(part.store, **tokens))
