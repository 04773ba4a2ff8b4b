"""Per-head calibrations that run the model, so they live here with the evaluations; the policies
only read what is saved.

- DuoAttention's (`kv.duo_attention`'s `heads=`): which KV heads retrieve, measured as the attention
  each head pays to the needle of synthetic passkey prompts while answering (`sparsegen eval
  calibrate-heads`).
- TriAttention's (`kv.triattention`'s `centres=`): where each query head's queries sit before RoPE
  over a text (`sparsegen eval calibrate-centres`).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from sparsegen.decode.shared import SharedPrefill
from sparsegen.errors import SparsegenError
from sparsegen.ioutil import write_json
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.policy import attention_received
from sparsegen.kv.triattention import band_statistics


def passkey_prompt(tokenizer: PreTrainedTokenizerBase, length: int, rng: random.Random) -> tuple[list[int], range, int]:
    """A synthetic passkey prompt of about `length` tokens, answered: (ids, the needle's token
    span, how many answer tokens end it)."""
    filler = tokenizer(" The grass is green. The sky is blue. The sun is yellow. Here we go.", add_special_tokens=False)
    key = str(rng.randrange(10_000, 100_000))
    needle = tokenizer(f" The pass key is {key}. Remember it. {key} is the pass key.", add_special_tokens=False)
    question = tokenizer(" What is the pass key? The pass key is", add_special_tokens=False)["input_ids"]
    answer = tokenizer(f" {key}.", add_special_tokens=False)["input_ids"]
    repeats = max(2, (length - len(needle["input_ids"]) - len(question)) // len(filler["input_ids"]))
    before = rng.randrange(1, repeats)
    head = filler["input_ids"] * before
    ids = head + needle["input_ids"] + filler["input_ids"] * (repeats - before) + question + answer
    return ids, range(len(head), len(head) + len(needle["input_ids"])), len(answer)


@torch.inference_mode()
def calibrate_heads(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, samples: int = 4, length: int = 1024, seed: int = 0
) -> torch.Tensor:
    """Retrieval score of every layer's KV heads [layers, kv_heads]: the share of the attention the
    answer's tokens pay to the needle of `samples` passkey prompts (layers without a policy, such
    as Gemma 3's sliding ones, score 0)."""
    rng = random.Random(seed)
    total = None
    with policy_attention(model):
        for _ in range(samples):
            ids, needle, answer = passkey_prompt(tokenizer, length, rng)

            def needle_share(_layer, call, needle=needle, answer=answer):
                received = attention_received(call.query[:, :, -answer:], call.keys, call.scaling)
                return received[0, :, needle.start : needle.stop].sum(-1) / received[0].sum(-1)

            scores = torch.stack(_per_recorded_layer(model, ids, needle_share)).cpu()
            total = scores if total is None else total + scores
    return total / samples


def _per_recorded_layer(model: torch.nn.Module, ids: list[int], measure) -> list[torch.Tensor]:
    """`measure(layer, call)` of every layer of one shared read of `ids` (`decode.shared`); a layer
    without a policy (Gemma 3's sliding ones) gets zeros shaped like the others'."""
    record = SharedPrefill(model, ids).record
    calls = [(layer, getattr(layer, "recorded", None)) for layer in record.layers]
    rows = [None if call is None else measure(layer, call) for layer, call in calls]
    some = next(row for row in rows if row is not None)
    return [row if row is not None else torch.zeros_like(some) for row in rows]


def save_heads(scores: torch.Tensor, path: Path | str, model_name: str) -> None:
    """Write `calibrate_heads`' scores where `heads=` reads them."""
    write_json(Path(path), {"model": model_name, "scores": scores.tolist()})


@torch.inference_mode()
def query_centres(model: torch.nn.Module, ids: list[int], sinks: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's queries before RoPE over the text `ids` (the first `sinks` left out): their
    mean [layers, query heads, d] and each RoPE band's mean magnitude [layers, query heads, bands]
    (zeros for a layer without a policy, such as Gemma 3's sliding ones)."""
    if len(ids) <= sinks:
        raise SparsegenError(f"calibrating query centres needs more than {sinks} tokens, got {len(ids)}")
    head_dim = {}

    def statistics(layer, call):
        query = call.query[:1].float()
        head_dim["d"] = query.shape[-1]
        positions = torch.arange(query.shape[2], device=query.device).expand(query.shape[:3])
        pre = layer.rope.rotate(query, -positions)[:, :, sinks:]
        return torch.cat(band_statistics(pre, layer.rope.rotary_dim), -1)[0].cpu()  # [heads, d + bands]

    with policy_attention(model):
        rows = torch.stack(_per_recorded_layer(model, ids, statistics))
    return rows[..., : head_dim["d"]], rows[..., head_dim["d"] :]


def save_centres(mean: torch.Tensor, magnitude: torch.Tensor, path: Path | str, model_name: str, text: str) -> None:
    """Write `query_centres`' statistics where `centres=` reads them."""
    saved = {"model": model_name, "text": text, "mean": mean.tolist(), "magnitude": magnitude.tolist()}
    write_json(Path(path), saved)
