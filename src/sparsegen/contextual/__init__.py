"""Contextual sparsity (Deja Vu, CATS, TEAL): per token, compute only the MLP neurons, attention heads and
projection inputs that matter."""

import importlib
import pkgutil

from sparsegen.contextual.apply import densify, install, load_selectors, save_selectors, sparsify
from sparsegen.contextual.heads import HeadPredictor, SparseAttention
from sparsegen.contextual.mlp import SparseMLP
from sparsegen.contextual.parts import mlp_parts
from sparsegen.contextual.selector import SELECTORS, Selector, make_selector

# Every module of this package is imported, so a selector registers itself by existing as a file.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

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
