"""A request as the engine holds it (`Job`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparsegen.kv import PolicyCache
from sparsegen.kv.spec import KVSpec
from sparsegen.sampling import StopRule
from sparsegen.serve.events import Event, Token


@dataclass(eq=False)  # a request is itself: compared by identity
class Job:
    """One request: what to read, how to decode, and where the worker sends what it makes.

    `emit(event)` is called from the worker thread with the request's events (`serve.events`).
    `text` is the rendered prompt of a chat (for conversation reuse); completions leave it None
    and always start a fresh cache. `kv` is the request's KV spec (the engine's default when None).
    """

    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[Event], None]
    text: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False
    kv: KVSpec | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    # worker state
    kv_need: int = 0
    rule: StopRule | None = None
    cache: PolicyCache | None = None
    to_read: list[int] = field(default_factory=list)
    read_logits: list[torch.Tensor] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    shown: str = ""
    generator: torch.Generator | None = None
    cached_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    def take_token(self, token: int, entry: dict | None) -> str | None:
        """Record one sampled token and send the text not sent yet that the stop rule lets show;
        the finish reason once the answer is done."""
        self.generated.append(token)
        verdict = self.rule.judge(self.generated)
        if len(verdict.text) > len(self.shown) or entry is not None:
            self.emit(Token(verdict.text[len(self.shown) :], entry))
            self.shown = max(verdict.text, self.shown, key=len)
        return verdict.reason


def sampling_defaults(model) -> dict:
    """A request's sampling defaults from the model's generation config, as `model.generate()`
    would use it: greedy unless the config samples, then its temperature and top-p."""
    config = getattr(model, "generation_config", None)
    if config is None or not getattr(config, "do_sample", False):
        return {"temperature": 0.0, "top_p": 1.0}
    return {"temperature": float(config.temperature or 1.0), "top_p": float(config.top_p or 1.0)}
