"""The best possible choice of a given size: each token keeps its top-k neurons by |h| (the input of
down), which needs h in full. A quality reference, never faster (Deja Vu's "contextual sparsity
exists" measure)."""

from __future__ import annotations

import torch

from sparsegen.contextual.selector import Selector, register_selector


@register_selector
class OracleSelector(Selector):
    """Top-k neurons by |h| per token (needs the dense MLP: quality reference only)."""

    name = "oracle"
    needs_hidden = True

    def keep(self, x, gate_act, hidden):
        k = round((1 - self.sparsity) * hidden.shape[-1])
        mask = torch.zeros_like(hidden, dtype=torch.bool)
        return mask.scatter_(-1, hidden.abs().topk(k, dim=-1, sorted=False).indices, True)
