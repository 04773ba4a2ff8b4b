"""OpenAI-compatible HTTP API over the engine: chat and text completions, models, health, metrics.

Errors follow OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with a 4xx status
for bad input (400 invalid request, 404 unknown model) and 500 only for a failure inside a request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from sparsegen.errors import SparsegenError
from sparsegen.serve.engine import Engine, Job, QueueFull


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = 1
    kv_policy: str | None = None
    kv_budget: int | float | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def job_options(self, engine: Engine) -> dict:
        """Sampling (the model's generation config where the request says nothing) and the KV policy."""
        budget = None if self.kv_budget is None else {"budget": self.kv_budget}
        return {
            "temperature": engine.sampling["temperature"] if self.temperature is None else self.temperature,
            "top_p": engine.sampling["top_p"] if self.top_p is None else self.top_p,
            "stop": self.stops(),
            "seed": self.seed,
            "policy": self.kv_policy,
            "budget": budget,
        }


class ChatRequest(Sampling):
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)


def create_app(
    engine: Engine, model_id: str, max_tokens_limit: int = 4096, context_limit: int | None = None
) -> FastAPI:
    """The ASGI app. `context_limit` caps prompt + max_tokens (set for the unbounded `full` policy)."""
    app = FastAPI(title="sparsegen", description="OpenAI-compatible server with a bounded KV cache")
    metrics = engine.metrics
    app.state.engine = engine
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(
            error_body(exc.message, param=exc.param, code=exc.code), status_code=exc.status, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        location = ".".join(str(p) for p in first.get("loc", ())[1:])
        if first.get("type") == "json_invalid":
            message, location = f"the request body is not valid JSON ({first.get('msg')}); send a JSON object", ""
        else:
            message = f"{location or 'body'}: {first.get('msg')}"
        metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(error_body(message, param=location or None), status_code=400)

    @app.exception_handler(Exception)
    async def failure(request: Request, exc: Exception):
        metrics.requests.labels(request.url.path, "500").inc()
        message = f"internal error: {type(exc).__name__}: {exc}"
        return JSONResponse(error_body(message, "server_error", code="internal_error"), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, "policy": engine.policy, **engine.stats()}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(engine.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "sparsegen"}],
        }

    def check(body: Sampling, max_tokens: int, prompt_tokens: int, minimum: int) -> None:
        if body.model != model_id:
            raise ApiError(
                404, f"model {body.model!r} does not exist; this server serves {model_id!r}", "model", "model_not_found"
            )
        if body.n != 1:
            raise ApiError(400, "only n=1 is supported", "n")
        if not minimum <= max_tokens <= max_tokens_limit:
            raise ApiError(
                400, f"max_tokens must be in [{minimum}, {max_tokens_limit}], got {max_tokens}", "max_tokens"
            )
        try:
            policy = engine.kv_policy(body.kv_policy, None if body.kv_budget is None else {"budget": body.kv_budget})
        except SparsegenError as exc:
            raise ApiError(400, str(exc), "kv_budget" if body.kv_budget is not None else "kv_policy") from None
        if policy.budget_parts() or context_limit is None:
            return
        if prompt_tokens + max_tokens > context_limit:
            raise ApiError(
                400,
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"{context_limit} tokens the {policy.name!r} policy can hold; shorten the "
                "conversation or ask for a bounded policy (kv_policy: streaming)",
                "messages",
                "context_length_exceeded",
            )

    def submit(job: Job) -> asyncio.Queue:
        """Hand `job` to the engine; its events arrive on the returned queue. Refusals are API errors."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job.emit = lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
        try:
            engine.submit(job)
        except QueueFull as exc:
            raise ApiError(429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except SparsegenError as exc:
            raise ApiError(400, str(exc), "max_tokens", "kv_memory_exceeded") from None
        return events

    async def run(request: Request, job: Job, events: asyncio.Queue, on_event):
        """Pass the submitted `job`'s events to `on_event` until done; cancel it if the client leaves."""
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(events.get(), timeout=1.0)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if kind == "error":
                    raise ApiError(500, f"generation failed: {payload}", code="internal_error")
                result = on_event(kind, payload)
                if kind == "done":
                    return
                if result is not None:
                    yield result
        finally:
            job.cancelled.set()

    def usage(done: dict) -> dict:
        u = done["usage"]
        return {
            "prompt_tokens": u["prompt_tokens"],
            "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]},
            "kv_tokens_held": u["kv_tokens_held"],
        }

    def sse(data: dict | str) -> str:
        return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if not body.messages:
            raise ApiError(400, "messages must not be empty: send at least one user message", "messages")
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), 256)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise ApiError(400, f"the model's chat template rejected these messages: {exc}", "messages") from None
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        check(body, max_tokens, len(ids), minimum=1)
        job = Job(
            ids,
            max_tokens,
            emit=None,
            text=text,
            **body.job_options(engine),
        )
        events = submit(job)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_id}

        if body.stream:

            async def chunks():
                yield sse(
                    {
                        **head,
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                    }
                )
                final = {}

                def on_event(kind, payload):
                    if kind == "done":
                        final.update(payload)
                        return None
                    if kind == "token" and payload["text"]:
                        return sse(
                            {
                                **head,
                                "choices": [{"index": 0, "delta": {"content": payload["text"]}, "finish_reason": None}],
                            }
                        )
                    return None

                try:
                    async for piece in run(request, job, events, on_event):
                        yield piece
                except ApiError as exc:
                    yield sse(error_body(exc.message, "server_error", code=exc.code))
                if final:
                    yield sse(
                        {
                            **head,
                            "choices": [{"index": 0, "delta": {}, "finish_reason": final["finish_reason"]}],
                            "usage": usage(final),
                        }
                    )
                    yield sse("[DONE]")
                    metrics.requests.labels(request.url.path, "200").inc()

            return StreamingResponse(chunks(), media_type="text/event-stream")

        done = {}
        async for _ in run(
            request, job, events, lambda kind, payload: done.update(payload) if kind == "done" else None
        ):
            pass
        if not done:
            return JSONResponse(error_body("client disconnected"), status_code=499)
        metrics.requests.labels(request.url.path, "200").inc()
        return {
            "id": rid,
            "object": "chat.completion",
            "created": now,
            "model": model_id,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": done["text"]},
                    "finish_reason": done["finish_reason"],
                }
            ],
            "usage": usage(done),
        }

    def prompts_of(body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        ids = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else p for p in prompt]
        vocab = len(engine.tokenizer)
        for one in ids:
            if not one:
                raise ApiError(400, "a prompt encodes to no tokens: send some text", "prompt")
            if any(not 0 <= t < vocab for t in one):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return ids

    def token_text(token: int) -> str:
        return engine.tokenizer.decode([token])

    def logprobs_block(entries: list[dict]) -> dict:
        return {
            "tokens": [token_text(e["id"]) for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                None if e["top"] is None else {token_text(t): v for t, v in e["top"].items()} for e in entries
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = prompts_of(body)
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens must be >= 1 (0 only with echo, to score the prompt)", "max_tokens")
        for ids in prompts:
            check(body, body.max_tokens, len(ids), minimum=0)
        if body.stream and len(prompts) > 1:
            raise ApiError(400, "stream a single prompt at a time", "prompt")
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": now, "model": model_id}

        def job_for(ids: list[int]) -> Job:
            return Job(
                list(ids),
                body.max_tokens,
                emit=None,
                logprobs=body.logprobs,
                **body.job_options(engine),
                echo=body.echo,
            )

        if body.stream:
            job = job_for(prompts[0])
            events = submit(job)

            async def chunks():
                final = {}

                def on_event(kind, payload):
                    if kind == "done":
                        final.update(payload)
                    elif kind == "token" and payload["text"]:
                        return sse({**head, "choices": [{"index": 0, "text": payload["text"], "finish_reason": None}]})
                    return None

                try:
                    async for piece in run(request, job, events, on_event):
                        yield piece
                except ApiError as exc:
                    yield sse(error_body(exc.message, "server_error", code=exc.code))
                if final:
                    yield sse(
                        {
                            **head,
                            "choices": [{"index": 0, "text": "", "finish_reason": final["finish_reason"]}],
                            "usage": usage(final),
                        }
                    )
                    yield sse("[DONE]")
                    metrics.requests.labels(request.url.path, "200").inc()

            return StreamingResponse(chunks(), media_type="text/event-stream")

        jobs = [job_for(ids) for ids in prompts]
        queues = [submit(job) for job in jobs]

        async def one(index: int, ids: list[int]) -> dict:
            state: dict = {"prompt": [], "tokens": []}

            def on_event(kind, payload):
                if kind == "prompt_logprobs":
                    state["prompt"] = payload
                elif kind == "token" and payload["logprob"] is not None:
                    state["tokens"].append(payload["logprob"])
                elif kind == "done":
                    state["done"] = payload

            async for _ in run(request, jobs[index], queues[index], on_event):
                pass
            done = state.get("done")
            if done is None:
                raise ApiError(499, "client disconnected")
            text = (engine.tokenizer.decode(ids) if body.echo else "") + done["text"]
            entries = state["prompt"] + state["tokens"]
            return {
                "index": index,
                "text": text,
                "logprobs": logprobs_block(entries) if body.logprobs is not None else None,
                "finish_reason": done["finish_reason"],
                "_usage": done["usage"],
            }

        choices = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
        totals = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "kv_tokens_held": 0}
        for choice in choices:
            counted = choice.pop("_usage")
            for key in totals:
                totals[key] += counted[key]
        metrics.requests.labels(request.url.path, "200").inc()
        return {**head, "choices": choices, "usage": usage({"usage": totals})}

    return app
