"""What a client asked (`GenerationRequest`, immutable) and the engine's state for it (`Job`)."""

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


@dataclass(frozen=True)
class GenerationRequest:
    """What a client asked, as the API layer validated it: never changed after.

    `text` is the rendered prompt of a chat (for conversation reuse); completions leave it None
    and always start a fresh cache. `kv` is the request's KV spec (`Server.check` built it over the
    engine's default). Sampling values are final: the model's defaults already filled in.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int
    kv: KVSpec
    text: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False

    def __post_init__(self) -> None:  # lists from the caller, held as tuples: nothing can change them
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass(eq=False)  # a job is itself: compared by identity
class Job:
    """The engine's state for one `request`: where it stands in reading, decoding and admission.

    `emit(event)` is called from the worker thread with the request's events (`serve.events`);
    `rule` is the stop rule the engine made for it; `cancelled` is set by whoever stops listening.
    """

    request: GenerationRequest
    emit: Callable[[Event], None]
    rule: StopRule
    kv_need: int  # the most bytes of KV it may hold (`Admission.need`)
    cancelled: threading.Event = field(default_factory=threading.Event)
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
