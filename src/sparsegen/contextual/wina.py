"""WINA: TEAL's input sparsity with each input scored by |x| times the column norm of the weights it
multiplies, so that a large input on small weights is skipped before a smaller one on large weights
(Chen et al., 2025: weight-informed neuron activation). Training-free like TEAL, same execution
(`input_sparse.py`), same read bytes: only the choice of which inputs to skip changes."""

from __future__ import annotations

from dataclasses import dataclass

from sparsegen.contextual.selector import register_selector
from sparsegen.contextual.teal import TealSelector


@register_selector
@dataclass
class WinaSelector(TealSelector):
    """WINA: TEAL's input sparsity, inputs scored by |x| times their weights' column norm."""

    name = "wina"
    weighted = True
