"""The fast decode path: prefill with the policy cache, then one fixed-shape (compiled) step per token.

Rows of a batch are prefilled apart (rows of equal length together) through the ordinary policy
cache, so each row is exactly its single-row run and no padding ever enters a cache; their states
are then moved into one `StaticKV` whose shapes never change. Each step calls the transformers
model itself with `static_kv=`: sparsegen's registered attention function writes, attends and
evicts in those buffers, so every architecture the policy cache supports runs here unchanged.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import types
from collections.abc import Callable

import torch

from sparsegen.decode.state import DEAD, EMPTY, LayerState, StaticKV
from sparsegen.errors import SparsegenError
from sparsegen.kv.base import Policy, Sizes, make_policy
from sparsegen.kv.cache import PolicyLayer, make_cache
from sparsegen.kv.window import WindowPolicy

COMPILE_MODES = ("auto", "always", "never")
MIN_TOKENS_TO_COMPILE = 64
GEMV_ROWS = 4
PREFILL_ROWS = 4  # rows read in one prefill forward: bounds the dense prompt KV held before eviction


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, but inside a compiled graph a few rows become one multiply-and-sum over the
    weight rows: inductor emits a streaming reduction that reads the weights near the memory bus's
    speed (measured 2x the batch-1 `mm` kernel on this CPU, fp32 and bf16), where `mm` shapes for
    one token are far from the bound. Prefill and eager calls are untouched."""
    if not torch.compiler.is_compiling() or x.numel() // x.shape[-1] > GEMV_ROWS:
        return torch.nn.functional.linear(x, weight, bias)
    out = (x.unsqueeze(-2).float() * weight.float()).sum(-1)
    return (out if bias is None else out + bias).to(x.dtype)


def _gemv_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def use_gemv(model: torch.nn.Module) -> None:
    """Give every `nn.Linear` of `model` the compiled batch-1 path of `_gemv_forward`."""
    for module in model.modules():
        if type(module) is torch.nn.Linear and "forward" not in module.__dict__:
            module.forward = types.MethodType(_gemv_forward, module)


def _rows_of(layer) -> dict:
    """One prefilled cache layer as slots: keys, values, positions (EMPTY where free), scores, and
    how the layer goes on (policy, sizes, evicting)."""
    if isinstance(layer, PolicyLayer):
        held = layer.size + (layer.hole is not None)
        keys = layer.keys[:, :, :held].clone()
        positions = layer.positions[:, :, :held].clone()
        if layer.hole is not None:
            positions.scatter_(2, layer.hole, EMPTY)
        if layer.sink_keys is not None:  # rolling sinks were rotated in place: restore them
            keys[:, :, : layer.sink_keys.shape[2]] = layer.sink_keys
        sizes = layer.sizes
        return dict(
            keys=keys,
            values=layer.values[:, :, :held],
            positions=positions,
            scores=layer.scores[:, :, :held],
            policy=layer.policy,
            sizes=sizes or Sizes(),
            evicting=sizes is not None and not layer.compressed,
            rotation=layer.rotation,
        )
    # transformers' sliding-window layer (Gemma 3): the newest `sliding_window - 1` tokens
    held = layer.keys.shape[2]
    window = layer.sliding_window - 1
    positions = torch.arange(layer.cumulative_length - held, layer.cumulative_length, device=layer.keys.device)
    return dict(
        keys=layer.keys,
        values=layer.values,
        positions=positions.expand(*layer.keys.shape[:2], held).clone(),
        scores=torch.zeros(layer.keys.shape[:3]),
        policy=WindowPolicy(recent=window),
        sizes=Sizes(recent=window),
        evicting=True,
        rotation=None,
    )


def _capacity(parts: list[dict], max_new_tokens: int) -> int:
    if parts[0]["evicting"]:
        return max(part["sizes"].budget for part in parts) + 1
    held = max(part["positions"].shape[2] for part in parts)
    return -(-(held + max_new_tokens) // 64) * 64  # a multiple of 64: fewer shapes to compile


def _stack(parts: list[dict], capacity: int, kv_dtype: torch.dtype) -> LayerState:
    """One layer's slots for all rows, from each row group's prefilled layer."""
    rows = sum(part["keys"].shape[0] for part in parts)
    h, d = parts[0]["keys"].shape[1], parts[0]["keys"].shape[3]
    dv = parts[0]["values"].shape[3]
    keys = torch.zeros(rows, h, capacity, d, dtype=kv_dtype)
    values = torch.zeros(rows, h, capacity, dv, dtype=kv_dtype)
    positions = torch.full((rows, h, capacity), EMPTY, dtype=torch.long)
    scores = torch.zeros(rows, h, capacity)
    budgets = []
    row = 0
    for part in parts:
        n, held = part["keys"].shape[0], part["keys"].shape[2]
        keys[row : row + n, :, :held] = part["keys"]
        values[row : row + n, :, :held] = part["values"]
        positions[row : row + n, :, :held] = part["positions"]
        scores[row : row + n, :, :held] = part["scores"]
        if part["evicting"]:
            positions[row : row + n, :, part["sizes"].budget + 1 :] = DEAD
        budgets += [part["sizes"]] * n
        row += n
    sizes = Sizes(
        *(torch.tensor([getattr(s, f) for s in budgets]).view(-1, 1, 1) for f in ("sinks", "heavy", "recent"))
    )
    policy, evicting = parts[0]["policy"], parts[0]["evicting"]
    slot = (positions == EMPTY).int().argmax(-1, keepdim=True)
    return LayerState(
        policy=policy,
        sizes=sizes,
        evicting=evicting,
        keys=keys,
        values=values,
        positions=positions,
        scores=scores,
        slot=slot,
        rotation=parts[0]["rotation"],
        contiguous=policy.contiguous,
        sinks=max(s.sinks for s in budgets),
    )


def _say_to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


class Decoder:
    """Batch decoding over a KV policy: `start(prompts)` prefills and returns each row's next-token
        logits, then `step(tokens)` feeds one token per row and returns the next logits [b, vocab].

        `compile`: "auto" compiles the step when the generation is long enough to pay for it and a C++
        compiler is present, "always", or "never" (eager step). Compiled code is cached on disk between
        runs. Keys and values are stored in `kv_dtype`: fp32 by default, also under bf16 weights, since
    CPUs without bf16 instructions convert a bf16 cache back at every step (measured slower); bf16
    halves the cache where memory, not time, is short.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        policy: str | Policy = "full",
        position: str | None = None,
        compile: str = "auto",
        kv_dtype: torch.dtype = torch.float32,
        notify: Callable[[str], None] = _say_to_stderr,
        **budget: int | float,
    ) -> None:
        if compile not in COMPILE_MODES:
            raise SparsegenError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
        self.model = model
        self.policy = make_policy(policy, **budget)
        self.position = position
        self.compile = compile
        self.kv_dtype = kv_dtype
        self.notify = notify
        self.state: StaticKV | None = None
        self._eager = DecodeStep(model)
        self.mode = "eager"
        self.compile_s = 0.0
        self._step: Callable | None = None

    # -- prefill ----------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, prompts: list[list[int]], max_new_tokens: int) -> torch.Tensor:
        """Prefill every row; returns the logits of each row's last prompt token [b, vocab]."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise SparsegenError("every prompt needs at least one token")
        by_length: dict[int, list[int]] = {}
        for index, prompt in enumerate(prompts):
            by_length.setdefault(len(prompt), []).append(index)
        groups = [rows[i : i + PREFILL_ROWS] for rows in by_length.values() for i in range(0, len(rows), PREFILL_ROWS)]
        order = [index for rows in groups for index in rows]
        caches, logits = [], []
        for rows in groups:
            cache = make_cache(self.model, self.policy, position=self.position)
            ids = torch.tensor([prompts[i] for i in rows])
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            caches.append(cache)
            logits.append(out.logits[:, -1].float())
        layers = []
        for index in range(len(caches[0].layers)):
            parts = [_rows_of(cache.layers[index]) for cache in caches]
            layers.append(_stack(parts, _capacity(parts, max_new_tokens), self.kv_dtype))
        seen = torch.tensor([len(prompts[i]) for i in order])
        restore = torch.tensor(order).argsort()  # stacked rows are grouped by length: undo that
        self.state = StaticKV([_reorder(layer, restore) for layer in layers], seen[restore])
        self._prepare_step(max_new_tokens)
        return torch.cat(logits)[restore]

    # -- decode -----------------------------------------------------------------------------

    def _prepare_step(self, max_new_tokens: int) -> None:
        if self.mode == "compiled":
            return  # a later start() reuses the compiled step (new shapes recompile, from the disk cache)
        wanted = self.compile == "always" or (
            self.compile == "auto" and max_new_tokens >= MIN_TOKENS_TO_COMPILE and _has_compiler()
        )
        if not wanted:
            if self.compile == "auto":
                self.notify(
                    f"decoding eagerly: {max_new_tokens} new tokens do not pay for compiling the step"
                    if _has_compiler()
                    else "decoding eagerly: no C++ compiler found for torch.compile"
                )
            self._step, self.mode = self._eager, "eager"
            return
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_inductor_cache()))
        use_gemv(self.model)
        self._step = torch.compile(self._eager, dynamic=False)
        self.mode = "compiled"

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row [b]; returns the next-token logits [b, vocab]."""
        if self.state is None:
            raise SparsegenError("call start(prompts) before step()")
        self.state.seen += 1
        if self.mode != "compiled" or self.compile_s:
            return self._step(tokens, self.state)
        started = time.perf_counter()
        try:
            logits = self._step(tokens, self.state)
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to the same eager step
            self.notify(f"decoding eagerly: compiling the step failed ({type(exc).__name__}: {str(exc)[:120]})")
            self._step, self.mode = self._eager, "eager"
            return self._step(tokens, self.state)
        self.compile_s = time.perf_counter() - started
        self.notify(f"compiled the decode step in {self.compile_s:.1f} s (cached for later runs)")
        return logits


class DecodeStep(torch.nn.Module):
    """One token per row through the model, attending over `static_kv`: the graph that compiles."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, state: StaticKV) -> torch.Tensor:
        out = self.model(
            input_ids=tokens[:, None],
            position_ids=(state.seen - 1)[:, None],
            use_cache=False,
            static_kv=state,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()


def _reorder(layer: LayerState, order: torch.Tensor) -> LayerState:
    for name in ("keys", "values", "positions", "scores", "slot"):
        setattr(layer, name, getattr(layer, name)[order].contiguous())
    layer.sizes = Sizes(*(getattr(layer.sizes, f)[order] for f in ("sinks", "heavy", "recent")))
    return layer


def _has_compiler() -> bool:
    return any(shutil.which(name) for name in ("g++", "c++", "clang++"))


def _inductor_cache():
    from sparsegen.assets import cache_dir

    return cache_dir() / "inductor"
