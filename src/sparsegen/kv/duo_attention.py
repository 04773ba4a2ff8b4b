"""DuoAttention-style heads (Xiao et al. 2024, "DuoAttention: Efficient Long-Context LLM Inference
with Retrieval and Streaming Heads"): a few heads retrieve from anywhere in the context and need
all of it; the others attend to the first tokens and the most recent ones. Once the prompt is
read, every head keeps its sinks and recent window, and the rest of the layer's budget goes to
whole heads in order of how much they retrieve: retrieval heads keep everything, streaming heads
only their window (one head at the boundary keeps part, its newest tokens first).

How much a head retrieves comes from a calibration (`eval.calibrate_heads`: the attention each head
pays to the needle of synthetic passkey prompts while answering, saved as JSON and given as
`heads=`), or, without one, from the prompt itself: the share of its last `recent` queries'
attention that falls outside the sinks and that window. The paper learns its gates by
optimisation; this keeps its split at a calibration of seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv.policy import KEEP, Policy, register_policy

TIE_BREAK = 1e-6
"""Within a head, newer tokens rank a little higher (the boundary head keeps its newest first)."""


@register_policy
@dataclass
class DuoAttentionPolicy(Policy):
    """Whole heads keep the prompt by how much they retrieve; the rest keep sinks + recent."""

    name = "duo_attention"
    prefill_only = True
    head_adaptive = True

    sinks: int = 4
    """First tokens every head keeps."""
    heavy: int | float = 192
    """Prompt tokens per head, on average over the layer, given to the retrieval heads."""
    recent: int = 64
    """Newest prompt tokens every head keeps (the streaming heads' window)."""
    heads: str | None = None
    """JSON of `calibrate_heads` (retrieval score per layer and KV head); None scores on the prompt."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recent < 1:
            raise SparsegenError("duo_attention needs recent >= 1 (the window every head keeps)")
        self._scores = None
        if self.heads is not None:
            path = Path(self.heads)
            if not path.is_file():
                raise SparsegenError(f"duo_attention heads file {path} not found: make it with calibrate_heads")
            self._scores = torch.tensor(json.loads(path.read_text())["scores"], dtype=torch.float32)

    @classmethod
    def split(cls, rest: int | float) -> dict[str, int | float]:
        """A quarter of the budget beside the sinks is every head's window, the rest is pooled."""
        if isinstance(rest, float):
            raise SparsegenError(f"{cls.name}'s window is a token count: give an int budget, or heavy= as a share")
        window = max(1, rest // 4) if rest > 1 else 0
        return {"heavy": rest - window, "recent": window}

    def score(self, step):
        if step.sizes is None:  # unbounded: nothing to choose
            return None
        b, h, n = step.positions.shape
        if self._scores is not None:
            if step.layer >= self._scores.shape[0] or self._scores.shape[1] != h:
                raise SparsegenError(f"{self.heads} was calibrated for another model (layer {step.layer}, {h} heads)")
            retrieval = self._scores[step.layer].to(step.positions.device).expand(b, h)
        else:
            received = step.received(last=self.recent)
            far = ~(step.is_sink() | step.is_recent())
            retrieval = (received * far).sum(-1) / received.sum(-1).clamp_min(1e-30)
        return retrieval[..., None].expand(b, h, n)

    def priority(self, step):
        ranked = step.scores.double() + TIE_BREAK * step.positions / max(1, step.seen)  # fp32 would tie them
        return ranked.masked_fill(step.is_sink() | step.is_recent(), KEEP)
