"""Local window: keep only the `recent` newest tokens (collapses once the first tokens leave)."""

from __future__ import annotations

from dataclasses import dataclass

from sparsegen.kv.policy import Policy, register_policy


@register_policy
@dataclass
class WindowPolicy(Policy):
    """Keep the newest tokens."""

    name = "window"
    contiguous = True

    recent: int | float = 256
    """Tokens kept: a count, or a share of the prompt."""

    def priority(self, step):
        return step.positions.float()
