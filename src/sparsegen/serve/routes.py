"""The routes: health, Prometheus metrics, models, chat completions and text completions."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from sparsegen.serve.events import Done, PromptLogprobs, Token
from sparsegen.serve.jobs import GenerationRequest, Job
from sparsegen.serve.schemas import ApiError, ChatRequest, CompletionRequest, error_body
from sparsegen.serve.server import Server, sse, usage

router = APIRouter()
CREATED = int(time.time())


def _server(request: Request) -> Server:
    return request.app.state.server


@router.get("/health")
async def health(request: Request):
    server = _server(request)
    engine = server.engine
    return {
        "status": "ok",
        "model": server.model_id,
        "policy": engine.kv.name,
        **engine.stats(),
        "memory_bound": engine.memory.as_dict(),
    }


@router.get("/metrics")
async def prometheus(request: Request):
    return PlainTextResponse(_server(request).engine.render_metrics(), media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(request: Request):
    model = {"id": _server(request).model_id, "object": "model", "created": CREATED, "owned_by": "sparsegen"}
    return {"object": "list", "data": [model]}


async def _streamed(server: Server, request: Request, job: Job, queue, first: str | None, piece, last):
    """Server-sent events: `first`, `piece(text)` per token with text, `last(done)`, `[DONE]`."""
    if first is not None:
        yield first
    final = None
    try:
        async for event in server.events(request, job, queue):
            if isinstance(event, Token) and event.text:
                yield sse(piece(event.text))
            elif isinstance(event, Done):
                final = event
    except ApiError as exc:
        yield sse(error_body(exc.message, "server_error", code=exc.code))
    if final is not None:
        yield sse(last(final))
        yield sse("[DONE]")
        server.answered(request)


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request):
    server = _server(request)
    tokenizer = server.engine.tokenizer
    if not body.messages:
        raise ApiError(400, "messages must not be empty: send at least one user message", "messages")
    max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), 256)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        raise ApiError(400, f"the model's chat template rejected these messages: {exc}", "messages") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    kv = server.check(body, max_tokens, len(ids), minimum=1)
    asked = GenerationRequest(ids, max_tokens, kv, text=text, **body.sampling(server.engine.sampling))
    job, queue = server.submit(asked)
    rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": server.model_id}

    def chunk(delta: dict, finish_reason: str | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

    if body.stream:
        first = sse(chunk({"role": "assistant", "content": ""}))
        pieces = _streamed(
            server,
            request,
            job,
            queue,
            first,
            lambda text: chunk({"content": text}),
            lambda done: {**chunk({}, done.finish_reason), "usage": usage(done.usage)},
        )
        return StreamingResponse(pieces, media_type="text/event-stream")

    done = None
    async for event in server.events(request, job, queue):
        done = event if isinstance(event, Done) else done
    if done is None:
        return JSONResponse(error_body("client disconnected"), status_code=499)
    server.answered(request)
    message = {"role": "assistant", "content": done.text}
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now,
        "model": server.model_id,
        "choices": [{"index": 0, "message": message, "finish_reason": done.finish_reason}],
        "usage": usage(done.usage),
    }


def _prompts_of(body: CompletionRequest, tokenizer) -> list[list[int]]:
    """The request's prompts as token ids: a string, a list of strings, ids, or a list of id lists."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else p for p in prompt]
    vocab = len(tokenizer)
    for one in ids:
        if not one:
            raise ApiError(400, "a prompt encodes to no tokens: send some text", "prompt")
        if any(not 0 <= t < vocab for t in one):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
    return ids


def _logprobs_block(entries: list[dict], tokenizer) -> dict:
    def token_text(token: int) -> str:
        return tokenizer.decode([token])

    return {
        "tokens": [token_text(e["id"]) for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            None if e["top"] is None else {token_text(t): v for t, v in e["top"].items()} for e in entries
        ],
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    server = _server(request)
    tokenizer = server.engine.tokenizer
    prompts = _prompts_of(body, tokenizer)
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens must be >= 1 (0 only with echo, to score the prompt)", "max_tokens")
    specs = [server.check(body, body.max_tokens, len(ids), minimum=0) for ids in prompts]
    if body.stream and len(prompts) > 1:
        raise ApiError(400, "stream a single prompt at a time", "prompt")
    rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": now, "model": server.model_id}

    def asked(ids: list[int]) -> GenerationRequest:
        options = {**body.sampling(server.engine.sampling), "echo": body.echo, "logprobs": body.logprobs}
        return GenerationRequest(ids, body.max_tokens, specs[0], **options)

    def choice(text: str, finish_reason: str | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]}

    if body.stream:
        job, queue = server.submit(asked(prompts[0]))
        pieces = _streamed(
            server,
            request,
            job,
            queue,
            None,
            choice,
            lambda done: {**choice("", done.finish_reason), "usage": usage(done.usage)},
        )
        return StreamingResponse(pieces, media_type="text/event-stream")

    jobs, queues = zip(*(server.submit(asked(ids)) for ids in prompts), strict=True)
    choices = await asyncio.gather(
        *(_completion_choice(server, request, jobs[i], queues[i], i, ids, body) for i, ids in enumerate(prompts))
    )
    totals = _usage_totals(choices)
    server.answered(request)
    return {**head, "choices": choices, "usage": usage(totals)}


async def _completion_choice(
    server: Server, request: Request, job: Job, queue, index: int, ids: list[int], body: CompletionRequest
) -> dict:
    """One prompt's answer in a non-streamed completion: its events gathered into the choice (echoed
    prompt, text, logprobs), its usage under `_usage` for `_usage_totals` to take off."""
    tokenizer = server.engine.tokenizer
    entries, done = [], None
    async for event in server.events(request, job, queue):
        if isinstance(event, PromptLogprobs):
            entries = event.entries + entries
        elif isinstance(event, Token) and event.logprob is not None:
            entries.append(event.logprob)
        elif isinstance(event, Done):
            done = event
    if done is None:
        raise ApiError(499, "client disconnected")
    return {
        "index": index,
        "text": (tokenizer.decode(ids) if body.echo else "") + done.text,
        "logprobs": _logprobs_block(entries, tokenizer) if body.logprobs is not None else None,
        "finish_reason": done.finish_reason,
        "_usage": done.usage,
    }


def _usage_totals(choices: list[dict]) -> dict:
    """The usage of a completion of several prompts: each choice's `_usage` taken off it and summed."""
    totals = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "kv_tokens_held": 0}
    for answer in choices:
        counted = answer.pop("_usage")
        for key in totals:
            totals[key] += counted[key]
    return totals
