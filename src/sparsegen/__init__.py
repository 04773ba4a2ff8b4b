"""sparsegen: cheaper and longer LLM generation through sparsity."""

from sparsegen.data import load_text, tokenize_long
from sparsegen.decode import generate
from sparsegen.errors import SparsegenError
from sparsegen.models import DEFAULT_MODEL, load

__all__ = ["DEFAULT_MODEL", "SparsegenError", "generate", "load", "load_text", "tokenize_long"]
__version__ = "0.1.0"
