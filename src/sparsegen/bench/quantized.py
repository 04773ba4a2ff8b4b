"""The quantized rows of `sparsegen bench decode`: int8 and int4 checkpoints of the model decoding
packed and their perplexity against their own dequantized selves (llama.cpp beside them on the
model's GGUF is `peers.llamacpp`).
"""

from __future__ import annotations

from pathlib import Path

import torch

# What each row quantizes: RTN, asymmetric, at the default group size of its bits (int4: 128
# inputs, 96 on SmolLM2's 576-wide rows, run as groups of 32; int8: one scale a row).
SCHEMES = {"int8": 8, "int4": 4}


def quantized_checkpoints(model_name: str, out: Path, device: str | None = None) -> dict[str, Path]:
    """Write each scheme's RTN checkpoint of `model_name` under `out` (rebuilt every run)."""
    from sparsegen.loading import load
    from sparsegen.quant import quantize
    from sparsegen.quant.checkpoint import save_quantized

    folders = {}
    for label, bits in SCHEMES.items():
        model, tokenizer = load(model_name, packed=False, device=device)  # quantized: fp32 on a CPU
        report = quantize(model, "rtn", bits, progress=False)
        folders[label] = save_quantized(model, tokenizer, out / label, report)
    return folders


def quality_worker(folder: str, text: str, seqlen: int, windows: int, threads: int, device: str | None = None) -> dict:
    """Windowed perplexity of the packed model and of its dequantized self on the same windows."""
    from sparsegen.data import load_text, tokenize_long
    from sparsegen.eval.perplexity import windowed_ppl
    from sparsegen.loading import load

    torch.set_num_threads(threads)
    packed, tokenizer = load(folder, device=device)
    ids = tokenize_long(tokenizer, load_text(text), max_tokens=seqlen * windows)
    ours = windowed_ppl(packed, ids, seqlen, windows, progress=False).ppl
    del packed
    floats, _ = load(folder, packed=False, device=device)
    theirs = windowed_ppl(floats, ids, seqlen, windows, progress=False).ppl
    return {"ppl_packed": ours, "ppl_dequantized": theirs, "ppl_change": ours / theirs - 1, "tokens": ids.numel()}


def integer_dot_quality_worker(folder: str, text: str, tokens: int, threads: int) -> dict:
    """Perplexity of an int4 checkpoint with integer-dot products against its weight-only self,
    both read 16 tokens a forward into a full cache, so every product is one the decode step makes
    (more rows than that take the float path, `quant.int_dot.MAX_ROWS`)."""
    from sparsegen.data import load_text, tokenize_long
    from sparsegen.eval.stream_ppl import stream_ppl
    from sparsegen.loading import load
    from sparsegen.quant.int_dot import MAX_ROWS

    torch.set_num_threads(threads)
    result = {}
    for label, bits in (("weight_only", None), ("integer_dot", 8)):
        model, tokenizer = load(folder, activation_bits=bits)
        ids = tokenize_long(tokenizer, load_text(text), max_tokens=tokens)
        result[f"ppl_{label}"] = stream_ppl(model, ids, "full", chunk=MAX_ROWS, progress=False).ppl
    return {**result, "ppl_change": result["ppl_integer_dot"] / result["ppl_weight_only"] - 1, "tokens": tokens}
