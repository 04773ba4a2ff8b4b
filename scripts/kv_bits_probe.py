"""Which rounding of the KV keeps perplexity: teacher-forced, token by token, the full cache rounded
after every token (all but the newest `residual`), against fp32. The probe behind the ring of
`kv/quantized.py` (docs/benchmarks.md, "KV in 8 and 4 bits").

    python scripts/kv_bits_probe.py "fp32,int4 g32 r1,int4 g32 r32" 700
"""

import math
import sys

import torch
from transformers import DynamicCache

import sparsegen
from sparsegen.data import load_text, tokenize_long

PROMPT = 300
VARIANTS = {  # bits, key group, value group, full-precision newest tokens, per-channel key groups of (tokens)
    "fp32": (0, 0, 0, 0, 0),
    "int4 g32 r1": (4, 32, 32, 1, 0),
    "int4 g16 r1": (4, 16, 16, 1, 0),
    "int4 g32 r32": (4, 32, 32, 32, 0),
    "int4 g32 r128": (4, 32, 32, 128, 0),
    "int4 kivi32 r32": (4, 32, 32, 32, 32),
    "int8 g32 r1": (8, 32, 32, 1, 0),
}


def rounded(x: torch.Tensor, bits: int, group: int, along_tokens: bool = False) -> torch.Tensor:
    """x [b, h, n, d] rounded asymmetrically in groups of channels (or of tokens)."""
    if along_tokens:
        x = x.transpose(-1, -2)
    *lead, d = x.shape
    groups = x.reshape(*lead, d // group, group)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((high - low) / levels).clamp_min(1e-5)
    y = (((groups - low) / scale).round().clamp(0, levels) * scale + low).reshape(*lead, d)
    return y.transpose(-1, -2) if along_tokens else y


def perplexity(model, ids: torch.Tensor, stop: int, variant: tuple) -> float:
    bits, key_group, value_group, residual, kivi = variant
    cache, exact, nll = DynamicCache(config=model.config), None, 0.0
    with torch.inference_mode():
        logits = model(ids[None, :PROMPT], cache=cache).logits[0, -1]
        for t in range(PROMPT, stop):
            nll -= logits.log_softmax(-1)[ids[t]].item()
            if bits:
                new = [(layer.keys[:, :, -1:], layer.values[:, :, -1:]) for layer in cache.layers]
                if exact is None:
                    exact = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
                else:
                    exact = [
                        (torch.cat([k, nk], 2), torch.cat([v, nv], 2))
                        for (k, v), (nk, nv) in zip(exact, new, strict=True)
                    ]
                for layer, (keys, values) in zip(cache.layers, exact, strict=True):
                    old = keys.shape[2] - residual
                    k, v = keys.clone(), values.clone()
                    if old > 0:
                        whole = (old // kivi) * kivi if kivi else old  # per-channel groups: whole groups only
                        if whole:
                            k[:, :, :whole] = rounded(keys[:, :, :whole], bits, kivi or key_group, bool(kivi))
                        v[:, :, :old] = rounded(values[:, :, :old], bits, value_group)
                    layer.keys, layer.values = k, v
            logits = model(ids[None, t : t + 1], cache=cache).logits[0, -1]
    return math.exp(nll / (stop - PROMPT))


if __name__ == "__main__":
    model, tokenizer = sparsegen.load()
    stop = int(sys.argv[2]) if len(sys.argv) > 2 else 700
    ids = tokenize_long(tokenizer, load_text("milton"), max_tokens=stop)
    for name in sys.argv[1].split(","):
        print(name, round(perplexity(model, ids, stop, VARIANTS[name]), 3), flush=True)
