"""DuoAttention's head calibration (`kv.duo_attention`'s `heads=`): which KV heads retrieve, measured
as the attention each head pays to the needle of synthetic passkey prompts while answering. It
runs the model, so it lives here with the evaluations; the policy only reads the saved scores.
`sparsegen eval calibrate-heads` writes them.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from sparsegen.decode.shared import SharedPrefill
from sparsegen.ioutil import write_json
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.policy import attention_received


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
            record = SharedPrefill(model, ids).record
            rows = []
            for layer in record.layers:
                call = getattr(layer, "recorded", None)
                if call is None:
                    rows.append(None)
                    continue
                received = attention_received(call.query[:, :, -answer:], call.keys, call.scaling)
                share = received[0, :, needle.start : needle.stop].sum(-1) / received[0].sum(-1)
                rows.append(share)
            some = next(row for row in rows if row is not None)
            scores = torch.stack([row if row is not None else torch.zeros_like(some) for row in rows]).cpu()
            total = scores if total is None else total + scores
    return total / samples


def save_heads(scores: torch.Tensor, path: Path | str, model_name: str) -> None:
    """Write `calibrate_heads`' scores where `heads=` reads them."""
    write_json(Path(path), {"model": model_name, "scores": scores.tolist()})
