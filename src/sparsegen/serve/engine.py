"""The generation engine behind the server: one worker thread, many conversations, bounded KV.

Every request becomes a `Job`. The worker reads each new job's prompt into a policy cache, then
decodes one token per active job in turn (round robin), so concurrent clients share the model
fairly and a long answer never blocks a short one. Padded batches are not supported by the KV
policies yet, so jobs are interleaved rather than batched.

Conversations: the API is stateless, so after a chat answer the worker keeps its cache together
with the exact text it has read (prompt + answer). A later request whose rendered prompt starts
with that text continues the cache and reads only the new part. Held caches are dropped least
recently used past a byte cap; a dropped conversation that comes back is rebuilt by reading its
whole history under the same policy, in chunks, so it holds what the policy keeps of the history
read once, which can differ from what the original conversation held (evicted tokens are gone).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparsegen.kv import PolicyCache, make_cache
from sparsegen.kv.decode import read


@dataclass
class Conversation:
    """A policy cache and the text it has read, which a follow-up request must start with."""

    cache: PolicyCache
    text: str = ""
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)

    def allocated_bytes(self) -> int:
        """Bytes of the cache's buffers (allocated, not only held), what the memory cap counts."""
        total = 0
        for layer in self.cache.layers:
            if layer.is_initialized:
                total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        return total


@dataclass
class Job:
    """One request: what to read, how to decode, and where the worker sends what it makes.

    `emit(kind, payload)` is called from the worker thread: ("token", dict) for each decoded
    piece, then ("done", dict) or ("error", str). `text` is the rendered prompt of a chat (for
    conversation reuse); completions leave it None and always start a fresh cache.
    """

    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[str, object], None]
    text: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    # worker state
    conversation: Conversation | None = None
    generated: list[int] = field(default_factory=list)
    shown: str = ""
    next_logits: torch.Tensor | None = None
    generator: torch.Generator | None = None
    cached_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)


class Engine:
    """Owns the model and the conversations; `submit()` is safe from any thread."""

    def __init__(
        self,
        model,
        tokenizer,
        policy: str = "streaming",
        budget: dict | None = None,
        max_kv_bytes: int = 1 << 30,
        prefill_chunk: int = 512,
        metrics=None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.policy, self.budget = policy, budget or {}
        self.max_kv_bytes, self.prefill_chunk = max_kv_bytes, prefill_chunk
        self.metrics = metrics
        make_cache(model, policy, **self.budget)  # bad settings fail now, not at the first request
        self.conversations: OrderedDict[int, Conversation] = OrderedDict()
        self.incoming: queue.Queue[Job] = queue.Queue()
        self.active: list[Job] = []
        configured = getattr(model.generation_config, "eos_token_id", None)
        configured = configured if isinstance(configured, list) else [configured]
        self.stop_ids = {tokenizer.eos_token_id, *configured} - {None}
        self.device = next(model.parameters()).device
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="sparsegen-engine", daemon=True)
        self._thread.start()

    # -- public -------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self.incoming.put(job)

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=10)

    def held_kv_bytes(self) -> int:
        with self._lock:
            caches = [c.cache for c in self.conversations.values()]
            caches += [j.conversation.cache for j in self.active if j.conversation is not None]
        return sum(cache.kv_bytes() for cache in caches)

    def stats(self) -> dict:
        with self._lock:
            return {"conversations": len(self.conversations), "active": len(self.active)}

    # -- worker -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while self._running:
            try:
                job = self.incoming.get(timeout=0.05 if not self.active else 0)
                self._guarded(job, self._start)
                continue  # admit every waiting job before the next round of decoding
            except queue.Empty:
                pass
            for job in list(self.active):
                self._guarded(job, self._step)

    def _guarded(self, job: Job, action) -> None:
        """Run one job's action; a failure ends that job with an error, never the worker."""
        try:
            with torch.inference_mode():
                action(job)
        except Exception as exc:  # one bad request must not take the server down
            self._finish(job, None)
            job.emit("error", f"{type(exc).__name__}: {exc}")

    def _forward(self, ids: list[int], cache: PolicyCache, all_logits: bool) -> torch.Tensor:
        """Read `ids` into `cache` in chunks; the logits of every id, or of the last one."""
        return read(self.model, ids, cache, self.prefill_chunk, all_logits)

    def _claim_conversation(self, job: Job) -> tuple[Conversation, list[int]]:
        """The held conversation this chat continues (and the ids still to read), or a new one."""
        with self._lock:
            if job.text is not None:
                matches = [
                    (k, c)
                    for k, c in self.conversations.items()
                    if c.text and len(job.text) > len(c.text) and job.text.startswith(c.text)
                ]
                if matches:
                    key, conversation = max(matches, key=lambda kc: len(kc[1].text))
                    del self.conversations[key]
                    conversation.busy = True
                    new_text = job.text[len(conversation.text) :]
                    ids = self.tokenizer(new_text, add_special_tokens=False)["input_ids"]
                    job.cached_tokens = max(0, len(job.prompt_ids) - len(ids))
                    if self.metrics is not None:
                        self.metrics.reuses.inc()
                    return conversation, ids
        cache = make_cache(self.model, self.policy, **self.budget)
        return Conversation(cache, busy=True), job.prompt_ids

    def _start(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        job.conversation, ids = self._claim_conversation(job)
        with self._lock:
            self.active.append(job)
        if job.seed is not None:
            job.generator = torch.Generator(device=self.device).manual_seed(job.seed)
        logits = self._forward(ids, job.conversation.cache, all_logits=job.echo)
        if job.echo:
            job.emit("prompt_logprobs", self._prompt_logprobs(ids, logits, job.logprobs or 0))
            logits = logits[-1]
        job.next_logits = logits
        if job.max_tokens == 0:
            self._complete(job, "length")

    def _prompt_logprobs(self, ids: list[int], logits: torch.Tensor, top: int) -> list[dict]:
        """Per prompt token: its log-probability given the tokens before it (None for the first)."""
        logprobs = logits[:-1].log_softmax(-1)
        entries = [{"id": ids[0], "logprob": None, "top": None}]
        for position, token in enumerate(ids[1:]):
            entries.append(self._token_entry(logprobs[position], token, top))
        return entries

    def _token_entry(self, logprobs: torch.Tensor, token: int, top: int) -> dict:
        best = logprobs.topk(max(top, 1))
        return {
            "id": token,
            "logprob": float(logprobs[token]),
            "top": {int(i): float(v) for v, i in zip(best.values, best.indices, strict=True)} if top else None,
        }

    def _sample(self, job: Job, logits: torch.Tensor) -> int:
        if job.temperature <= 0:
            return int(logits.argmax())
        probs = (logits / job.temperature).softmax(-1)
        if job.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs > job.top_p
            sorted_probs[outside] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=job.generator))

    def _step(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._finish(job, None)
            return
        logits = job.next_logits
        token = self._sample(job, logits)
        entry = (
            self._token_entry(logits.log_softmax(-1), token, job.logprobs or 0) if job.logprobs is not None else None
        )
        if self.metrics is not None and not job.generated:
            self.metrics.ttft.observe(time.perf_counter() - job.started)
        if token in self.stop_ids:
            job.generated.append(token)
            self._complete(job, "stop", flush=True)
            return
        job.generated.append(token)
        text = self.tokenizer.decode([t for t in job.generated if t not in self.stop_ids], skip_special_tokens=True)
        hit = min((text.find(s) for s in job.stop if s and s in text), default=-1)
        if hit >= 0:
            self._emit_text(job, text[:hit], entry, final=True)
            self._complete(job, "stop")
            return
        self._emit_text(job, text, entry, final=False)
        if len(job.generated) >= job.max_tokens:
            self._complete(job, "length", flush=True)
            return
        ids = torch.tensor([[token]], device=self.device)
        job.next_logits = self.model(input_ids=ids, past_key_values=job.conversation.cache).logits[0, -1].float()

    def _emit_text(self, job: Job, text: str, entry: dict | None, final: bool) -> None:
        """Send the text not sent yet, holding back what may still become a stop string or a character."""
        ready = text
        if not final:
            hold = max((len(s) - 1 for s in job.stop), default=0)
            ready = text[: len(text) - hold] if hold else text
            if ready.endswith("\ufffd"):
                ready = ready[:-1]
        if len(ready) > len(job.shown) or entry is not None:
            job.emit("token", {"text": ready[len(job.shown) :], "logprob": entry})
            job.shown = max(ready, job.shown, key=len)

    def _complete(self, job: Job, reason: str, flush: bool = False) -> None:
        if flush:
            text = self.tokenizer.decode([t for t in job.generated if t not in self.stop_ids], skip_special_tokens=True)
            if len(text) > len(job.shown):
                self._emit_text(job, text, None, final=True)
        conversation = job.conversation
        if job.text is not None:
            conversation.text = job.text + self.tokenizer.decode(job.generated)
        self._finish(job, conversation if job.text is not None else None)
        usage = {
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": len(job.generated),
            "cached_tokens": job.cached_tokens,
            "kv_tokens_held": conversation.cache.physical_length(),
        }
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
            self.metrics.completion_tokens.inc(len(job.generated))
        job.emit("done", {"finish_reason": reason, "usage": usage, "text": job.shown})

    def _finish(self, job: Job, keep: Conversation | None) -> None:
        """Take the job off the active list; keep its conversation for reuse, within the byte cap."""
        with self._lock:
            if job in self.active:
                self.active.remove(job)
            if keep is None:
                return
            keep.busy = False
            keep.last_used = time.monotonic()
            self.conversations[id(keep)] = keep
            total = sum(c.allocated_bytes() for c in self.conversations.values())
            while total > self.max_kv_bytes and len(self.conversations) > 1:
                _, dropped = self.conversations.popitem(last=False)
                total -= dropped.allocated_bytes()
