"""The fast decode path: prefill with the policy cache, then one fixed-shape (compiled) step per token.

Rows of a batch are prefilled apart (rows of equal length together) through the ordinary policy
cache, so each row is exactly its single-row run and no padding ever enters a cache; their states
are then moved into one `StaticKV` whose shapes never change. Each step calls the transformers
model itself with `attention_engine=StaticKVEngine(state)`: sparsegen's registered attention
function hands every call to that engine, which writes, attends and evicts in those buffers, so
every architecture the policy cache supports runs here unchanged.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparsegen.decode.handover import held_kv_dtype, slots_of, stack_layer
from sparsegen.decode.kvzip_read import RepeatFrame
from sparsegen.decode.reading import read
from sparsegen.decode.shared import SharedPrefill
from sparsegen.decode.static import StaticKV
from sparsegen.errors import SparsegenError
from sparsegen.few_rows import PackedWeights, few_row_linears, pack_weights, restore_linears, use_gemv
from sparsegen.kv.attention import AttentionEngine, require_policy_attention
from sparsegen.kv.factory import make_cache
from sparsegen.kv.policy import Policy
from sparsegen.kv.policy_cache import PolicyCache
from sparsegen.kv.spec import KVSpec
from sparsegen.models import model_device

COMPILE_MODES = ("auto", "always", "never")
COMPILE_AFTER = 64  # eager steps before "auto" considers compiling
COMPILE_PAYS_AFTER = 512  # steps still to come for a compile to pay back (see docs/benchmarks.md)
PREFILL_ROWS = 4  # rows read in one prefill forward: bounds the dense prompt KV held before eviction
LEAN_WRAPPER = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
"""Inductor checks every input's size and alignment again in the graph's Python wrapper, after
dynamo's guards have: about 850 checks a step at 30 layers, 0.6-1.7 ms of a 13 ms int4 step
(docs/benchmarks.md)."""
FIXED_ROWS_WRAPPER = {**LEAN_WRAPPER, "cpp_wrapper": True}
"""A step over a fixed row count runs its graph from a wrapper inductor writes in C++: no Python
between the ops, 1.03-1.09x at batch 1 on a Zen 3 (docs/benchmarks.md), for a first compile about
twice as long (the row-varying step gained nothing and keeps the Python wrapper)."""
STEP_GRAPHS = 64  # graphs of the decode step kept per process: every decoder's count against one limit


def _say_to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


class Decoder:
    """Batch decoding over a KV policy, the one token loop every part of sparsegen drives.

    `start(prompts)` prefills a fresh batch and returns each row's next-token logits; `step(tokens)`
    feeds one token per row and returns the next logits [b, vocab]. Between steps rows may join
    (`prefill` then `join`, also from a held cache: a conversation, a soft prompt) and leave
    (`leave`, handing a row's cache back with `hand_back`), which is how the server batches.

    `kv`: the `KVSpec` every row decodes by (a bare policy name: that policy at its defaults).
    `compile`: "auto" decodes eagerly and switches to the compiled step once a generation has run
    `COMPILE_AFTER` steps with at least `COMPILE_PAYS_AFTER` still to come (a short answer never
    waits for a compile), "always", or "never". Compiled code is cached on disk between runs.
    Prompts are read `prefill_chunk` tokens per forward (None: one forward), the policy evicting
    between chunks (a prompt compressed once, by a prefill-only policy, in one forward: `decode.reading.read`).
    Keys and values are stored in `kv_dtype`: by default on a CPU fp16 where every layer attends in
    the fused kernel (a full cache, a prompt-only policy: half the bytes, as llama.cpp's default) and
    fp32 where Python's products read the cache (eviction while decoding, rolled positions, heads held
    flat, a shared context; `decode.handover.held_kv_dtype`), also under bf16 weights, since CPUs
    without bf16 instructions convert a bf16 cache back at every step (measured slower); the model's
    dtype on a GPU; a `kv` spec with `kv_bits` holds them rounded instead (`kv.quantized`), prompt
    and held conversations included. On a GPU the compiled step is replayed as a CUDA graph (`reduce-overhead`),
    and the CPU's few-row product is not used. `rows_vary`: rows join and leave between steps (the
    server); the compiled step is then traced once for one row and once for any other row count and
    slot count (`StaticKV.varying`), so rows joining and leaving never compile it again.
    `packed`: the few-row kernel's copies of the fp32 weights to share (`few_rows.pack_weights`, as
    much memory again as those weights); made at the first CPU step when not given. `frame`: the
    words a policy that asks the model to repeat the prompt re-reads it in (`decode.kvzip_read`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVSpec | str | Policy = "full",
        *,
        compile: str = "auto",
        kv_dtype: torch.dtype | None = None,
        notify: Callable[[str], None] = _say_to_stderr,
        prefill_chunk: int | None = None,
        rows_vary: bool = False,
        packed: PackedWeights | None = None,
        frame: RepeatFrame | None = None,
    ) -> None:
        if compile not in COMPILE_MODES:
            raise SparsegenError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise SparsegenError(f"prefill_chunk must be >= 1 (or None for one forward), got {prefill_chunk}")
        self.model = model
        self.device = model_device(model)
        self.kv = KVSpec.coerce(kv)
        self.compile = compile
        on_cpu = self.device.type == "cpu"
        self.kv_dtype = kv_dtype or (None if on_cpu else next(model.parameters()).dtype)  # None: at join
        self.notify = notify
        self.prefill_chunk = prefill_chunk
        self.frame = frame
        self.rows_vary = rows_vary
        self.state: StaticKV | None = None
        self._eager = DecodeStep(model)
        self.mode = "eager"
        self.compile_s = 0.0
        self._step: Callable = self._eager
        self._steps = 0
        self._remaining = 0
        self.patched: list[torch.nn.Linear] = []
        self.packed = packed
        self._layout = 0  # counts changes of the rows and slots the step reads (join, leave)
        self._guarded = -1  # the layout whose last compiled step ran with dynamo's guards

    # -- rows in, rows out ------------------------------------------------------------------
    def new_cache(self, prompt_length: int) -> PolicyCache:
        """An empty policy cache for a row whose prompt has `prompt_length` tokens (shares of the
        prompt resolved against it now, so reading it in chunks keeps the same budget)."""
        return make_cache(self.model, self.kv.resolved(prompt_length))

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], held: list[PolicyCache | None] | None = None):
        """Read each prompt into a policy cache (continuing `held[i]` where given); rows of equal
        length without a held cache are read together. Returns the caches with the indices of
        the rows each holds, and each row's next-token logits [b, vocab] in prompt order."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise SparsegenError("every prompt needs at least one token")
        held = held or [None] * len(prompts)
        by_length: dict[int, list[int]] = {}
        groups = []
        for index, prompt in enumerate(prompts):
            if held[index] is None:
                by_length.setdefault(len(prompt), []).append(index)
            else:
                groups.append([index])
        groups += [rows[i : i + PREFILL_ROWS] for rows in by_length.values() for i in range(0, len(rows), PREFILL_ROWS)]
        caches, logits = [], [None] * len(prompts)
        for rows in groups:
            cache = held[rows[0]] or self.new_cache(len(prompts[rows[0]]))
            ids = torch.tensor([prompts[i] for i in rows], device=self.device)
            last = read(self.model, ids, cache, self.prefill_chunk, frame=self.frame)
            caches.append((rows, cache))
            for row, row_logits in zip(rows, last, strict=True):
                logits[row] = row_logits
        return caches, torch.stack(logits)

    def join(self, caches: list[PolicyCache], max_new_tokens: int, context: SharedPrefill | None = None) -> None:
        """Add the rows of prefilled `caches` to the batch (after the rows already in it). Given the
        `context` they were all made from (`SharedPrefill.cache_for`), rows that keep every new
        token read its keys and values once per step instead of each a copy (`decode.handover`)."""
        layers, batch = [], self.state.layers if self.rows else None
        held = [[slots_of(layer) for layer in cache.layers] for cache in caches]
        by_layer = [list(parts) for parts in zip(*held, strict=True)]
        if self.kv_dtype is None:  # chosen at the first join, kept for the rows that join later
            self.kv_dtype = held_kv_dtype(by_layer, context is not None)
        for index, parts in enumerate(by_layer):
            shared = None if context is None else context.layer_kv(index)
            slots = 0 if batch is None else batch[index].keys.shape[2]  # the batch's: no second copy to grow
            layers.append(stack_layer(parts, max_new_tokens, self.kv_dtype, shared, slots))
        counts = [cache.get_seq_length() for cache in caches for _ in range(_rows(cache))]
        seen = torch.tensor(counts, device=layers[0].keys.device)
        joining = StaticKV(layers, seen, varying=self.rows_vary)
        self._layout += 1
        if self.state is None or not self.rows:
            self.state = joining
        else:
            self.state.extend(joining)
        self._remaining = max(self._remaining, max_new_tokens)

    def leave(self, rows: list[int]) -> list[int]:
        """Take `rows` (batch indices) out of the batch. The last staying rows move into the places
        of those that leave (only they are copied, not the batch); returns the staying rows' old
        indices in their new order, for the caller's own per-row lists."""
        gone = set(rows)
        count = self.rows - len(gone)
        movers = iter(row for row in range(count, self.rows) if row not in gone)
        order = [next(movers) if row in gone else row for row in range(count)]
        self.state.select(order)
        self._layout += 1
        return order

    def hand_back(self, row: int) -> PolicyCache:
        """Row `row`'s held tokens as a policy cache of its own, to keep between requests."""
        cache = make_cache(self.model, self.kv)
        seen = int(self.state.seen[row])
        dtype = next(self.model.parameters()).dtype
        for layer, slots in zip(cache.layers, self.state.layers, strict=True):
            slots.hand_back(row, seen, layer, dtype)
        return cache

    @property
    def rows(self) -> int:
        return 0 if self.state is None else int(self.state.seen.shape[0])

    @torch.inference_mode()
    def start(self, prompts: list[list[int]], max_new_tokens: int) -> torch.Tensor:
        """Prefill a fresh batch; returns the logits of each row's last prompt token [b, vocab]."""
        caches, logits = self.prefill(prompts)
        self.start_from(caches, max_new_tokens)
        return logits

    def start_from(self, caches: list, max_new_tokens: int, context: SharedPrefill | None = None) -> None:
        """A fresh batch of `prefill`'s caches, rows in prompt order (`join` for `context`)."""
        self.state, self._steps, self._remaining = None, 0, 0
        self.join([cache for _, cache in caches], max_new_tokens, context)
        order = [row for rows, _ in caches for row in rows]
        self.state.select(torch.tensor(order).argsort().tolist())  # stacked rows are grouped by length: undo that
        if self.compile == "auto" and self.mode != "compiled":
            if not self._has_compiler():
                self.notify(f"decoding eagerly: {self._compiler_needed()} found for torch.compile")
                self.compile = "never"
            elif max_new_tokens < COMPILE_AFTER + COMPILE_PAYS_AFTER:
                self.notify(f"decoding eagerly: {max_new_tokens} new tokens do not pay for compiling the step")
            else:
                self.notify(f"decoding eagerly; the step compiles after {COMPILE_AFTER} tokens if more are to come")

    # -- decode -----------------------------------------------------------------------------
    def _wants_compiled(self) -> bool:
        if self.mode == "compiled" or self.compile == "never":
            return False
        if self.compile == "always":
            return True
        return self._steps >= COMPILE_AFTER and self._remaining - self._steps >= COMPILE_PAYS_AFTER

    def _compiler_needed(self) -> str:
        return "no C++ compiler" if self.device.type == "cpu" else "no triton"

    def _has_compiler(self) -> bool:
        if self.device.type == "cpu":
            return any(shutil.which(name) for name in ("g++", "c++", "clang++"))
        return importlib.util.find_spec("triton") is not None

    def _switch_to_compiled(self) -> None:
        if not self._has_compiler():
            self.notify(f"decoding eagerly: {self._compiler_needed()} found for torch.compile")
            self.compile = "never"
            return
        _use_inductor_cache()
        if self.device.type == "cpu":
            # kept while the compiled step lives; `release()` undoes it
            # the compiled graph reads the few-row kernel's packed weights only for a varying row count
            self.patched = use_gemv(self.model, self.rows_vary, self._packed() if self.rows_vary else None)
            options = LEAN_WRAPPER if self.rows_vary else FIXED_ROWS_WRAPPER
            self._step = torch.compile(self._eager, dynamic=None if self.rows_vary else False, options=options)
        else:  # replayed as a CUDA graph over slots marked static (recorded again when rows change)
            self._step = torch.compile(self._eager, dynamic=False, mode="reduce-overhead")
        self.mode = "compiled"

    def _packed(self) -> PackedWeights:
        """The few-row kernel's copies of the weights (`few_rows.pack_weights`), made at the first
        CPU step unless given: a server's lanes share one set."""
        if self.packed is None:
            self.packed = pack_weights(self.model)
        return self.packed

    def release(self) -> None:
        """Give the model back as it was given: compiling replaced its Linear layers' `forward`
        (the graph is traced through the few-row product), and drop the packed weights' copy. The
        decoder steps eagerly after this (packing again if it does)."""
        restore_linears(self.patched)
        self.patched, self._step, self.mode, self.compile = [], self._eager, "eager", "never"
        self.packed = None

    def _compiled_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """The compiled step once it exists. Its first step over a layout (rows and slots) runs
        dynamo's guards, which pick or compile the graph for it; later steps over the same layout
        check only the guards that tell its graphs apart (`skip_guard_eval_unsafe`): every guard
        was 1.4 ms of a 10 ms step of the default model (docs/benchmarks.md). Should dynamo still
        want another graph there (it raises rather than compile), the step runs guarded again."""
        if self._guarded == self._layout:
            try:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return self._step(tokens, self.state)
            except RuntimeError as exc:  # raised as the frame is entered: nothing has run yet
                if "skip_guard_eval_unsafe" not in str(exc):
                    raise
        with step_graph_limit():
            logits = self._step(tokens, self.state)
        self._guarded = self._layout
        return logits

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row [b]; returns the next-token logits [b, vocab]."""
        if self.state is None or not self.rows:
            raise SparsegenError("call start(prompts) (or join rows) before step()")
        require_policy_attention(self.model)
        if self._wants_compiled():
            self._switch_to_compiled()
        self.state.seen += 1
        self._steps += 1
        if self.rows_vary and self.mode == "compiled":
            torch._dynamo.maybe_mark_dynamic(tokens, 0)
        if self.mode != "compiled":
            if self.device.type != "cpu":
                return self._step(tokens, self.state)
            with few_row_linears(self.model, self._packed()):
                return self._step(tokens, self.state)
        if self.device.type == "cuda":  # a new replay: the last step's outputs were consumed
            torch.compiler.cudagraph_mark_step_begin()
        if self.compile_s:
            return self._compiled_step(tokens)
        started = time.perf_counter()
        try:
            with step_graph_limit():
                logits = self._step(tokens, self.state)
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to the same eager step
            self.notify(f"decoding eagerly: compiling the step failed ({type(exc).__name__}: {str(exc)[:120]})")
            self._step, self.mode, self.compile = self._eager, "eager", "never"
            return self._step(tokens, self.state)
        self.compile_s = time.perf_counter() - started
        after = f" after {self._steps - 1} eager steps" if self._steps > 1 else ""
        self.notify(f"compiled the decode step in {self.compile_s:.1f} s{after} (cached for later runs)")
        return logits


@dataclass
class StaticKVEngine(AttentionEngine):
    """The fast path's attention engine: each layer writes the new key and value into its row's
    free slot of `state` and attends over the live slots (`LayerState.write`, `attend`, which lets
    the policy score and picks the next slot); no cache is involved."""

    state: StaticKV

    def attend(self, base, module, query, key, value, mask, scaling, kwargs):
        layer = self.state.layers[module.layer_idx]
        layer.write(key, value, self.state.seen - 1)
        return layer.attend(query, scaling, self.state.seen.view(-1, 1, 1)), None


class DecodeStep(torch.nn.Module):
    """One token per row through the model, attending over `state` (`StaticKVEngine`): the graph
    that compiles."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, state: StaticKV) -> torch.Tensor:
        out = self.model(
            input_ids=tokens[:, None],
            position_ids=(state.seen - 1)[:, None],
            use_cache=False,
            attention_engine=StaticKVEngine(state),
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()


def _rows(cache: PolicyCache) -> int:
    return next(layer.keys.shape[0] for layer in cache.layers if layer.is_initialized)


def _inductor_cache():
    """Compiled steps cached on disk, one folder for each version of the kernels they call."""
    from sparsegen.assets import cache_dir
    from sparsegen.kernels.build import sources_hash

    return cache_dir() / "inductor" / sources_hash()


def _use_inductor_cache() -> None:
    """Compile into `_inductor_cache()` unless the user named a folder: importing torch's compiler
    sets the variable to torch's default (one folder whatever the kernels), so that value is ours to replace."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_inductor_cache())


def step_graph_limit():
    """Every decoder of a process compiles the same code (`DecodeStep.forward`), and dynamo keeps
    8 graphs of one code by default, then steps it eagerly without a word: a server's lanes or an
    evaluation's policies pass that. The limit is raised only while a step may compile."""
    return torch._dynamo.config.patch(recompile_limit=STEP_GRAPHS)
