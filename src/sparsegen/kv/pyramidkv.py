"""PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling"): SnapKV's scores, with budgets that shrink with depth. Lower layers spread
their attention over the whole prompt and keep more; upper layers attend to a few tokens and keep
fewer. The layers' budgets average the policy's budget, so the cache holds as many tokens in all.

Layer l of L keeps `top - l * (top - bottom) / (L - 1)` tokens, observation window included, where
`bottom = budget / beta` and `top = 2 * budget - bottom`; `top` is capped at the prompt minus the
window (and `bottom` raised to keep the average), and the budget is used unchanged in every layer
where the window would not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsegen.kv.policy import Sizes, register_policy
from sparsegen.kv.snapkv import SnapKVPolicy


@register_policy
@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    """SnapKV's choice with budgets decreasing from the first layer to the last (PyramidKV)."""

    name = "pyramidkv"

    beta: float = 20.0
    """The first layer keeps about 2 * beta - 1 times what the last keeps."""

    def layer_sizes(self, sizes: Sizes, prompt_length: int, layer: int, layers: int) -> Sizes:
        budget, window = sizes.budget, sizes.recent
        bottom = budget / self.beta
        top = 2 * budget - bottom
        if top >= prompt_length - window:
            top = prompt_length - window
            bottom = 2 * budget - top
        if layers < 2 or not prompt_length >= top >= bottom >= window:
            return sizes
        kept = round(top - layer * (top - bottom) / (layers - 1))
        return Sizes(heavy=kept - window, recent=window)
