"""Admission and KV accounting: which requests may hold KV memory now.

A request needs the KV its policy can hold (its budget plus the token in flight; for a policy
that keeps everything, its prompt plus `max_tokens`). It is admitted, in arrival order, while
that need fits `max_kv_bytes` beside the admitted requests' needs and the held conversations',
dropping conversations least recently used first; the rest wait, at most `max_queue` of them.
An admitted request counts until the engine releases it (answered, failed or abandoned). The
engine calls every method but `check` under its own lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from sparsegen.errors import SparsegenError
from sparsegen.serve.conversations import ConversationStore
from sparsegen.serve.metrics import Metrics

if TYPE_CHECKING:
    from sparsegen.serve.jobs import GenerationRequest, Job


class QueueFull(Exception):
    """Too many requests wait for KV memory; the client should retry later."""


class Admission:
    """The waiting queue and the ledger of KV held by admitted requests and conversations."""

    def __init__(
        self,
        max_kv_bytes: int,
        row_bytes: Callable[[int, int | None], int],
        max_queue: int,
        conversations: ConversationStore,
        metrics: Metrics,
    ) -> None:
        self.max_kv_bytes, self.row_bytes, self.max_queue = max_kv_bytes, row_bytes, max_queue
        self.conversations, self.metrics = conversations, metrics
        self.waiting: deque[Job] = deque()
        self.admitted: list[Job] = []  # reading their prompt or decoding

    def need(self, request: GenerationRequest) -> int:
        """Bytes of KV `request` may hold at most."""
        sizes = request.kv.policy.sizes(len(request.prompt_ids))
        most = len(request.prompt_ids) + request.max_tokens
        tokens = most if sizes is None else min(request.kv.policy.held_at_most(sizes.budget), most)
        return self.row_bytes(tokens, request.kv.kv_bits)

    def check(self, job: Job, arriving: int) -> None:
        """Refuse a job whose KV could never fit, or one more than `max_queue` waiting (`arriving`
        came in but are not queued yet)."""
        if job.kv_need > self.max_kv_bytes:
            raise SparsegenError(
                f"this request needs {job.kv_need / 2**20:.1f} MB of KV, more than the server's --max-kv-mb "
                f"({self.max_kv_bytes / 2**20:.1f} MB): lower max_tokens or use a bounded kv_policy"
            )
        if len(self.waiting) + arriving >= self.max_queue:
            self.metrics.refused.inc()
            raise QueueFull(f"{self.max_queue} requests already wait for KV memory; retry shortly")

    def held_bytes(self) -> int:
        """KV bytes counted against the cap: admitted requests at their full need, and held conversations."""
        return sum(job.kv_need for job in self.admitted) + self.conversations.nbytes

    def admit_next(self) -> Job | None:
        """The first waiting job if it fits now (cancelled ones leave the queue), dropping held
        conversations to make room; None while it must wait."""
        while self.waiting and self.waiting[0].cancelled.is_set():
            self.waiting.popleft()
        if not self.waiting:
            return None
        job = self.waiting[0]
        while self.held_bytes() + job.kv_need > self.max_kv_bytes and self.conversations:
            self.conversations.drop_oldest()
        if self.held_bytes() + job.kv_need > self.max_kv_bytes:
            return None
        self.admitted.append(self.waiting.popleft())
        self.metrics.admitted.labels(job.request.kv.name).inc()
        return job

    def release(self, job: Job) -> None:
        """Admitted `job` holds no KV any more (answered, failed or abandoned)."""
        if job in self.admitted:
            self.admitted.remove(job)
