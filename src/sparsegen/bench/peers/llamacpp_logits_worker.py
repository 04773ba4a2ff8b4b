"""llama.cpp's next-token choices and log-likelihoods over a text, on a GGUF file, run by `sparsegen
bench peers` under the interpreter where llama-cpp-python is installed (it imports nothing of sparsegen).

Usage: PYTHON llamacpp_logits_worker.py GGUF IDS.json THREADS [FLASH] -> one JSON line on stdout: at
each position but the last, the argmax of llama.cpp's logits and the negative log-likelihood of the
next id. FLASH "1" turns llama.cpp's flash attention on.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import numpy as np
    from llama_cpp import Llama

    gguf, ids_file, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    flash = len(sys.argv) > 4 and sys.argv[4] == "1"
    with open(ids_file) as handle:
        ids = json.load(handle)
    size = len(ids) + 8
    model = Llama(
        gguf, n_ctx=size, n_threads=threads, n_threads_batch=threads, logits_all=True, flash_attn=flash, verbose=False
    )
    model.eval(ids)
    logits = np.asarray(model.scores[: len(ids) - 1], dtype=np.float64)  # position i predicts id i + 1
    shifted = logits - logits.max(-1, keepdims=True)
    log_norm = np.log(np.exp(shifted).sum(-1))
    nll = log_norm - shifted[np.arange(len(ids) - 1), ids[1:]]
    print(json.dumps({"top1": logits.argmax(-1).tolist(), "nll": nll.tolist()}))


if __name__ == "__main__":
    main()
