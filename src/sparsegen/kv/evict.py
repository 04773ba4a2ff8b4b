"""Eviction's decision, written once for the three places that hold a policy's tokens: the drop-in
cache (`kv.cache.PolicyLayer`), the fast path's slots (`decode.state.LayerState`) and the rows
that share a context (`decode.context.ContextRows`).

Each asks the policy the same two questions of one `Step`: update your running scores
(`update_scores`), then how much does each held token deserve to stay (`priorities`); and gives
up the same slot: a free one where there is one, else the held token of lowest priority
(`victim`). The drop-in cache, which also compresses whole prompts, keeps the `budget` best at
once (`keep_best`). Where the kept tokens are stored is each holder's own business.
"""

from __future__ import annotations

import torch

from sparsegen.kv.policy import KEEP, Policy, Step


def update_scores(policy: Policy, step: Step) -> None:
    """Let `policy` update its running scores from this attention call, in place in `step.scores`
    (a view of, or a buffer written back into, what the holder keeps)."""
    scores = policy.score(step)
    if scores is not None:
        step.scores.copy_(scores)


def priorities(policy: Policy, step: Step, pinned: int = 0) -> torch.Tensor:
    """How much each held token deserves to stay [b, h, n] (after `update_scores`); the first
    `pinned` positions (a soft prompt) always stay."""
    priority = policy.priority(step)
    return priority.masked_fill(step.positions < pinned, KEEP) if pinned else priority


def victim(priority: torch.Tensor, held: torch.Tensor | None = None, free: torch.Tensor | None = None) -> torch.Tensor:
    """The slot each row and head gives up [b, h, 1]: a `free` one where there is one, else the
    `held` token of lowest `priority` (slots neither held nor free are never chosen)."""
    priority = priority.float()
    if held is not None:
        priority = priority.masked_fill(~held, KEEP)
    if free is not None:
        priority = priority.masked_fill(free, float("-inf"))
    return priority.argmin(-1, keepdim=True)


def lowest(priority: torch.Tensor, held: torch.Tensor, count: int = 1) -> torch.Tensor:
    """The `count` `held` slots of lowest `priority` each row and head gives up at once [b, h, count]
    (`Policy.compress_every`; `victim`'s one for a single slot)."""
    if count == 1:
        return victim(priority, held)
    return priority.float().masked_fill(~held, KEEP).topk(count, dim=-1, largest=False).indices


def keep_best(priority: torch.Tensor, budget: int) -> torch.Tensor:
    """The `budget` slots of highest priority each row and head keeps [b, h, budget], in slot order."""
    return priority.topk(budget, dim=-1).indices.sort(-1).values
