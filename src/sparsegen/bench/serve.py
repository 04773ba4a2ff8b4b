"""`sparsegen bench serve`: real HTTP clients against `sparsegen serve`, one server per point.

For each configuration (a KV policy and budget, or a baseline: another checkout's server) and
each number of clients, the command starts `sparsegen serve` in its own process (so its peak RSS
is its own), lets N client threads stream greedy completions back to back (prompts of the given
lengths from the embedded text; a 429 waits its Retry-After and tries again), polls `/health` for
the rows active and queued, and stops the server. Then it checks every answer against the
single-request `sparsegen.generate` output of the same prompt, policy and prefill chunk.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from sparsegen.bench.measure import weight_bytes
from sparsegen.errors import SparsegenError
from sparsegen.rss import rss_mb

if TYPE_CHECKING:
    from sparsegen.kv.spec import KVSpec

STARTUP_S = 900  # a cold start compiles the batched step (vLLM its own graph): minutes
COLUMNS = [
    ("config", "configuration"),
    ("clients", "clients"),
    ("tokens_per_s", "total tokens/s"),
    ("ttft_p50", "TTFT p50 s"),
    ("ttft_p99", "TTFT p99 s"),
    ("itl_p50", "ITL p50 ms"),
    ("itl_p99", "ITL p99 ms"),
    ("most_active", "most rows active"),
    ("most_queued", "most queued"),
    ("refused", "429s"),
    ("peak_rss_mb", "server peak RSS MB"),
    ("of_bound", "fraction of bound"),
    ("greedy_equal", "answers = single-request"),
]


@dataclass(frozen=True)
class ServeConfig:
    """One server to measure: `label`, its KV `policy`, `budget` and `kv_bits`, and optionally
    the `src` folder of another checkout whose server is measured instead (a baseline)."""

    label: str
    policy: str
    budget: int | float | None = None
    src: Path | None = None
    kv_bits: int | None = None

    @classmethod
    def parse(cls, spec: str) -> ServeConfig:
        """`full`, `h2o:0.2` (a share of each prompt) or `streaming:256` (tokens), each with
        `@4` or `@8` for its KV in that many bits (`full@4`, `streaming:256@8`)."""
        from sparsegen.kv.policy import count_or_share
        from sparsegen.kv.quantized import checked_bits

        setting, _, bits = spec.partition("@")
        if bits and not bits.isdigit():
            raise SparsegenError(f"{spec!r}: the bits after @ are 8, 4, 3 or 2, as in full@4")
        policy, _, budget = setting.partition(":")
        return cls(spec, policy, count_or_share(budget or None), kv_bits=checked_bits(int(bits) if bits else None))

    @property
    def kv(self) -> KVSpec:
        """The KV spec the server starts with: its `--policy`, `--budget` and `--kv-bits` options."""
        from sparsegen.kv.spec import KVSpec

        return KVSpec.of(self.policy, budget=self.budget, kv_bits=self.kv_bits)


def configs_to_measure(specs: str, baseline_src: Path | None = None) -> list[ServeConfig]:
    """The servers of comma-separated `specs`, after a baseline: another checkout's `src/` folder,
    whose server is measured too (policy full)."""
    configs = [ServeConfig.parse(spec) for spec in specs.split(",") if spec]
    if baseline_src is not None:
        if not (baseline_src / "sparsegen").is_dir():
            raise SparsegenError(f"{baseline_src} has no sparsegen package; pass the src/ folder of a checkout")
        configs.insert(0, ServeConfig(f"baseline {baseline_src}", "full", src=baseline_src.resolve()))
    return configs


def percentile(values: list[float], share: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_server(
    config: ServeConfig, model: str, port: int, options: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`sparsegen serve` for `config` in a child process (with `env` added to this one's), started."""
    command = [sys.executable, "-c", "from sparsegen.cli import main; main()", "serve", "--model", model]
    command += ["--policy", config.policy, "--port", str(port), *options]
    if config.budget is not None:
        command += ["--budget", str(config.budget)]
    if config.kv_bits is not None:
        command += ["--kv-bits", str(config.kv_bits)]
    env = {**os.environ, **(env or {})}
    if config.src is not None:
        env["PYTHONPATH"] = f"{config.src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def start_server(config: ServeConfig, model: str, port: int, options: list[str]) -> subprocess.Popen:
    """`sparsegen serve` for `config` in a child process; returns once `/health` answers."""
    server = launch_server(config, model, port, options)
    wait_for_health(server, f"http://127.0.0.1:{port}", f"the server for {config.label}")
    return server


def wait_for_health(server: subprocess.Popen, base: str, label: str, seconds: float = STARTUP_S) -> None:
    """Return once `base`/health answers 200 with its compiled step in place (`sparsegen serve`
    answers eagerly while it compiles: a measurement waits for the step it will be run with);
    raise when `server` exits or `seconds` pass (then killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SparsegenError(f"{label} exited: {server.stderr.read().strip()[-500:]}")
        try:
            response = httpx.get(f"{base}/health", timeout=1)
            response.raise_for_status()
            if not _compiling(response):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise SparsegenError(f"{label} did not answer in {seconds:.0f} s")


def _compiling(health: httpx.Response) -> bool:
    try:
        return health.json().get("step") == "compiling"
    except (ValueError, AttributeError):  # no JSON object (vLLM's health is empty)
        return False


def stream_completion(client: httpx.Client, base: str, body: dict) -> dict:
    """One streamed completion: its text, time to first token, gaps between tokens, 429s met."""
    refused = 0
    while True:
        sent = time.perf_counter()
        stamps, pieces, usage = [], [], {}
        with client.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as response:
            if response.status_code == 429:
                refused += 1
                time.sleep(float(response.headers.get("Retry-After", 1)))
                continue
            if response.status_code != 200:
                raise SparsegenError(f"the server answered {response.status_code}: {response.read()[:300]!r}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise SparsegenError(f"the server failed a request: {chunk['error']['message']}")
                usage = chunk.get("usage") or usage
                text = chunk["choices"][0]["text"] if chunk.get("choices") else ""  # the usage chunk has none
                if text:
                    stamps.append(time.perf_counter())
                    pieces.append(text)
        return {
            "text": "".join(pieces),
            "tokens": usage.get("completion_tokens", len(pieces)),
            "ttft": stamps[0] - sent if stamps else float("nan"),
            "gaps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
            "refused": refused,
            "started": sent,
            "ended": time.perf_counter(),
        }


def run_load(
    base: str, model: str, prompts: list[list[int]], clients: int, requests: int, max_tokens: int, watch: bool = True
) -> dict:
    """`clients` threads, each streaming `requests` greedy completions in turn. `watch`: poll
    `/health` for the most rows active and queued (each poll costs the measured server about a
    millisecond of CPU, which its compute threads lose on two cores: 2-5% of `sparsegen serve`'s
    tokens/s at 20 polls a second; a table without those columns does not poll)."""
    results: list[dict] = []
    failures: list[str] = []
    most = {"active": 0, "queued": 0}
    finished = threading.Event()

    def client_thread(index: int) -> None:
        with httpx.Client() as client:
            for turn in range(requests):
                which = (index * requests + turn) % len(prompts)
                body = {"model": model, "prompt": prompts[which], "max_tokens": max_tokens, "temperature": 0}
                body["stream_options"] = {"include_usage": True}  # vLLM counts tokens only when asked
                try:
                    results.append({"prompt": which, **stream_completion(client, base, {**body, "stream": True})})
                except (SparsegenError, httpx.HTTPError) as exc:
                    failures.append(str(exc))

    def poll_health() -> None:  # from before the first request, often: a short load may last a tenth of a second
        # one client for every poll: `httpx.get` builds a TLS context each call, ~20 ms of CPU that the
        # measured server's threads lost on these two cores (a quarter of a core at this rate)
        with httpx.Client() as poller:
            while not finished.is_set():
                finished.wait(0.05)
                try:
                    health = poller.get(f"{base}/health", timeout=5).json()
                except (httpx.HTTPError, ValueError):  # no answer, or no counts in it (vLLM's is empty)
                    continue
                for key in most:
                    most[key] = max(most[key], health.get(key, 0))

    watcher = threading.Thread(target=poll_health, daemon=True) if watch else None
    if watcher is not None:
        watcher.start()
    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    finished.set()
    if watcher is not None:
        watcher.join()
    if failures:
        raise SparsegenError(f"{len(failures)} requests failed, the first: {failures[0]}")
    return _load_point(results, most, watch)


def _load_point(results: list[dict], most: dict, watch: bool) -> dict:
    """`run_load`'s point from its requests' records: tokens/s over the wall time, TTFT and ITL
    percentiles, the most rows active and queued (None unwatched), the 429s and the answers."""
    wall = max(r["ended"] for r in results) - min(r["started"] for r in results)
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft"] for r in results]
    return {
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p99": percentile(ttfts, 0.99),
        "itl_p50": 1000 * percentile(gaps, 0.5),
        "itl_p99": 1000 * percentile(gaps, 0.99),
        "most_active": most["active"] if watch else None,
        "most_queued": most["queued"] if watch else None,
        "refused": sum(r["refused"] for r in results),
        "answers": [(r["prompt"], r["text"]) for r in results],
    }


def single_request_answers(model, tokenizer, config: ServeConfig, prompts, max_tokens: int, chunk: int) -> list[str]:
    """What `sparsegen.generate` answers to each prompt alone (greedy, the server's prefill chunk)."""
    from sparsegen.decode import generate

    answers = []
    for ids in prompts:
        made = generate(model, [ids], max_tokens, config.kv, compile="never", prefill_chunk=chunk)
        answers.append(tokenizer.decode(made.tokens[0], skip_special_tokens=True))
    return answers


def measure_point(
    config: ServeConfig,
    model_name: str,
    options: list[str],
    prompts: list[list[int]],
    clients: int,
    requests: int,
    max_tokens: int,
    watch: bool = True,
) -> dict:
    """`run_load` against a server of its own (so its peak RSS is its own), stopped after."""
    port = free_port()
    server = start_server(config, model_name, port, options)
    try:
        point = run_load(f"http://127.0.0.1:{port}", model_name, prompts, clients, requests, max_tokens, watch)
        point["peak_rss_mb"] = rss_mb(server.pid, "VmHWM")
    finally:
        server.terminate()
        server.wait(timeout=60)
    return point


def _plot_per_clients(rows: list[dict], configs: list[ServeConfig], out: Path, title: str) -> None:
    """Total tokens/s and p99 inter-token latency against the number of clients, a line per configuration."""
    from sparsegen.report import plot_lines

    for key, label, name in (("tokens_per_s", "total tokens/s", "tokens"), ("itl_p99", "p99 inter-token ms", "p99")):
        lines = {
            c.label: (
                [r["clients"] for r in rows if r["config"] == c.label],
                [r[key] for r in rows if r["config"] == c.label],
            )
            for c in configs
        }
        plot_lines(lines, out / f"bench_serve_{name}.png", xlabel="concurrent clients", ylabel=label, title=title)


def bench_serve(
    model_name: str,
    text: str,
    configs: list[ServeConfig],
    clients: tuple[int, ...],
    prompt_tokens: tuple[int, ...],
    max_tokens: int,
    requests: int,
    max_kv_mb: int,
    prefill_chunk: int = 512,
    max_queue: int = 64,
    distinct_prompts: int = 4,
    check: bool = True,
    out: Path = Path("results/bench_serve"),
    progress=print,
    device: str | None = None,
) -> dict:
    """Measure every (configuration, clients) point; write `bench_serve.md`, `.json` and `.png`."""
    from sparsegen.bench.measure import read_bandwidth_gbs
    from sparsegen.data import text_stretches
    from sparsegen.loading import load
    from sparsegen.report import run_meta

    bandwidth = read_bandwidth_gbs()
    model, tokenizer = load(model_name, device=device)
    step_bytes = weight_bytes(model)
    stretches = [text_stretches(tokenizer, text, distinct_prompts, length) for length in prompt_tokens]
    prompts = [by_length[r] for r in range(distinct_prompts) for by_length in stretches]  # lengths alternate
    options = ["--max-kv-mb", str(max_kv_mb), "--max-tokens-limit", str(max_tokens)]
    options += ["--device", device] if device else []
    rows = []
    for config in configs:
        references: dict[int, str] = {}
        for count in clients:
            progress(f"{config.label}: {count} clients x {requests} requests of {max_tokens} tokens")
            extra = [] if config.src else ["--prefill-chunk", str(prefill_chunk), "--max-queue", str(max_queue)]
            point = measure_point(config, model_name, options + extra, prompts, count, requests, max_tokens)
            answers = point.pop("answers")
            if check:
                alone = (model, tokenizer, max_tokens, prefill_chunk)
                point["greedy_equal"] = _greedy_equal(answers, references, alone, config, prompts, progress)
            bound = point["most_active"] * bandwidth * 1e9 / step_bytes
            rows.append({"config": config.label, "clients": count, **point, "of_bound": point["tokens_per_s"] / bound})
    meta = run_meta(
        model=model_name,
        text=text,
        prompt_tokens=list(prompt_tokens),
        max_tokens=max_tokens,
        requests_per_client=requests,
        max_kv_mb=max_kv_mb,
        prefill_chunk=prefill_chunk,
        bandwidth_gbs=bandwidth,
        weight_mb=step_bytes / 1e6,
    )
    _write_results(out, meta, rows, configs)
    return {"meta": meta, "rows": rows}


def _greedy_equal(answers: list, references: dict[int, str], alone: tuple, config, prompts, progress) -> str:
    """How many of a point's `answers` equal `sparsegen.generate`'s answer to their prompt alone
    (`alone`: the model, tokenizer, max tokens and prefill chunk), as "equal/all"; the single-request
    answers are made once per prompt and configuration and kept in `references`."""
    import torch

    model, tokenizer, max_tokens, prefill_chunk = alone
    missing = sorted({which for which, _ in answers} - references.keys())
    progress(f"{config.label}: single-request answers of {len(missing)} more prompts")
    asked = [prompts[i] for i in missing]
    with torch.inference_mode():
        made = single_request_answers(model, tokenizer, config, asked, max_tokens, prefill_chunk)
    references.update(zip(missing, made, strict=True))
    equal = sum(text == references[which] for which, text in answers)
    return f"{equal}/{len(answers)}"


def _write_results(out: Path, meta: dict, rows: list[dict], configs: list[ServeConfig]) -> None:
    """`bench_serve.json`, `bench_serve.md` (its header from the settings `meta` records) and the plot."""
    from sparsegen.ioutil import write_json, write_text
    from sparsegen.report import markdown_table

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench_serve.json", {"meta": meta, "rows": rows})
    head = (
        f"`{meta['model']}`, prompts of {','.join(map(str, meta['prompt_tokens']))} tokens from `{meta['text']}`, "
        f"{meta['max_tokens']} greedy tokens each, {meta['requests_per_client']} requests per client, --max-kv-mb "
        f"{meta['max_kv_mb']}, {meta['machine']}, {meta['date']}. Bound: most rows active x "
        f"{meta['bandwidth_gbs']:.1f} GB/s / {meta['weight_mb']:.0f} MB of weights.\n\n"
    )
    write_text(out / "bench_serve.md", head + markdown_table(rows, COLUMNS))
    _plot_per_clients(rows, configs, out, title=f"{meta['model']}: sparsegen serve, --max-kv-mb {meta['max_kv_mb']}")
