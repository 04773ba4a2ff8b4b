"""What every route of the app shares: the `Server` (engine, served name, limits, checks,
submission, a request's events), read from `request.app.state.server`, and the response helpers."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

from fastapi import Request

from sparsegen.errors import SparsegenError
from sparsegen.kv.spec import KVSpec
from sparsegen.serve.admission import QueueFull
from sparsegen.serve.batching import Engine
from sparsegen.serve.events import Done, Event, Failed
from sparsegen.serve.jobs import GenerationRequest, Job
from sparsegen.serve.schemas import ApiError, Sampling

ENGINE_SWITCH_S = 0.0002
"""How long a thread may hold the GIL while another waits for it, in a serving process (Python's
default is 5 ms). The engine thread gives the GIL up inside every torch op and needs it back after
each, while the event loop's thread formats and writes every client's tokens: at 5 ms the engine
waited behind those bursts. `sparsegen bench serve`, 32 clients, 2-core Zen 5: 1.065-1.12x tokens/s
at 0.2 ms in three A/B runs, 8 clients unchanged (docs/benchmarks.md)."""


@contextmanager
def engine_first_switching(interval_s: float = ENGINE_SWITCH_S) -> Iterator[None]:
    """While serving: the engine thread waits at most `interval_s` for the GIL; restored after."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class Server:
    """What every route needs: the engine, the name it serves, and the request limits."""

    def __init__(self, engine: Engine, model_id: str, max_tokens_limit: int, context_limit: int | None) -> None:
        self.engine, self.model_id = engine, model_id
        self.max_tokens_limit, self.context_limit = max_tokens_limit, context_limit

    def answered(self, request: Request, status: str = "200") -> None:
        self.engine.metrics.requests.labels(request.url.path, status).inc()

    def check(self, body: Sampling, max_tokens: int, prompt_tokens: int, minimum: int) -> KVSpec:
        """Refuse, as an API error, what this server cannot answer: another model, n > 1, a
        max_tokens out of range, an unknown KV policy, more than the positions `full` can hold.
        Returns the request's KV spec (built once, here)."""
        if body.model != self.model_id:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist; this server serves {self.model_id!r}",
                "model",
                "model_not_found",
            )
        if body.n != 1:
            raise ApiError(400, "only n=1 is supported", "n")
        if not minimum <= max_tokens <= self.max_tokens_limit:
            raise ApiError(
                400, f"max_tokens must be in [{minimum}, {self.max_tokens_limit}], got {max_tokens}", "max_tokens"
            )
        bits = body.kv_bits if "kv_bits" in body.model_fields_set else self.engine.kv.kv_bits  # null: full precision
        try:
            kv = self.engine.kv.asked(body.kv_policy, body.kv_budget, bits)
        except SparsegenError as exc:
            raise ApiError(400, str(exc), "kv_budget" if body.kv_budget is not None else "kv_policy") from None
        if kv.policy.budget_parts() or self.context_limit is None:
            return kv
        if prompt_tokens + max_tokens > self.context_limit:
            raise ApiError(
                400,
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"{self.context_limit} tokens the {kv.name!r} policy can hold; shorten the "
                "conversation or ask for a bounded policy (kv_policy: streaming)",
                "messages",
                "context_length_exceeded",
            )
        return kv

    def submit(self, request: GenerationRequest) -> tuple[Job, asyncio.Queue]:
        """Hand `request` to the engine: its job, and the queue its events arrive on. Refusals are API errors."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        try:
            job = self.engine.submit(request, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        except QueueFull as exc:
            raise ApiError(429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except SparsegenError as exc:
            raise ApiError(400, str(exc), "max_tokens", "kv_memory_exceeded") from None
        return job, events

    async def events(self, request: Request, job: Job, queue: asyncio.Queue) -> AsyncIterator[Event]:
        """The submitted `job`'s events up to its `Done`; a `Failed` is a server error. Cancels the
        job when the client leaves (or the caller stops reading)."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=1.0)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if isinstance(event, Failed):
                    raise ApiError(500, f"generation failed: {event.message}", code="internal_error")
                yield event
                if isinstance(event, Done):
                    return
        finally:
            job.cancelled.set()


def usage(u: dict) -> dict:
    """OpenAI's usage block from a finished request's counts (`Done.usage`)."""
    return {
        "prompt_tokens": u["prompt_tokens"],
        "completion_tokens": u["completion_tokens"],
        "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]},
        "kv_tokens_held": u["kv_tokens_held"],
    }


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
