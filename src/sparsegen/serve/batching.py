"""The generation engine behind the server: continuous batching over the one decode loop.

Every request is a `Job`. The worker thread admits jobs while their KV fits `max_kv_bytes`
(`serve.admission`: the rest wait in a bounded queue), reads each admitted prompt into a policy
cache one chunk per iteration (new prompts that wait together and fit one chunk in one packed
forward: `decode.reading.read_packed`), and then makes it a row of a `Lane`: the rows whose KV specs
share a step (`KVSpec.step_key`), decoded together by one `Decoder`, one step for all of them
per iteration. Rows join after their prefill and leave when done (stop token, stop string,
`max_tokens`, a client gone) between steps; a long prompt delays other rows' tokens by at most
one chunk (a policy that compresses the prompt once reads a new prompt whole, so its choice sees
all of it; a cancel still stops that read within one decoder layer).

Chat answers leave their cache held between requests (`serve.conversations`), counted against the
same KV memory. With `compile=True` the default lane's step (the server's policy and bits) is
compiled in a thread while the engine serves eagerly (`serve.compiling`), once for one row and once
for any other row count (`Decoder(rows_vary=True)`); new rows then take it. Other lanes step eagerly."""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial

import torch
from prometheus_client import generate_latest

from sparsegen.decode import Decoder
from sparsegen.decode.kvzip_read import repeat_frame
from sparsegen.decode.reading import Abandoned, packable, read, read_packed, reads_whole
from sparsegen.errors import SparsegenError
from sparsegen.few_rows import PackedWeights, pack_weights, restore_linears, use_gemv
from sparsegen.fused_layers import fuse_layers, restore_layers
from sparsegen.kv import PolicyCache, make_cache
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.footprint import kv_row_bytes
from sparsegen.kv.spec import KVSpec
from sparsegen.sampling import StopRule, choose, stop_tokens
from sparsegen.serve.admission import Admission
from sparsegen.serve.compiling import BackgroundCompile
from sparsegen.serve.conversations import Conversation, ConversationStore
from sparsegen.serve.events import Done, Event, Failed, PromptLogprobs, prompt_entries, token_entry
from sparsegen.serve.jobs import GenerationRequest, Job, sampling_defaults
from sparsegen.serve.lanes import Lane, Lanes
from sparsegen.serve.memory import MemoryBound, memory_bound
from sparsegen.serve.metrics import Metrics


class Engine:
    """Owns the model, the batch and the conversations; `submit()` is safe from any thread."""

    def __init__(
        self,
        model,
        tokenizer,
        kv: KVSpec | str = "streaming",
        *,
        max_kv_bytes: int = 1 << 30,
        prefill_chunk: int = 512,
        max_queue: int = 64,
        compile: bool = False,
        compile_first: Callable[[], None] | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        # a CPU's step only: a GPU's compiled step replays CUDA graphs of one shape each (untested here)
        self.compile = compile and self.device.type == "cpu"
        self.compile_first = compile_first  # fills the compile caches before the thread compiles (`serve.precompile`)
        self.kv = KVSpec.coerce(kv)  # the requests' default; bad settings failed in building it
        self.prefill_chunk = prefill_chunk
        self.memory: MemoryBound | None = None  # stated once the engine is ready (`serve.memory`)
        self.packed: PackedWeights = {}  # the few-row kernel's weights, one copy for every lane (packed in `_loop`)
        self.patched: list = []  # the Linear layers given the few-row product while a compiled step may run
        self.compiling: BackgroundCompile | None = None
        self.compiled = threading.Event()  # set once the compiled default lane serves (or cannot)
        self.metrics = Metrics()
        self.sampling = sampling_defaults(model)
        self.stop_ids = frozenset(stop_tokens(model, tokenizer))
        self.conversations = ConversationStore()
        row_bytes = partial(kv_row_bytes, model)
        self.admission = Admission(max_kv_bytes, row_bytes, max_queue, self.conversations, self.metrics)
        self.incoming: queue.Queue[Job] = queue.Queue()
        self.prefilling: deque[Job] = deque()
        self.lanes = Lanes(partial(self._decoder, compiled=False))
        self._lock = threading.Lock()
        self._running = True
        self._started: threading.Event = threading.Event()
        self._start_failure: BaseException | None = None
        bound = partial(memory_bound, model, max_kv_bytes=max_kv_bytes, prefill_chunk=prefill_chunk, rows=max_queue)
        self._thread = threading.Thread(target=self._loop, args=(bound,), name="sparsegen-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_failure is not None:
            raise self._start_failure

    # -- public -------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, emit: Callable[[Event], None]) -> Job:
        """Queue `request`, its events sent to `emit` from the worker thread; returns its job (set
        `job.cancelled` to abandon it). Raises `QueueFull` when `max_queue` requests already wait
        for memory, and `SparsegenError` when its KV could never fit."""
        answer_text = partial(self.tokenizer.decode, skip_special_tokens=True)
        rule = StopRule(request.max_tokens, self.stop_ids, request.stop, answer_text)
        job = Job(request, emit, rule, kv_need=self.admission.need(request))
        with self._lock:
            self.admission.check(job, self.incoming.qsize())
        self.incoming.put(job)
        return job

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=10)
        if self.compiling is not None:  # a step still compiling gives the model back when it is done
            self.compiling.cancel()
        self.lanes.release_all()
        self.packed = {}  # the weights' packed copy goes with the engine

    def held_kv_bytes(self) -> int:
        """KV bytes counted against the cap: admitted rows (at their full need) and held conversations."""
        with self._lock:
            return self.admission.held_bytes()

    def stats(self) -> dict:
        with self._lock:
            active, queued = len(self.admission.admitted), len(self.admission.waiting)
            step = "compiling" if not self.compiled.is_set() else self._step_kind()
            return {"conversations": len(self.conversations), "active": active, "queued": queued, "step": step}

    def _step_kind(self) -> str:
        """Only the default lane is ever compiled: any compiled lane is it (no policy built per /health)."""
        return "compiled" if any(lane.decoder.mode == "compiled" for lane in self.lanes.values()) else "eager"

    def render_metrics(self) -> bytes:
        stats = self.stats()
        self.metrics.kv_bytes.set(self.held_kv_bytes())
        self.metrics.conversations.set(stats["conversations"])
        self.metrics.active.set(stats["active"])
        self.metrics.queued.set(stats["queued"] + self.incoming.qsize())
        return generate_latest(self.metrics.registry)

    # -- worker -------------------------------------------------------------------------------
    def _loop(self, bound: Callable[..., MemoryBound]) -> None:
        with policy_attention(self.model):  # while the engine runs; the model's own attention after close()
            fused = fuse_layers(self.model)  # for the engine's life: a compile traces the model while prompts are read
            try:  # here, not in the caller's thread: a second thread's OpenMP team halves the step's speed
                self.packed = pack_weights(self.model)
                self.memory = bound(packed=self.packed)
                self._start_compiling()
            except BaseException as exc:  # noqa: BLE001 - handed to the constructor, which raises it
                self._start_failure, self._running = exc, False
            finally:
                self._started.set()
            try:
                self._serve()
            finally:
                restore_linears(self.patched)
                restore_layers(fused)
                self.patched = []

    def _start_compiling(self) -> None:
        """Give the Linear layers the few-row product for the engine's life (what the compiled
        step is traced through; eagerly the same product `Decoder.step` uses), and compile the
        default lane's step in a thread while the engine serves eagerly."""
        if not self.compile:
            self.compiled.set()
            return
        self.patched = use_gemv(self.model, rows_vary=True, packed=self.packed)
        make = partial(self._decoder, compiled=True)
        notify = partial(print, file=sys.stderr)
        self.compiling = BackgroundCompile(make, self.kv, notify, self.compile_first)

    def _serve(self) -> None:
        while self._running:
            self._adopt_compiled()
            busy = self.prefilling or any(lane.jobs for lane in self.lanes.values()) or self.admission.waiting
            try:
                job = self.incoming.get(timeout=0 if busy else 0.05)
                with self._lock:
                    self.admission.waiting.append(job)
                continue  # take every request that came before deciding admissions
            except queue.Empty:
                pass
            self._admit()
            if self.prefilling:
                self._read_next()
            for key, lane in list(self.lanes.items()):
                self._decode(key, lane)
            self.lanes.retire_drained()

    def _guarded(self, job: Job, action) -> None:
        """Run one job's action; a failure ends that job with an error, never the worker."""
        try:
            with torch.inference_mode():
                action(job)
        except Exception as exc:  # one bad request must not take the server down
            self._drop(job)
            job.emit(Failed(f"{type(exc).__name__}: {exc}"))

    def _drop(self, job: Job) -> None:
        """`job` ends before its answer: it leaves the prefill queue and frees its KV."""
        with self._lock:
            if job in self.prefilling:
                self.prefilling.remove(job)
            self.admission.release(job)

    # -- a request's cache ----------------------------------------------------------------------
    def _admit(self) -> None:
        """Admit waiting jobs while they fit, each claiming its cache (a held conversation it
        continues leaves the store) before the next is weighed."""
        while True:
            with self._lock:
                job = self.admission.admit_next()
                if job is None:
                    return
                self.prefilling.append(job)
            self._guarded(job, self._begin)

    def _begin(self, job: Job) -> None:
        """Claim the held conversation this chat continues (reading only the new ids), or a new cache."""
        if job.request.seed is not None:
            job.generator = torch.Generator().manual_seed(job.request.seed)  # CPU: the sampler draws there
        with self._lock:
            held = None if job.request.text is None else self.conversations.continued_by(job.request.text)
        if held is not None and job.request.kv.shares_step_with(held.cache.spec):
            with self._lock:
                self.conversations.take(held)
            new_ids = self.tokenizer(job.request.text[len(held.text) :], add_special_tokens=False)["input_ids"]
            job.cache, job.to_read = held.cache, held.unfed + new_ids
            job.cached_tokens = max(0, len(job.request.prompt_ids) - len(job.to_read))
            self.metrics.reuses.inc()
        else:
            prompt = job.request.prompt_ids
            job.cache, job.to_read = make_cache(self.model, job.request.kv.resolved(len(prompt))), list(prompt)
        if not job.to_read:  # the follow-up adds nothing: re-read the last token's logits
            raise SparsegenError("the request adds no tokens to its conversation")

    # -- prefill, one chunk per iteration -------------------------------------------------------
    def _read_next(self) -> None:
        """Read the first waiting prompt's next chunk; where it and any others that wait are whole
        fresh prompts that fit one chunk together, read them all in one packed forward (the
        weights read once for all: a prompt read is mostly that at these sizes; one such prompt
        alone is read the same way, so its answer does not depend on whether others waited)."""
        group = self._packable_group()
        if not group:
            self._guarded(self.prefilling[0], self._read_chunk)
            return

        def all_gone() -> bool:
            return all(job.cancelled.is_set() for job in group)

        try:
            with torch.inference_mode():
                logits = read_packed(self.model, [job.to_read for job in group], [job.cache for job in group], all_gone)
        except Exception as exc:  # noqa: BLE001 - the group's requests fail (or leave, when all cancelled), never the worker
            for job in group:
                self._drop(job)
                if not isinstance(exc, Abandoned):
                    job.emit(Failed(f"{type(exc).__name__}: {exc}"))
            return
        for job, row in zip(group, logits, strict=True):
            job.to_read = []
            self._guarded(job, partial(self._after_read, logits=row))

    def _packable_group(self) -> list[Job]:
        """The waiting jobs, first one first, whose whole prompts fit one `prefill_chunk` together
        and read packed (`decode.reading.packable`, no prompt logprobs asked); empty when the first
        cannot, so no prompt overtakes it."""
        group, room = [], self.prefill_chunk
        for job in self.prefilling:
            if not job.request.echo and len(job.to_read) <= room and packable(job.cache) and not job.cancelled.is_set():
                group.append(job)
                room -= len(job.to_read)
            elif not group:
                return []
        return group

    def _read_chunk(self, job: Job) -> None:
        size = len(job.to_read) if reads_whole(job.cache) else self.prefill_chunk
        chunk, job.to_read = job.to_read[:size], job.to_read[size:]
        frame = repeat_frame(self.tokenizer) if job.cache.policy.asks_to_repeat else None  # kvzip's ask to repeat
        try:
            logits = read(
                self.model, chunk, job.cache, all_logits=job.request.echo, stop=job.cancelled.is_set, frame=frame
            )
        except Abandoned:
            self._drop(job)
            return
        self._after_read(job, logits)

    def _after_read(self, job: Job, logits: torch.Tensor) -> None:
        """A chunk of `job`'s prompt was read: once the whole prompt is, the job becomes a row of its lane."""
        job.read_logits.append(logits)
        if job.to_read:
            return
        if job.request.echo:
            logits = torch.cat(job.read_logits)
            job.emit(PromptLogprobs(prompt_entries(job.request.prompt_ids, logits, job.request.logprobs or 0)))
            logits = logits[-1]
        job.read_logits = []
        with self._lock:
            self.prefilling.remove(job)
            if job.request.max_tokens == 0:
                self._complete(job, "length", None)
                return
            lane = self.lanes.for_rows(job.request.kv)
            lane.decoder.join([job.cache], job.request.max_tokens)
            lane.jobs.append(job)
            lane.logits = logits[None] if lane.logits is None else torch.cat([lane.logits, logits[None]])
        job.cache = None  # the row lives in the lane now

    def _decoder(self, kv: KVSpec, compiled: bool) -> Decoder:
        """A lane's decoder: its step compiled (once for one row, once for any other count), for
        the default lane, built in the background (`serve.compiling`), or eager: a lane a request
        opens with other settings must not stall every client for the minutes a compile takes."""
        mode = "always" if compiled else "never"
        return Decoder(self.model, kv, compile=mode, rows_vary=True, packed=self.packed)

    def _adopt_compiled(self) -> None:
        """Between iterations, once the compiled step is ready: it becomes the default lane, and
        rows that were decoding eagerly in that lane finish there (a lane of their own, no new rows)."""
        compiling = self.compiling
        if compiling is None or not compiling.ready.is_set():
            return
        self.compiling, decoder = None, compiling.take()
        if decoder is not None:
            with self._lock:
                self.lanes.adopt(decoder, compiling.kv)
        self.compiled.set()

    # -- decode, one step for every row of a lane ------------------------------------------------
    def _decode(self, key: tuple, lane: Lane) -> None:
        if not lane.jobs:
            return
        try:
            with torch.inference_mode():
                self._decode_step(lane)
        except Exception as exc:  # a failed step fails its lane's rows, never the worker
            with self._lock:
                del self.lanes[key]
                for job in lane.jobs:
                    self.admission.release(job)
            for job in lane.jobs:
                job.emit(Failed(f"{type(exc).__name__}: {exc}"))

    def _decode_step(self, lane: Lane) -> None:
        jobs = lane.jobs
        tokens = choose(
            lane.logits,
            [j.request.temperature for j in jobs],
            [j.request.top_p for j in jobs],
            [j.generator for j in jobs],
        )
        leaving: dict[int, str | None] = {}
        for row, (job, token) in enumerate(zip(jobs, tokens.tolist(), strict=True)):
            reason = self._take_token(job, token, lane.logits[row])
            if reason is not None or job.cancelled.is_set():
                leaving[row] = reason
        with self._lock:
            for row, reason in leaving.items():
                if reason is not None:
                    self._complete(jobs[row], reason, lane.decoder.hand_back(row) if jobs[row].request.text else None)
                else:  # the client is gone
                    self.admission.release(jobs[row])
            if leaving:
                order = lane.decoder.leave(list(leaving))
                lane.jobs = [jobs[row] for row in order]
                tokens = tokens[order]
            if not lane.jobs:
                lane.logits = None
                return
        lane.logits = lane.decoder.step(tokens)

    def _take_token(self, job: Job, token: int, logits: torch.Tensor) -> str | None:
        """Record one sampled token and send its text; the finish reason when the row is done."""
        entry = (
            token_entry(logits.log_softmax(-1), token, job.request.logprobs or 0)
            if job.request.logprobs is not None
            else None
        )
        if not job.generated:
            self.metrics.ttft.observe(time.perf_counter() - job.started)
        return job.take_token(token, entry)

    def _complete(self, job: Job, reason: str, cache: PolicyCache | None) -> None:
        """Finish `job` (under the lock); keep its conversation's `cache` for reuse."""
        self.admission.release(job)
        held_tokens = 0
        if cache is not None:
            held_tokens = cache.physical_length()
            conversation = Conversation(
                cache, job.request.text + self.tokenizer.decode(job.generated), job.generated[-1:], cache.kv_bytes()
            )
            self.conversations.keep(conversation)
        usage = {"prompt_tokens": len(job.request.prompt_ids), "completion_tokens": len(job.generated)}
        usage |= {"cached_tokens": job.cached_tokens, "kv_tokens_held": held_tokens}
        self.metrics.prompt_tokens.inc(len(job.request.prompt_ids))
        self.metrics.completion_tokens.inc(len(job.generated))
        job.emit(Done(reason, usage, job.shown))
