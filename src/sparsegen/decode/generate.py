"""`generate()`: batched decoding on the fast path, greedy or sampled, rows of any lengths."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sparsegen.decode.engine import Decoder
from sparsegen.decode.kvzip_read import repeat_frame
from sparsegen.decode.shared import SharedPrefill
from sparsegen.errors import SparsegenError
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.policy import Policy
from sparsegen.kv.spec import KVSpec
from sparsegen.sampling import StopRule, Verdict, as_token_set, choose, stop_tokens


@dataclass
class Generation:
    """What `generate()` made: the new tokens of each row (up to and including its stop token), and timings."""

    tokens: list[list[int]]
    mode: str
    compile_s: float
    prefill_s: float
    decode_s: float
    decode_steps: int
    batch: int

    @property
    def tokens_per_s(self) -> float:
        """Decoded tokens per second over all rows (the prefill's first token and compiling excluded)."""
        return self.batch * self.decode_steps / self.decode_s if self.decode_s else float("nan")

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.decode_s / self.decode_steps if self.decode_steps else float("nan")


def _rows(input_ids, attention_mask) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids if input_ids.dim() == 2 else input_ids[None]
        if attention_mask is None:
            return ids.tolist()
        return [row[mask.bool()].tolist() for row, mask in zip(ids, attention_mask, strict=True)]
    if attention_mask is not None:
        raise SparsegenError("attention_mask goes with a tensor of input_ids; lists of ids need none")
    return [list(row) for row in input_ids]


def _sampler(rows: int, temperature: float, top_p: float, seed: int | None) -> Callable:
    """The token loop's `sample(logits, batch)`: greedy, or (temperature > 0) each prompt's row drawn
    from its own generator seeded `seed`, so a row draws the same whichever rows share its batch."""
    generators = None
    if temperature > 0:
        generators = [torch.Generator().manual_seed(seed if seed is not None else torch.seed()) for _ in range(rows)]

    def sample(logits: torch.Tensor, batch: list[int]) -> torch.Tensor:
        drawn_with = None if generators is None else [generators[index] for index in batch]
        return choose(logits, temperature, top_p, drawn_with)

    return sample


def _new_decoder(model, kv, tokenizer, notify, **settings) -> Decoder:
    """generate()'s own decoder: stderr's notes unless `notify` is given; for a KVzip that asks the
    model to repeat the prompt (`instructed`), the `tokenizer`'s words for it."""
    options = {"notify": notify} if notify is not None else {}
    if tokenizer is not None and KVSpec.coerce(kv).policy.asks_to_repeat:
        options["frame"] = repeat_frame(tokenizer)
    return Decoder(model, kv, **settings, **options)


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor | list[list[int]],
    max_new_tokens: int = 128,
    kv: KVSpec | str | Policy = "full",
    *,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    tokenizer=None,
    compile: str = "auto",
    kv_dtype: torch.dtype | None = None,
    streamer=None,
    notify: Callable[[str], None] | None = None,
    decoder: Decoder | None = None,
    prefill_chunk: int | None = None,
    held: list | None = None,
    shared_context: SharedPrefill | None = None,
) -> Generation:
    """Generate up to `max_new_tokens` per row on the fast path under the KV spec `kv` (a
    `KVSpec`, or a bare policy name: that policy at its defaults).

    `input_ids` is a [b, n] tensor (left- or right-padded, with its `attention_mask`) or a list
    of token lists of any lengths; `held` may give a row a policy cache to continue (a soft
    prompt's, a conversation's), and `shared_context` the `SharedPrefill` all of them were made from
    (its context's KV then read once per step for the rows that keep every new token). Rows stop
    at `eos_token_id`, by default the model's EOS and, given the `tokenizer`, its EOS and the chat
    template's turn tokens (`stop_tokens`), as the CLI and the server stop; the batch
    stops when every row has. Prompts are read `prefill_chunk` tokens per forward (None: one).
    Sampling (temperature > 0, top-p) draws each row from its own generator seeded `seed`.
    A spec's `kv_bits` holds keys and values in that many bits (`kv.quantized`; None: `kv_dtype`).
    `streamer` (a transformers streamer, batch 1) receives tokens as they come; `notify` gets the
    one-line notes on compiling (default: stderr). A `decoder` may be passed to reuse its compiled step.
    """
    if max_new_tokens < 1:
        raise SparsegenError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = _rows(input_ids, attention_mask)
    stops = stop_tokens(model, tokenizer) if eos_token_id is None else as_token_set(eos_token_id)
    rule = StopRule(max_new_tokens, frozenset(stops))
    own_decoder = decoder is None
    if own_decoder:
        decoder = _new_decoder(
            model, kv, tokenizer, notify, compile=compile, kv_dtype=kv_dtype, prefill_chunk=prefill_chunk
        )
    sample = _sampler(len(prompts), temperature, top_p, seed)
    compiled_before = decoder.compile_s  # a passed decoder may have compiled in an earlier call
    with policy_attention(model):  # the model's own attention again when generation ends
        try:
            loop = token_loop(decoder, prompts, held, rule, sample, shared_context)
            tokens, prefill_s, decode_s, steps = _timed(loop, streamer)
            compile_s = decoder.compile_s - compiled_before
            decode_s -= compile_s
            steps -= compile_s > 0  # the step that compiled is not counted
            mode = decoder.mode  # before release(), which steps eagerly from then on
        finally:
            if own_decoder:
                decoder.release()  # the model as the caller gave it (a passed decoder is the caller's)
    return Generation(tokens, mode, compile_s, prefill_s, decode_s, steps, len(prompts))


class Progress(NamedTuple):
    """The token loop after a step: the tokens it sampled [b], each row's tokens so far (a row
    takes none after its end) and each row's verdict."""

    tokens: torch.Tensor
    rows: list[list[int]]
    verdicts: list[Verdict]


def token_loop(
    decoder: Decoder, prompts, held, rule: StopRule, sample: Callable, shared_context: SharedPrefill | None = None
) -> Iterator[Progress]:
    """The token loop: prefill, then one step per token until `rule` ends every row. `sample`
    takes the logits [b, vocab] and the prompt index of each of their rows. Rows that ended take
    no more tokens; while the step is eager they leave the batch once they are a quarter of it
    (their KV is no longer read), a compiled step keeps its shape and they ride along."""
    caches, logits = decoder.prefill(prompts, held)
    decoder.start_from(caches, rule.max_tokens, shared_context)
    rows: list[list[int]] = [[] for _ in prompts]
    verdicts = [Verdict(None, "")] * len(prompts)
    batch = list(range(len(prompts)))  # the prompt each row of the batch decodes
    token = sample(logits, batch)
    while True:
        for index, value in zip(batch, token.tolist(), strict=True):
            if verdicts[index].reason is None:
                rows[index].append(value)
                verdicts[index] = rule.judge(rows[index])
        yield Progress(token, rows, verdicts)
        ended = [row for row, index in enumerate(batch) if verdicts[index].reason is not None]
        if len(ended) == len(batch):
            return
        if decoder.mode != "compiled" and 4 * len(ended) >= len(batch):
            order = decoder.leave(ended)
            token, batch = token[order], [batch[row] for row in order]
        token = sample(decoder.step(token), batch)


def _timed(loop: Iterator[Progress], streamer) -> tuple[list[list[int]], float, float, int]:
    """Run the token loop to its end, feeding `streamer`: the rows' tokens, the prefill's and the
    decode's seconds, and the decode steps."""
    started = time.perf_counter()
    progress = next(loop)  # the prefill and its token
    prefill_s = time.perf_counter() - started
    started, steps = time.perf_counter(), 0
    if streamer is not None:
        streamer.put(progress.tokens)
    for progress in loop:  # the last one holds the rows
        steps += 1
        if streamer is not None:
            streamer.put(progress.tokens)
    decode_s = time.perf_counter() - started
    if streamer is not None:
        streamer.end()
    return progress.rows, prefill_s, decode_s, steps
