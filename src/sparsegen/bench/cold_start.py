"""`sparsegen bench cold-start`: how long a first `sparsegen serve` on a fresh machine takes to answer.

A fresh machine has no compiled code cached. Each server here starts with an empty inductor
cache (`TORCHINDUCTOR_CACHE_DIR` in a temporary folder: the compiled step is built from nothing)
and one client asks a completion as soon as the port takes connections. Recorded: seconds from
the process's start to its first `/health`, to that first answer, and to its compiled step
serving (`/health`'s `step`; a server that compiles before listening has it from the first
`/health`). A `--baseline-src` checkout (an older server) is measured the same way in the run.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable

import httpx

from sparsegen.bench.serve import ServeConfig, free_port, launch_server, stream_completion
from sparsegen.errors import SparsegenError

LIMIT_S = 1200.0


def cold_start(
    config: ServeConfig,
    model: str,
    prompt: str,
    options: list[str],
    progress: Callable[[str], None],
    wait_compiled: bool = True,
) -> dict:
    """One server of `config` from an empty compile cache; its seconds to listen, answer and (unless
    not `wait_compiled`: None) to its compiled step serving."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="sparsegen-cold-") as empty:
        started = time.monotonic()
        server = launch_server(config, model, port, options, env={"TORCHINDUCTOR_CACHE_DIR": empty})
        try:
            with httpx.Client() as client:  # one client: a new one each poll costs ~20 ms of CPU (TLS context)
                listening = _wait(client, server, base, started, lambda health: True)
                progress(f"{config.label}: listening after {listening:.1f} s")
                body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
                answer = stream_completion(client, base, body)
                answered = time.monotonic() - started
                progress(f"{config.label}: first answer after {answered:.1f} s")
                compiled = None
                if wait_compiled:
                    compiled = _wait(client, server, base, started, lambda health: health.get("step") != "compiling")
        finally:
            server.terminate()
            server.wait(timeout=60)
    return {
        "config": config.label,
        "listening_s": round(listening, 1),
        "first_answer_s": round(answered, 1),
        "compiled_s": None if compiled is None else round(compiled, 1),
        "answer_tokens": answer.get("tokens"),
    }


def _wait(client: httpx.Client, server, base: str, started: float, ready: Callable[[dict], bool]) -> float:
    """Seconds from `started` until `/health` answers a body `ready` accepts."""
    while time.monotonic() - started < LIMIT_S:
        if server.poll() is not None:
            raise SparsegenError(f"the server exited: {server.stderr.read().strip()[-500:]}")
        try:
            health = client.get(f"{base}/health", timeout=2).json()
            if ready(health):
                return time.monotonic() - started
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise SparsegenError(f"the server did not get there in {LIMIT_S:.0f} s")
