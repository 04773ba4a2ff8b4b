"""Evaluation shared by every capability: streaming and windowed perplexity, fidelity, speed."""

from sparsegen.eval.stream_ppl import PolicyRun, StreamResult, recompute_nll, stream_compare, stream_ppl

__all__ = ["PolicyRun", "StreamResult", "recompute_nll", "stream_compare", "stream_ppl"]
