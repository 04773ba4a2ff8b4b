"""What the engine's worker sends a request's handler: one typed event at a time, from its thread.

A request gets `PromptLogprobs` first when it asked to score its prompt, then a `Token` for each
piece of text (or log-probability) ready, then exactly one `Done` or one `Failed`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Token:
    """Text newly safe to show (a stop string cannot start in it), and the token's log-probability
    entry when the request asked for them."""

    text: str
    logprob: dict | None = None


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's own token log-probabilities (`echo` with `logprobs`)."""

    entries: list[dict]


@dataclass(frozen=True)
class Done:
    """The request finished: why (`stop` or `length`), its token counts, and all the text shown."""

    finish_reason: str
    usage: dict
    text: str


@dataclass(frozen=True)
class Failed:
    """Generation raised inside the worker; the request ends with a server error."""

    message: str


Event = Token | PromptLogprobs | Done | Failed


def token_entry(logprobs: torch.Tensor, token: int, top: int) -> dict:
    """A token's log-probability entry: its own, and the `top` most likely tokens' (0: none)."""
    best = logprobs.topk(max(top, 1))
    return {
        "id": token,
        "logprob": float(logprobs[token]),
        "top": {int(i): float(v) for v, i in zip(best.values, best.indices, strict=True)} if top else None,
    }


def prompt_entries(ids: list[int], logits: torch.Tensor, top: int) -> list[dict]:
    """Per prompt token: its log-probability given the tokens before it (None for the first)."""
    logprobs = logits[:-1].log_softmax(-1)
    entries = [{"id": ids[0], "logprob": None, "top": None}]
    for position, token in enumerate(ids[1:]):
        entries.append(token_entry(logprobs[position], token, top))
    return entries
