"""sparsegen: cheaper and longer LLM generation through sparsity."""

import importlib

from sparsegen.errors import SparsegenError

__version__ = "0.1.0"
_API = {
    "DEFAULT_MODEL": "sparsegen.loading",
    "KVSpec": "sparsegen.kv.spec",
    "generate": "sparsegen.decode",
    "load": "sparsegen.loading",
    "load_text": "sparsegen.data",
    "tokenize_long": "sparsegen.data",
}
__all__ = ["SparsegenError", *_API]


def __getattr__(name: str):
    """The API, imported when first used: `sparsegen --help` and the CLI start without torch."""
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'sparsegen' has no attribute {name!r}")
