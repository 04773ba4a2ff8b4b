"""Random-weight Llama checkpoints of real shapes, written one block at a time: the models larger
than RAM that the from-disk path is measured on (their numbers say what memory and time cost,
not quality). `sparsegen bench random-model` writes them, `bench gpu` builds its shapes, and the
tests write the `tiny` one; it sits outside bench/ so that none of them needs the harnesses.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from sparsegen.errors import SparsegenError
from sparsegen.ioutil import save_safetensors, write_json
from sparsegen.models import pick_device

SHAPES = {  # Llama-2's shapes; the vocabulary is the tokenizer's
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32),
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32),
    # Llama-3's (with their own vocabulary): what `bench gpu` builds on the GPU
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),  # for tests of the benchmarks
}  # fmt: skip


def llama_config(shape: str | dict, vocab_size: int) -> LlamaConfig:
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise SparsegenError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    settings = dict(vocab_size=vocab_size, max_position_embeddings=4096, tie_word_embeddings=False)
    return LlamaConfig(**{**settings, **shape})


def write_random_llama(
    out: str | Path,
    shape: str | dict,
    tokenizer: PreTrainedTokenizerBase,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    progress: bool = True,
    device: str | None = None,
) -> Path:
    """Write a Llama of `shape` with N(0, 0.02) weights and unit norms to `out`, one shard a block,
    never holding more than one block; the folder appears whole when done. The weights are drawn
    on `device` (a GPU draws an 8B model's in seconds); a seed gives the same weights on the same
    kind of device."""
    out = Path(out)
    config = llama_config(shape, len(tokenizer))
    config.dtype = dtype
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    device = pick_device(device)
    generator = torch.Generator(device).manual_seed(seed)
    count = config.num_hidden_layers
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weight_map = {}

    def write(index: int, names: list[str]) -> None:
        tensors = {}
        for name in names:
            shape_ = skeleton.get_parameter(name).shape
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape_, dtype=dtype)
            else:
                tensors[name] = (torch.randn(shape_, generator=generator, device=device) * 0.02).to(dtype).cpu()
        file = f"model-{index + 1:05d}-of-{count + 1:05d}.safetensors"
        save_safetensors(partial / file, tensors)
        weight_map.update(dict.fromkeys(tensors, file))

    names = [name for name, _ in skeleton.named_parameters()]
    for index in tqdm(range(count), desc=f"random llama {out.name}", unit="block", disable=not progress):
        write(index, [name for name in names if name.startswith(f"model.layers.{index}.")])
    write(count, [name for name in names if not name.startswith("model.layers.")])
    total = sum((partial / file).stat().st_size for file in set(weight_map.values()))
    write_json(partial / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if out.exists():
        shutil.rmtree(out)
    os.replace(partial, out)
    return out
