"""Weight sparsity: magnitude, Wanda and SparseGPT pruning, unstructured or N:M, layer by layer."""

from sparsegen.prune import magnitude, sparsegpt, wanda  # noqa: F401  (register pruners)
from sparsegen.prune.base import PRUNERS, InputStats, Pattern, Pruner, make_pruner, register_pruner
from sparsegen.prune.pipeline import PruneReport, prune

__all__ = [
    "PRUNERS",
    "InputStats",
    "Pattern",
    "PruneReport",
    "Pruner",
    "make_pruner",
    "prune",
    "register_pruner",
]
