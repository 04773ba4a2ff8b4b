"""kvpress's side of `compare_kvpress`: run in kvpress's own environment (it pins transformers
below what sparsegen needs), so it imports only torch, transformers, kvpress and the standard
library, and is started by file path.

    python kvpress_worker.py input.json output.json

For every sample and press it prefills the context under the press the way kvpress's pipeline
does (query-agnostic: `model.model(context)` inside `with press(model)`), recovers which original
position each kept key row came from, per layer and KV head, then decodes the question greedily
with positions continuing from the original context length, as kvpress's pipeline does.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import kvpress
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as hf_logging


def make_press(name: str, ratio: float) -> kvpress.BasePress:
    """The kvpress press for a comparison name, with the settings sparsegen's side mirrors."""
    builders: dict[str, Callable[[], kvpress.BasePress]] = {
        "streaming": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5),
        "tova": lambda: kvpress.TOVAPress(compression_ratio=ratio),
        "knorm": lambda: kvpress.KnormPress(compression_ratio=ratio),
        "keydiff": lambda: kvpress.KeyDiffPress(compression_ratio=ratio),
        "pyramidkv": lambda: kvpress.PyramidKVPress(compression_ratio=ratio, window_size=64, kernel_size=5, beta=20),
        "expected_attention": lambda: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
        "adakv": lambda: kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=ratio)),
        "kvzip": lambda: kvpress.KVzipPress(compression_ratio=ratio, layerwise=False, n_sink=4),
    }
    if name not in builders:
        raise SystemExit(f"unknown press {name!r}; known: {', '.join(builders)}")
    return builders[name]()


def record_inputs(press: kvpress.BasePress) -> dict[int, torch.Tensor]:
    """Wrap the press's `compress` so each layer's uncompressed keys are kept: the kept rows are
    then matched against the very keys the press chose from, with no second forward."""
    seen: dict[int, torch.Tensor] = {}
    original = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        seen[module.layer_idx] = keys.detach().clone()
        return original(module, hidden_states, keys, values, attentions, kwargs)

    press.compress = compress  # an instance attribute shadows the class's method
    return seen


def match_rows(full: torch.Tensor, kept: torch.Tensor) -> list[int]:
    """Original positions of `kept` rows [k, d] among `full` rows [n, d], by exact equality
    (the press gathers rows unchanged, so every kept row is bit-identical to its source)."""
    where: dict[bytes, int] = {}
    for position, row in enumerate(full.cpu().numpy()):
        where.setdefault(row.tobytes(), position)
    positions = []
    for row in kept.cpu().numpy():
        position = where.get(row.tobytes())
        if position is None:
            raise RuntimeError("a kept key row matches no key of the uncompressed context")
        positions.append(position)
    return sorted(positions)


def masked(module: torch.nn.Module, heads: int) -> list[set[int]]:
    """Cache slots a masking press (e.g. AdaKV) hid per KV head instead of removing them."""
    hidden: list[set[int]] = [set() for _ in range(heads)]
    indices = getattr(module, "masked_key_indices", None)
    if indices is not None:
        _, head_index, slot_index = indices
        for head, slot in zip(head_index.tolist(), slot_index.tolist(), strict=True):
            hidden[head].add(slot)
    return hidden


def kept_positions(model, cache: DynamicCache, inputs: dict[int, torch.Tensor]) -> list[list[list[int]]]:
    """Per layer and KV head, the sorted original positions the compressed cache still holds."""
    kept = []
    for index, layer in enumerate(model.model.layers):
        keys = cache.layers[index].keys[0]
        full = inputs.get(index)
        hidden = masked(layer.self_attn, keys.shape[0])
        heads = []
        for head in range(keys.shape[0]):
            slots = [slot for slot in range(keys.shape[1]) if slot not in hidden[head]]
            rows = keys[head, slots]
            heads.append(slots if full is None else match_rows(full[0, head], rows))  # None: masked in place
        kept.append(heads)
    return kept


def uneven(cache: DynamicCache) -> bool:
    """Whether the layers hold different numbers of tokens (PyramidKV). transformers 5.2 builds one
    SDPA mask from layer 0's length, so a multi-token forward then fails on the other layers."""
    return len({layer.keys.shape[-2] for layer in cache.layers}) > 1


@torch.inference_mode()
def decode(model, cache: DynamicCache, question: list[int], context_length: int, limit: int, stops: set[int]):
    """Greedy answer as kvpress's pipeline makes it: the question at positions continuing from the
    original context length, then one token at a time until a stop token (kept) or `limit`. As
    there, only tokens after the first are checked for a stop. Where the layers are uneven the
    question is read one token per forward (same causal attention, no mask needed)."""
    ids = torch.tensor([question])
    positions = torch.arange(context_length, context_length + len(question)).unsqueeze(0)
    chunks = [(ids, positions)]
    if uneven(cache):
        chunks = [(ids[:, i : i + 1], positions[:, i : i + 1]) for i in range(len(question))]
    for chunk, where in chunks:
        logits = model(input_ids=chunk, past_key_values=cache, position_ids=where, logits_to_keep=1).logits
    tokens = [int(logits[0, -1].argmax())]
    position = positions[:, -1:] + 1
    for step in range(limit - 1):
        ids = torch.tensor([[tokens[-1]]])
        logits = model(input_ids=ids, past_key_values=cache, position_ids=position + step).logits
        tokens.append(int(logits[0, -1].argmax()))
        if tokens[-1] in stops:
            break
    return tokens


@torch.inference_mode()
def run_one(model, sample: dict, name: str, ratio: float, stops: set[int]) -> dict:
    """One sample under one press: the kept positions and the greedy answer's token ids."""
    press = make_press(name, ratio)
    inputs = record_inputs(press)
    context = torch.tensor([sample["context_ids"]])
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=context, past_key_values=cache)
    kept = kept_positions(model, cache, inputs)
    read = "token by token" if uneven(cache) else "one forward"
    tokens = decode(model, cache, sample["question_ids"], context.shape[1], sample["max_new_tokens"], stops)
    result = {"id": sample["id"], "press": name, "ratio": ratio, "kept": kept, "tokens": tokens}
    return result | {"question_read": read}


def main() -> None:
    """Read the job, run every sample x press x ratio, write the results."""
    if len(sys.argv) != 3:
        raise SystemExit("usage: kvpress_worker.py input.json output.json")
    job = json.loads(Path(sys.argv[1]).read_text())
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    stops = set(job["eos_ids"])
    results, failures = [], []
    for sample in job["samples"]:
        for spec in job["presses"]:
            try:
                results.append(run_one(model, sample, spec["name"], spec["ratio"], stops))
            except Exception as exc:  # one failing press must not hide the others' results
                failures.append({"id": sample["id"], "press": spec["name"], "ratio": spec["ratio"], "error": repr(exc)})
            print(f"kvpress {sample['id']} {spec['name']} {spec['ratio']}", file=sys.stderr, flush=True)
    versions = {name: metadata.version(name) for name in ("kvpress", "torch", "transformers")}
    out = Path(sys.argv[2])
    out.write_text(json.dumps({"versions": versions, "results": results, "failures": failures}))


if __name__ == "__main__":
    main()
