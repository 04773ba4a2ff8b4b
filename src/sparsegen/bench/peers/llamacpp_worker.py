"""llama.cpp's decode speed on a GGUF file, run by `sparsegen bench decode --llama-cpp PYTHON` under
that other interpreter (where llama-cpp-python is installed), so it imports nothing of sparsegen.

Usage: PYTHON llamacpp_worker.py GGUF PROMPT_IDS.json NEW_TOKENS THREADS [FLASH] -> one JSON line on
stdout: ms per greedy decode step after the prompt, prefill seconds, the tokens, peak RSS. FLASH "1"
turns llama.cpp's flash attention on (off by default, as the binding has it).
"""

from __future__ import annotations

import json
import sys
import time


def peak_rss_mb() -> float:
    """This process's own peak (VmHWM): getrusage would report the parent's, carried over by exec."""
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) / 1024 for line in handle if line.startswith("VmHWM"))


def main() -> None:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    gguf, ids_file, new_tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    flash = len(sys.argv) > 5 and sys.argv[5] == "1"
    with open(ids_file) as handle:
        prompt = json.load(handle)
    size = len(prompt) + new_tokens + 8
    model = Llama(
        gguf, n_ctx=size, n_threads=threads, n_threads_batch=threads, n_batch=512, flash_attn=flash, verbose=False
    )
    started = time.perf_counter()
    model.eval(prompt)
    prefill_s = time.perf_counter() - started
    tokens, steps = [], []
    vocab = model.n_vocab()
    for _ in range(new_tokens):
        last = llama_cpp.llama_get_logits_ith(model.ctx, -1)  # the newest position's logits
        token = int(np.argmax(np.ctypeslib.as_array(last, shape=(vocab,))))
        tokens.append(token)
        started = time.perf_counter()
        model.eval([token])
        steps.append(time.perf_counter() - started)
    timed = sorted(steps[2:]) or [float("nan")]  # the first steps warm caches
    print(
        json.dumps(
            {
                "ms": 1e3 * sum(timed) / len(timed),
                "prefill_s": prefill_s,
                "tokens": tokens,
                "rss": peak_rss_mb(),
            }
        )
    )


if __name__ == "__main__":
    main()
