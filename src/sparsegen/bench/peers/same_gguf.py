"""sparsegen and llama.cpp on one GGUF file, as a skeptic compares them (`sparsegen bench peers`):
batch-1 decode after a context, prompt reads of a few lengths, and position by position over a
text the tests do not use, how often their next-token choices agree and each one's perplexity.

sparsegen runs `sparsegen.load(FILE.gguf)`: the file's own blocks with integer-dot products
(`quant.gguf_blocks`), nothing re-quantized. llama.cpp runs the same file through llama-cpp-python
in its own interpreter, with its flash attention off and on, fed the same token ids at the same
thread count. Each figure is the median of its rounds, the engines measured in turn.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from sparsegen.errors import SparsegenError

FLASH = {"llama.cpp": False, "llama.cpp flash-attn": True}


def prompt_read_worker(gguf: str, ids: list[int], threads: int) -> dict:
    """Seconds sparsegen takes to read `ids` into a fresh full cache (one warm-up read first)."""
    from sparsegen.decode.reading import read
    from sparsegen.kv import make_cache
    from sparsegen.loading import load

    torch.set_num_threads(threads)
    model, _ = load(gguf, device="cpu")
    with torch.inference_mode():
        read(model, ids[:64], make_cache(model, "full"))
        started = time.perf_counter()
        read(model, ids, make_cache(model, "full"))
    return {"prefill_s": time.perf_counter() - started}


def sparsegen_choices(gguf: str, ids: list[int], threads: int) -> dict:
    """sparsegen's argmax at every position but the last, and the NLL of each next id."""
    from sparsegen.decode.reading import read
    from sparsegen.kv import make_cache
    from sparsegen.loading import load

    torch.set_num_threads(threads)
    model, _ = load(gguf, device="cpu")
    with torch.inference_mode():
        logits = read(model, ids, make_cache(model, "full"), all_logits=True)[:-1].double()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
    return {"top1": logits.argmax(-1).tolist(), "nll": nll.tolist()}


def agreement(ours: dict, theirs: dict) -> dict:
    """Top-1 agreement and both perplexities from two engines' choices over the same positions."""
    positions = len(ours["top1"])
    if positions != len(theirs["top1"]) or positions == 0:
        raise SparsegenError(f"the engines scored {positions} and {len(theirs['top1'])} positions: not comparable")
    same = sum(a == b for a, b in zip(ours["top1"], theirs["top1"], strict=True))
    ppl_ours = math.exp(sum(ours["nll"]) / positions)
    ppl_theirs = math.exp(sum(theirs["nll"]) / positions)
    return {
        "positions": positions,
        "top1_agreement": same / positions,
        "ppl_sparsegen": ppl_ours,
        "ppl_llama_cpp": ppl_theirs,
        "ppl_change": ppl_ours / ppl_theirs - 1,
    }


def prompt_rows(python: str | None, gguf: str, prompts: dict[int, list[int]], threads: int, rounds: int,
                progress=print) -> list[dict]:  # fmt: skip
    """Prompt reads of each length: sparsegen, then llama.cpp with flash attention off and on,
    in turn for `rounds` rounds; each row its median round (tokens/s) and the ratio to llama.cpp's
    better setting."""
    from sparsegen.bench.measure import in_process
    from sparsegen.bench.peers.llamacpp import llama_cpp_row

    measured: dict[tuple[int, str], list[float]] = {}
    for round_ in range(1, rounds + 1):
        for length, ids in prompts.items():
            progress(f"prompt read of {length} tokens on {Path(gguf).name} (round {round_} of {rounds})")
            ours = in_process(prompt_read_worker, gguf, ids, threads)["prefill_s"]
            measured.setdefault((length, "sparsegen GGUF blocks"), []).append(ours)
            for label, flash in FLASH.items() if python else ():
                row = llama_cpp_row(python, "", ids, 3, threads, gguf=Path(gguf), flash=flash)
                measured.setdefault((length, label), []).append(row["prefill_s"])
    rows = []
    for (length, engine), seconds in measured.items():
        ordered = sorted(seconds)
        rows.append({"tokens": length, "engine": engine, "s": ordered[(len(ordered) - 1) // 2],
                     "s_rounds": f"{ordered[0]:.2f}-{ordered[-1]:.2f}"})  # fmt: skip
        rows[-1]["tokens_per_s"] = length / rows[-1]["s"]
    for row in rows:
        theirs = [r["tokens_per_s"] for r in rows if r["tokens"] == row["tokens"] and r["engine"] in FLASH]
        row["vs_llama_cpp"] = row["tokens_per_s"] / max(theirs) if theirs else None
    return rows
