"""Contextual sparsity (Deja Vu, CATS, TEAL): per token, compute only the MLP neurons, attention heads and
projection inputs that matter."""

from sparsegen.contextual import oracle, predictor, static, teal, threshold  # noqa: F401  (register selectors)
from sparsegen.contextual.apply import densify, install, load_selectors, save_selectors, sparsify
from sparsegen.contextual.base import SELECTORS, Selector, make_selector, mlp_parts
from sparsegen.contextual.heads import HeadPredictor, SparseAttention
from sparsegen.contextual.mlp import SparseMLP

__all__ = [
    "SELECTORS",
    "HeadPredictor",
    "Selector",
    "SparseAttention",
    "SparseMLP",
    "densify",
    "install",
    "load_selectors",
    "make_selector",
    "mlp_parts",
    "save_selectors",
    "sparsify",
]
