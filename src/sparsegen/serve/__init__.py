"""An OpenAI-compatible server whose KV memory stays bounded however long the conversation."""

from __future__ import annotations

import torch
from fastapi import FastAPI

from sparsegen.kv.spec import KVSpec
from sparsegen.serve.app import create_app
from sparsegen.serve.batching import Engine
from sparsegen.serve.jobs import GenerationRequest, Job

__all__ = ["Engine", "GenerationRequest", "Job", "build_app", "create_app"]


def build_app(
    model: str | tuple = "smollm2-135m",
    kv: KVSpec | str = "streaming",
    *,
    model_id: str | None = None,
    max_kv_bytes: int = 1 << 30,
    max_tokens_limit: int = 4096,
    prefill_chunk: int = 512,
    max_queue: int = 64,
    device: str | None = None,
    activation_bits: int | None = None,
    dtype: torch.dtype | None = None,
    compile: bool = False,
) -> FastAPI:
    """The server app for `model` (a name or folder, or a loaded `(model, tokenizer)`).

    `kv` is the requests' default KV spec (a request may name its own policy, budget and bits).
    Only the unbounded `full` policy caps prompt + answer at the model's positions; bounded
    policies take conversations of any length. `max_kv_bytes` bounds the KV of every active row
    and held conversation (counted in its spec's `kv_bits` where a request holds its KV rounded); up to
    `max_queue` requests wait for room, later ones get a 429. `activation_bits=8` loads an int4
    checkpoint with integer-dot products, and `dtype` sets the weights' (`sparsegen.load`).
    `compile=True` compiles the batched decode step in the background while the engine answers
    eagerly (`serve.compiling`; for a model named by `model`, a child process compiles it first:
    `serve.precompile`); `/health` says which step serves (`step`: compiling, compiled or eager).
    """
    from sparsegen.loading import load
    from sparsegen.serve.precompile import in_child

    kv = KVSpec.coerce(kv)
    network, tokenizer = (
        load(model, dtype=dtype, device=device, activation_bits=activation_bits) if isinstance(model, str) else model
    )
    child = {"device": device, "activation_bits": activation_bits, "dtype": network.dtype}  # as this one loaded
    first = in_child(model, kv, **child) if isinstance(model, str) else None
    engine = Engine(
        network,
        tokenizer,
        kv,
        max_kv_bytes=max_kv_bytes,
        prefill_chunk=prefill_chunk,
        max_queue=max_queue,
        compile=compile,
        compile_first=first,
    )
    limit = network.config.get_text_config(decoder=True).max_position_embeddings
    name = model_id or (model if isinstance(model, str) else "sparsegen")
    return create_app(engine, name, max_tokens_limit=max_tokens_limit, context_limit=limit)
