"""The rows that decode together (`Lane`) and the engine's lanes by what lets rows share a step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparsegen.decode import Decoder
from sparsegen.kv.policy import Policy
from sparsegen.serve.jobs import Job

DRAINING = "draining"
"""The last part of the key of an eager lane whose rows finish after the compiled lane took its place."""


@dataclass
class Lane:
    """The rows decoding under one KV policy: one batch, one step for all of them."""

    decoder: Decoder
    jobs: list[Job] = field(default_factory=list)
    logits: torch.Tensor | None = None  # each row's next-token logits [rows, vocab]


def lane_key(policy: Policy, kv_bits: int | None) -> tuple:
    """Rows batch together when they share the policy, every setting but the heavy and recent
    counts (per-row budgets differ; the sinks fix the slots' layout) and the KV's bits."""
    settings = (f for f in dataclasses.fields(policy) if f.name not in ("heavy", "recent"))
    return (policy.name, kv_bits, *((f.name, getattr(policy, f.name)) for f in settings))


class Lanes(dict[tuple, Lane]):
    """The engine's lanes by `lane_key`; `make_decoder(policy, kv_bits)` gives a new lane its
    eager decoder (a compiled one comes only through `adopt`)."""

    def __init__(self, make_decoder: Callable[[Policy, int | None], Decoder]) -> None:
        super().__init__()
        self._make_decoder = make_decoder

    def for_rows(self, policy: Policy, kv_bits: int | None) -> Lane:
        """The lane new rows of these settings join, opened (eager) if none is."""
        key = lane_key(policy, kv_bits)
        if key not in self:
            self[key] = Lane(self._make_decoder(policy, kv_bits))
        return self[key]

    def adopt(self, decoder: Decoder, policy: Policy, kv_bits: int | None) -> None:
        """`decoder` (compiled) becomes the lane new rows of its settings join; rows already
        decoding in the eager lane it replaces finish there (`retire_drained` removes it)."""
        key = lane_key(policy, kv_bits)
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
