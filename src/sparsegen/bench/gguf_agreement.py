"""sparsegen and llama.cpp on one GGUF file, position by position: how often their next-token
choices agree over a text the tests do not use, and each one's perplexity of it.

sparsegen reads the text through `sparsegen.load(FILE.gguf)` (the file's blocks, integer-dot
products, `quant.gguf_blocks`) in one forward of the full cache; llama.cpp through
`llamacpp_logits_worker.py` in its own interpreter, fed the same token ids.
"""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
from pathlib import Path

import torch

from sparsegen.errors import SparsegenError


def sparsegen_choices(gguf: Path, ids: list[int], threads: int) -> dict:
    """sparsegen's argmax at every position but the last, and the NLL of each next id."""
    from sparsegen.loading import load

    torch.set_num_threads(threads)
    model, _ = load(str(gguf), device="cpu")
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
    return {"top1": logits.argmax(-1).tolist(), "nll": nll.tolist()}


def llama_cpp_choices(python: str, gguf: Path, ids: list[int], threads: int) -> dict:
    """llama.cpp's argmax and NLLs at the same positions, under the interpreter `python`."""
    worker = Path(__file__).with_name("llamacpp_logits_worker.py")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
        json.dump(ids, handle)
        handle.flush()
        command = [python, str(worker), str(gguf), handle.name, str(threads)]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SparsegenError(f"llama.cpp failed under {python} ({last}); is llama-cpp-python installed there?")
    return json.loads(done.stdout.strip().splitlines()[-1])


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
