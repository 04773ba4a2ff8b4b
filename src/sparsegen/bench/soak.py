"""`sparsegen bench soak`: a bounded soak of one `sparsegen serve` process.

Many client threads send a fixed mix of requests (greedy, cancelled after a few tokens, malformed
fields, a seed out of range, a body that is not UTF-8, too long for the model, a long prompt
abandoned while it is read, chat); the server's RSS is read along the way and its peak held to
the bound the server states at start (`/health`'s `memory_bound`: `serve.memory`), and its rows
left active or queued at the end. Greedy answers are checked against single-request
generate(). No answer may be a 5xx.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from sparsegen.bench.serve import ServeConfig, free_port, single_request_answers, start_server, stream_completion
from sparsegen.errors import SparsegenError
from sparsegen.ioutil import write_json
from sparsegen.report import run_meta
from sparsegen.rss import reset_peak, rss_mb

SOAK_KINDS = (
    "greedy",
    "greedy",
    "greedy",
    "cancel",
    "bad field",
    "too long",
    "chat",
    "greedy",
    "bad seed",
    "not utf-8",
    "abandoned prompt",
    "greedy",
)
BAD_FIELDS = ({"temperature": 5}, {"kv_policy": "nope"}, {"max_tokens": -1}, {"top_p": 0}, {"kv_budget": -3})


def soak_request(client: httpx.Client, base: str, model: str, index: int, prompt: list[int], max_tokens: int) -> dict:
    """Request `index` of the soak, of kind `SOAK_KINDS[index % 10]`: what happened to it."""
    kind = SOAK_KINDS[index % len(SOAK_KINDS)]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if kind == "greedy":
        return {"kind": kind, **stream_completion(client, base, {**body, "stream": True})}
    if kind == "cancel":  # read a few tokens, then hang up
        with client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=600) as response:
            for seen, _ in enumerate(response.iter_lines()):
                if seen >= 3:
                    break
        return {"kind": kind, "status": response.status_code}
    if kind == "abandoned prompt":  # a long prompt; hang up before its first token
        long = {**body, "prompt": prompt * (2000 // len(prompt) + 1), "stream": True}
        with client.stream("POST", f"{base}/v1/completions", json=long, timeout=600) as response:
            status = response.status_code
        return {"kind": kind, "status": status}
    if kind == "not utf-8":
        raw = b'{"model": "' + model.encode() + b'", "prompt": "\xff\xfe", "max_tokens": 4}'
        answer = client.post(f"{base}/v1/completions", content=raw, headers={"content-type": "application/json"})
        return {"kind": kind, "status": answer.status_code, "error": answer.json().get("error", {}).get("message")}
    if kind == "chat":
        messages = [{"role": "user", "content": f"Say something about the number {index}."}]
        answer = client.post(f"{base}/v1/chat/completions", json={**body, "messages": messages}, timeout=600)
        return {"kind": kind, "status": answer.status_code}
    if kind == "too long":  # more than the model's positions under the unbounded policy
        body = {**body, "prompt": prompt * (9000 // len(prompt) + 1), "kv_policy": "full"}
    elif kind == "bad seed":
        body = {**body, "seed": 2**70}
    else:
        body = {**body, **BAD_FIELDS[index // len(SOAK_KINDS) % len(BAD_FIELDS)]}
    answer = client.post(f"{base}/v1/completions", json=body, timeout=600)
    return {"kind": kind, "status": answer.status_code, "error": answer.json().get("error", {}).get("message")}


def count_statuses(outcomes: list[dict]) -> dict[str, dict[str, int]]:
    """How many requests of each kind got each HTTP status ("-" where none was read)."""
    statuses: dict[str, dict[str, int]] = {}
    for o in outcomes:
        key = str(o.get("status", "200" if o["kind"] == "greedy" else "-"))
        statuses.setdefault(o["kind"], {}).setdefault(key, 0)
        statuses[o["kind"]][key] += 1
    return statuses


def _run_clients(
    pid: int,
    base: str,
    model_name: str,
    prompts: list[list[int]],
    load: tuple[int, int, int],
    progress,
) -> tuple[list[dict], list[tuple[int, float]]]:
    """The soak itself: `load` (requests, clients, max tokens) sent by client threads taking the
    next request index in turn; returns every outcome, and the server's (`pid`) RSS read every 20
    answers."""
    requests, clients, max_tokens = load
    outcomes: list[dict] = []
    rss: list[tuple[int, float]] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def client_thread() -> None:
        with httpx.Client() as client:
            for index in counter:
                try:
                    outcome = soak_request(client, base, model_name, index, prompts[index % len(prompts)], max_tokens)
                except (SparsegenError, httpx.HTTPError) as exc:
                    outcome = {"kind": "failed", "error": str(exc)}
                with lock:
                    outcomes.append({"index": index, **outcome})
                    if len(outcomes) % 20 == 0:
                        rss.append((len(outcomes), rss_mb(pid)))
                        progress(f"{len(outcomes)} requests answered, server RSS {rss[-1][1]:.0f} MB")

    threads = [threading.Thread(target=client_thread) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, rss


def soak(
    model_name: str,
    config: ServeConfig,
    requests: int = 200,
    clients: int = 16,
    max_tokens: int = 32,
    max_kv_mb: int = 512,
    text: str = "shakespeare",
    out: Path = Path("results/bench_soak"),
    progress=print,
    device: str | None = None,
) -> dict:
    """`requests` mixed requests from `clients` threads (greedy, cancelled, bad fields, too long,
    chat) against one server: its RSS along the way, rows left at the end, greedy answers checked.
    Writes `bench_soak.json` (with the run's meta) into `out`; returns the result without it."""
    from sparsegen.data import text_stretches
    from sparsegen.loading import load

    model, tokenizer = load(model_name, device=device)
    prompts = [p for length in (24, 96, 200) for p in text_stretches(tokenizer, text, 4, length)]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    options = ["--max-kv-mb", str(max_kv_mb), "--max-tokens-limit", "4096", *(["--device", device] if device else [])]
    server = start_server(config, model_name, port, options)
    with httpx.Client() as client:  # the model loaded and one answer given: the baseline
        stream_completion(client, base, {"model": model_name, "prompt": prompts[0], "max_tokens": 4, "stream": True})
    baseline = rss_mb(server.pid)
    bound_mb = httpx.get(f"{base}/health", timeout=10).json()["memory_bound"]["total"] / 2**20
    reset_peak(server.pid)  # the peak of serving, not of loading the model
    try:
        outcomes, rss = _run_clients(server.pid, base, model_name, prompts, (requests, clients, max_tokens), progress)
        time.sleep(1.5)  # the worker notices hung-up clients between steps
        health = httpx.get(f"{base}/health", timeout=10).json()
        peak = rss_mb(server.pid, "VmHWM")  # the process's own peak, between the readings too
    finally:
        server.terminate()
        server.wait(timeout=60)
    greedy = [o for o in outcomes if o["kind"] == "greedy"]
    progress(f"single-request answers of {len(prompts)} prompts")
    references = single_request_answers(model, tokenizer, config, prompts, max_tokens, 512)
    equal = sum(o["text"] == references[o["index"] % len(prompts)] for o in greedy)
    statuses = count_statuses(outcomes)
    result = {
        "config": config.label,
        "requests": len(outcomes),
        "statuses": statuses,
        "server_errors": sum(n for kinds in statuses.values() for code, n in kinds.items() if code >= "500"),
        "rss_baseline_mb": round(baseline),
        "rss_bound_mb": round(bound_mb),
        "rss_peak_mb": round(peak),
        "rss_within_bound": peak <= bound_mb,
        "greedy_equal": f"{equal}/{len(greedy)}",
        "rss_mb": rss,
        "left_active": health.get("active"),
        "left_queued": health.get("queued"),
        "failures": [o["error"] for o in outcomes if o["kind"] == "failed"][:5],
    }
    write_json(out / "bench_soak.json", {"meta": run_meta(model=model_name), **result})
    return result
