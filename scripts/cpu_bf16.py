"""What bf16 buys on this CPU (issue 58, item 2): the default model's prompt reads and batch-1 decode
in fp32 and in bf16, and a GGUF file's prompt reads with its blocks' integer dots at every row count
against the blocks decoded to bf16 for a prompt's GEMM (`GGUFLinear.float_weight`), with the
perplexity of each over the same text (2 windows of 1,024 tokens of Milton). Run it alone on a quiet
machine:

    python scripts/cpu_bf16.py [GGUF_MODEL ...]     # e.g. qwen2.5-coder-1.5b (512-token reads only)
"""

import sys
import time

import torch

import sparsegen
from sparsegen.eval.perplexity import windowed_ppl
from sparsegen.models import cpu_bf16_flag
from sparsegen.quant.gguf_blocks import GGUFLinear


def dense_rows() -> None:
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model, tokenizer = sparsegen.load(dtype=dtype)
        ids = torch.as_tensor(sparsegen.tokenize_long(tokenizer, sparsegen.load_text("shakespeare"), 4096)).view(1, -1)
        for length in (512, 4096):
            best = min(sparsegen.generate(model, ids[:, :length], 1, compile="never").prefill_s for _ in range(2))
            print(f"default model {name}: prompt {length}: {best:.2f} s ({length / best:.0f} tokens/s)", flush=True)
        for compile in ("never", "always"):
            runs = [sparsegen.generate(model, ids[:, :1024], 64, compile=compile, eos_token_id=[]) for _ in range(2)]
            print(f"default model {name}: decode after 1024, {runs[-1].mode}: {runs[-1].ms_per_step:.2f} ms/token")


def gguf_rows(name: str) -> None:
    model, tokenizer = sparsegen.load(name, gguf_blocks=True)
    ids = torch.as_tensor(sparsegen.tokenize_long(tokenizer, sparsegen.load_text("shakespeare"), 4096)).view(1, -1)
    held_out = sparsegen.tokenize_long(tokenizer, sparsegen.load_text("milton"), 2048)
    layers = [module for module in model.modules() if isinstance(module, GGUFLinear)]
    native = layers[0].float_above_rows
    for label, above in (("integer dots at every row count", None), ("bf16 GEMM above 16 rows", native)):
        if label.startswith("bf16") and above is None:
            print(f"{name}: no bf16 prompt path on this CPU")
            continue
        for layer in layers:
            layer.float_above_rows = above
        for length in (512, 4096) if name == "smollm2-135m" else (512,):  # a larger model: one short read
            best = min(sparsegen.generate(model, ids[:, :length], 1, compile="never").prefill_s for _ in range(2))
            print(f"{name} GGUF blocks, {label}: prompt {length}: {best:.2f} s ({length / best:.0f} tokens/s)")
        ppl = windowed_ppl(model, torch.as_tensor(held_out), 1024, 2, progress=False).ppl
        print(f"{name} GGUF blocks, {label}: perplexity on Milton (2 x 1024 tokens) {ppl:.4f}", flush=True)


def main(names: list[str]) -> None:
    torch.manual_seed(0)
    print(f"bf16 flag: {cpu_bf16_flag()}, threads {torch.get_num_threads()}, {time.strftime('%F %T')}")
    dense_rows()
    for name in ["smollm2-135m", *names]:
        gguf_rows(name)


if __name__ == "__main__":
    main(sys.argv[1:])
