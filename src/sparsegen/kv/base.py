"""What a KV-cache policy is: which cached tokens to keep when the cache is over its budget.

A policy sees, per batch row and KV head, the original position of every held token (and, if it
asks for them, the accumulated attention each token received) and returns a priority: the cache
keeps the `budget` highest. Each policy lives in its own file and registers itself by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsegen.errors import SparsegenError

POLICIES: dict[str, type[Policy]] = {}

KEEP = float("inf")


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy selectable by its `name` from the API and the CLI."""
    POLICIES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class Sizes:
    """Token counts of one resolved budget: never-evicted first tokens, top-scored, most recent."""

    sinks: int = 0
    heavy: int = 0
    recent: int = 0

    @property
    def budget(self) -> int:
        return self.sinks + self.heavy + self.recent


def _check_count(name: str, value: int | float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SparsegenError(f"{name} must be a number, got {value!r}")
    if value < 0:
        raise SparsegenError(f"{name} must be >= 0, got {value}")
    if isinstance(value, float) and value >= 1:
        raise SparsegenError(f"{name}={value}: a float is a ratio of the prompt and must be < 1; use an int count")


def _resolve(value: int | float, prompt_length: int) -> int:
    """An int is a count; a float in [0, 1) is a ratio of the prompt length (H2O's '20% cache')."""
    return int(value * prompt_length) if isinstance(value, float) else value


class Policy(ABC):
    """A KV eviction policy over `sinks` + `heavy` + `recent` tokens.

    Subclasses set `name`, optionally `needs_scores` (accumulated attention is collected for them)
    and `default_position`, accept the budget parts they use in `__init__`, and implement
    `priority`.
    """

    name: ClassVar[str]
    needs_scores: ClassVar[bool] = False
    default_position: ClassVar[str] = "original"

    def __init__(self, sinks: int = 0, heavy: int | float = 0, recent: int | float = 0) -> None:
        for label, value in (("sinks", sinks), ("heavy", heavy), ("recent", recent)):
            _check_count(label, value)
        if isinstance(sinks, float):
            raise SparsegenError("sinks must be an int count of initial tokens")
        self.sinks, self.heavy, self.recent = sinks, heavy, recent

    def sizes(self, prompt_length: int) -> Sizes | None:
        """Resolve ratios against the prompt; None means the cache is unbounded."""
        sizes = Sizes(self.sinks, _resolve(self.heavy, prompt_length), _resolve(self.recent, prompt_length))
        if sizes.budget == 0:
            raise SparsegenError(
                f"policy {self.name!r}: the budget resolves to 0 tokens for a {prompt_length}-token prompt; "
                "give larger counts (or ratios with a longer prompt)"
            )
        return sizes

    @abstractmethod
    def priority(self, positions: torch.Tensor, scores: torch.Tensor | None, length: int, sizes: Sizes) -> torch.Tensor:
        """Keep-priority of each held token, shape of `positions` ([batch, kv_heads, held]).

        `positions` are original token indices, `scores` the accumulated attention (if
        `needs_scores`), `length` the number of tokens seen so far. Higher is kept; `KEEP` always.
        """

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in (("sinks", self.sinks), ("heavy", self.heavy), ("recent", self.recent)) if v]
        return f"{self.name}({', '.join(parts)})"


def is_sink(positions: torch.Tensor, sizes: Sizes) -> torch.Tensor:
    return positions < sizes.sinks


def is_recent(positions: torch.Tensor, length: int, sizes: Sizes) -> torch.Tensor:
    return positions >= length - sizes.recent


def split_budget(policy: str, budget: int, sinks: int | None = None) -> dict[str, int]:
    """Turn one total `budget` into the parts a policy takes (half heavy, half recent for H2O)."""
    if budget <= 0:
        raise SparsegenError(f"budget must be > 0, got {budget}")
    if policy == "full":
        return {}
    if policy == "window":
        return {"recent": budget}
    if policy == "h2o":
        return {"heavy": budget // 2, "recent": budget - budget // 2}
    sinks = 4 if sinks is None else sinks
    if sinks >= budget:
        raise SparsegenError(
            f"sinks ({sinks}) must be smaller than the budget ({budget}): raise --budget or lower --sinks"
        )
    if policy == "streaming":
        return {"sinks": sinks, "recent": budget - sinks}
    rest = budget - sinks
    return {"sinks": sinks, "heavy": rest // 2, "recent": rest - rest // 2}


def make_policy(policy: str | Policy, budget: int | None = None, **parts: int | float) -> Policy:
    """A policy from a registered name and its budget (a total `budget`, or its parts as keywords).

    A `Policy` instance is returned unchanged.
    """
    if isinstance(policy, Policy):
        if budget is not None or parts:
            raise SparsegenError("pass budget keywords with a policy name, not with a Policy instance")
        return policy
    if policy not in POLICIES:
        raise SparsegenError(f"unknown KV policy {policy!r}; choose one of: {', '.join(sorted(POLICIES))}")
    if budget is not None:
        if any(k in parts for k in ("heavy", "recent")):
            raise SparsegenError("give either budget= or its parts (heavy=, recent=), not both")
        parts = {**parts, **split_budget(policy, budget, parts.pop("sinks", None))}
    try:
        return POLICIES[policy](**parts)
    except TypeError as exc:
        raise SparsegenError(f"policy {policy!r}: {exc}") from None
