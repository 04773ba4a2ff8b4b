"""Streaming-H2O: attention sinks + heavy hitters + recent window, with rolling positions."""

from __future__ import annotations

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv.base import KEEP, Policy, is_recent, is_sink, register_policy
from sparsegen.kv.h2o import H2OPolicy


@register_policy
class StreamingH2OPolicy(H2OPolicy):
    name = "streaming_h2o"
    default_position = "rolling"

    def __init__(
        self, sinks: int = 4, heavy: int | float = 124, recent: int | float = 128, normalize: bool = False
    ) -> None:
        Policy.__init__(self, sinks=sinks, heavy=heavy, recent=recent)
        if heavy == 0 and recent == 0:
            raise SparsegenError("streaming_h2o needs heavy + recent > 0")
        self.normalize = normalize

    def priority(self, positions, scores, length, sizes) -> torch.Tensor:
        protected = is_sink(positions, sizes) | is_recent(positions, length, sizes)
        return self.heavy_score(positions, scores, length).masked_fill(protected, KEEP)
