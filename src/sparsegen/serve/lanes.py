"""The rows that decode together (`Lane`) and the engine's lanes by what lets rows share a step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparsegen.decode import Decoder
from sparsegen.kv.spec import KVSpec
from sparsegen.serve.jobs import Job

DRAINING = "draining"
"""The last part of the key of an eager lane whose rows finish after the compiled lane took its place."""


@dataclass
class Lane:
    """The rows whose KV specs share a step (`KVSpec.step_key`): one batch, one step for all of them."""

    decoder: Decoder
    jobs: list[Job] = field(default_factory=list)
    logits: torch.Tensor | None = None  # each row's next-token logits [rows, vocab]


class Lanes(dict[tuple, Lane]):
    """The engine's lanes by `KVSpec.step_key`; `make_decoder(kv)` gives a new lane its eager
    decoder (a compiled one comes only through `adopt`)."""

    def __init__(self, make_decoder: Callable[[KVSpec], Decoder]) -> None:
        super().__init__()
        self._make_decoder = make_decoder

    def for_rows(self, kv: KVSpec) -> Lane:
        """The lane new rows of this spec join, opened (eager) if none is."""
        key = kv.step_key()
        if key not in self:
            self[key] = Lane(self._make_decoder(kv))
        return self[key]

    def adopt(self, decoder: Decoder, kv: KVSpec) -> None:
        """`decoder` (compiled) becomes the lane new rows of `kv` join; rows already decoding in
        the eager lane it replaces finish there (`retire_drained` removes it)."""
        key = kv.step_key()
        eager = self.pop(key, None)
        if eager is not None and eager.jobs:
            self[(*key, DRAINING)] = eager
        elif eager is not None:
            eager.decoder.release()
        self[key] = Lane(decoder)

    def retire_drained(self) -> None:
        """Remove the replaced lanes whose last row has left, giving their decoders back."""
        for key in [key for key, lane in self.items() if key[-1] == DRAINING and not lane.jobs]:
            self.pop(key).decoder.release()

    def release_all(self) -> None:
        for lane in self.values():
            lane.decoder.release()
