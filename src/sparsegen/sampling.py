"""The one sampler and the one stop rule, shared by every token loop (the decoder, the server,
streaming chat): how the next token is chosen, and when a generation ends."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

_PROBE = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]


def as_token_set(ids: int | Iterable[int] | None) -> set[int]:
    if ids is None:
        return set()
    return {ids} if isinstance(ids, int) else {int(i) for i in ids}


def template_tokens(tokenizer) -> set[int]:
    """The special tokens the chat template writes around turns (end-of-turn, a new turn's start):
    an answer that reaches one has ended, and none of them may show in its text."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return set()
    try:
        rendered = tokenizer.apply_chat_template(_PROBE, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this probe marks no tokens
        return set()
    special = set(tokenizer.all_special_ids) | {
        token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special
    }
    special.discard(tokenizer.unk_token_id)  # the probe's words may be unknown to a small vocabulary
    return {token for token in tokenizer(rendered, add_special_tokens=False)["input_ids"] if token in special}


def stop_tokens(model: torch.nn.Module, tokenizer=None) -> set[int]:
    """The model's generation-config EOS ids, the tokenizer's EOS, and the chat template's turn tokens."""
    config = getattr(model, "generation_config", None)
    stops = as_token_set(getattr(config, "eos_token_id", None))
    if tokenizer is not None:
        stops |= as_token_set(tokenizer.eos_token_id) | template_tokens(tokenizer)
    return stops


@dataclass(frozen=True)
class Verdict:
    """Where a row stands: `reason` is "stop", "length" or None while it goes on; `text` is what
    may be shown now (all of it once the row is done, else less what may still change)."""

    reason: str | None
    text: str


@dataclass(frozen=True)
class StopRule:
    """When a row's generation ends, and which of its text is safe to stream before it does.

    A row ends at its first token in `token_ids` (kept in the tokens, never in the text), at the
    first of `strings` in its text (cut there), or after `max_tokens`. `decode` turns tokens into
    text; without it the text is empty and only tokens and length stop a row.
    """

    max_tokens: int
    token_ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None

    def judge(self, tokens: list[int]) -> Verdict:
        """The verdict on a row whose tokens so far are `tokens`, asked after every new token (so
        a stop token can only be the last one)."""
        stopped = bool(tokens) and tokens[-1] in self.token_ids
        text = self.decode(tokens[:-1] if stopped else tokens) if self.decode is not None else ""
        hit = min((text.find(s) for s in self.strings if s and s in text), default=-1)
        if hit >= 0:
            return Verdict("stop", text[:hit])
        if stopped:
            return Verdict("stop", text)
        if len(tokens) >= self.max_tokens:
            return Verdict("length", text)
        return Verdict(None, text[: len(text) - self.held_back(text)])

    def held_back(self, text: str) -> int:
        """How many characters at the end of `text` a streamer must hold back: the longest end
        that begins a stop string, or trailing U+FFFD (a character whose bytes have not all come)."""
        partial_stop = max(
            (size for s in self.strings for size in range(len(s) - 1, 0, -1) if text.endswith(s[:size])),
            default=0,
        )
        undecoded = len(text) - len(text.rstrip("\ufffd"))
        return max(partial_stop, undecoded)


def choose(
    logits: torch.Tensor,
    temperature: float | list[float],
    top_p: float | list[float],
    generators: list[torch.Generator | None] | None,
) -> torch.Tensor:
    """The one sampler: the next token of each row [b] from logits [b, vocab], greedy where the
    row's temperature is 0, else drawn from its top-p nucleus with the row's own generator (so a
    row samples as its single-row run, on any device: the draw is made on the CPU). `temperature`
    and `top_p` are one value or one per row."""
    rows = logits.shape[0]
    temperatures = temperature if isinstance(temperature, list) else [temperature] * rows
    top_ps = top_p if isinstance(top_p, list) else [top_p] * rows
    tokens = logits.argmax(-1)
    for row, (t, p, generator) in enumerate(zip(temperatures, top_ps, generators or [None] * rows, strict=True)):
        if t > 0:
            probs = (logits[row].float().cpu() / t).softmax(-1)
            if p < 1:
                sorted_probs, order = probs.sort(descending=True)
                outside = sorted_probs.cumsum(-1) - sorted_probs >= p
                probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
            tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    return tokens
