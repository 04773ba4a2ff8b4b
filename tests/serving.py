"""A live sparsegen server on 127.0.0.1 for tests: uvicorn in a thread, stopped on exit."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import uvicorn

from sparsegen.bench.serve import free_port
from sparsegen.kv.spec import KVSpec
from sparsegen.rss import current_rss_mb
from sparsegen.serve import build_app


@contextmanager
def live_server(loaded, kv: KVSpec | str = "streaming", model_id: str = "tiny", **options):
    """Yield (base_url, app) of a server for `loaded` = (model, tokenizer) whose requests default
    to the KV spec `kv`; always shut down."""
    app = build_app(loaded, kv, model_id=model_id, **options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        app.state.engine.close()


def conversation_rss(client, model_id: str, turns: list[str], max_tokens: int) -> tuple[list[dict], list[float]]:
    """Hold one conversation turn by turn through the API; returns each turn's usage and the process RSS."""
    messages, usages, rss = [], [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        reply = client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens, temperature=0)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        usages.append(reply.usage.model_dump())
        rss.append(current_rss_mb())
    return usages, rss
