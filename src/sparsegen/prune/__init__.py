"""Weight sparsity: magnitude, Wanda and SparseGPT pruning, unstructured or N:M, layer by layer."""

import importlib
import pkgutil

from sparsegen.prune.pipeline import PruneReport, prune
from sparsegen.prune.pruner import PRUNERS, InputStats, Pattern, Pruner, make_pruner, register_pruner

# Every module of this package is imported, so a pruner registers itself by existing as a file.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

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
