"""The hand-over from prefilled policy caches (prompts, held conversations) to the decode slots.

Each layer's rows are stacked into one `LayerState`. Rows that read one shared context
(`decode.shared.SharedPrefill`, a RULER sample's policies) and keep every new token hold only their
own tokens in slots; the context's keys and values are read once per step for all of them, each
row masked to the context tokens it kept (`decode.context`), instead of each row a copy.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import CacheLayerMixin

from sparsegen.decode.context import ContextRows, split_context
from sparsegen.decode.state import LayerState, first_free
from sparsegen.errors import SparsegenError
from sparsegen.kv.cache import PolicyLayer
from sparsegen.kv.kernels import kernels_available, reads_bytes
from sparsegen.kv.policy import PARTS, Policy, Sizes
from sparsegen.kv.slots import HeldSlots, slots_of_layer
from sparsegen.kv.spec import policy_step_settings
from sparsegen.kv.store import DEAD, EMPTY, RING, SlotStore
from sparsegen.kv.window import WindowPolicy


def reads_shared_context(policy: Policy, rolled: bool, quantized: bool) -> bool:
    """Whether a row of `policy` can read a shared context's keys in place of a copy: they must be
    in full precision, and at their original positions or (`rolled`) moved all together, as a
    contiguous policy's are (only its sinks move, `decode.context`)."""
    return not quantized and (not rolled or policy.contiguous)


def held_kv_dtype(layers: list[list[HeldSlots]], shared: bool) -> torch.dtype:
    """The dtype a batch holds keys and values in when none is asked for: on a CPU with the kernels,
    fp16 where every layer attends in the fused kernel (no eviction while decoding, no rolled
    positions, no heads held flat, no codec, no shared context), which widens fp16 as it reads: half
    the bytes of a step's attention, as llama.cpp's default KV. Zen 4, 1k context: 11.6 -> 10.0 ms a
    token for the default model, about 2 ms of 40 for the 1.5B (docs/benchmarks.md). fp32 elsewhere,
    where PyTorch's products would convert an fp16 cache back at every step."""
    parts = [part for layer in layers for part in layer]
    fused = (
        not shared
        and parts[0].keys.device.type == "cpu"
        and kernels_available()
        and all(
            part.codec is None and not part.evicting and part.rotation is None and not part.policy.head_adaptive
            for part in parts
        )
    )
    return torch.float16 if fused else torch.float32


def stack_layer(
    parts: list[HeldSlots],
    max_new_tokens: int,
    kv_dtype: torch.dtype,
    context: tuple[torch.Tensor, torch.Tensor] | None = None,
    min_slots: int = 0,
) -> LayerState:
    """One layer's slots for the rows of `parts`, room for `max_new_tokens` each (and at least
    `min_slots`, those of the batch they join). `context`, the
    keys and values [h, S, d] of a context every part read first (at positions 0..S-1), is read
    once per step instead of held per row, where every part holds full-precision keys at their
    original positions (an evicting row then evicts context tokens by mask, `decode.context`)."""
    shares = context is not None and all(
        reads_shared_context(part.policy, rolled=part.rotation is not None, quantized=part.codec is not None)
        for part in parts
    )
    if not shares and all(part.policy.head_adaptive and not part.evicting for part in parts):
        return stack_flat([part.flat() for part in parts], max_new_tokens, kv_dtype, min_slots)
    parts = [part.per_head() for part in parts]
    if not shares:
        return stack(parts, max(capacity_for(parts, max_new_tokens), min_slots), kv_dtype)
    keys, values = context
    split = [split_context(part, keys.shape[1]) for part in parts]
    own = [part for *_, part in split]
    state = stack(own, max(capacity_for(own, max_new_tokens, bounded=False), min_slots), kv_dtype, bounded=False)
    live, scores = (torch.cat(parts) for parts in zip(*(pair for *pair, _ in split), strict=True))
    rules = tuple(part.policy if part.evicting else None for part in parts for _ in range(part.keys.shape[0]))
    rolls = tuple(part.rotation is not None for part in parts for _ in range(part.keys.shape[0]))
    rotation = next((part.rotation for part in parts if part.rotation is not None), None)
    sinks = max((part.sizes.sinks for part in parts if part.rotation is not None), default=0)
    state.context = ContextRows(keys.to(kv_dtype), values.to(kv_dtype), live, scores, rules, rolls, rotation, sinks)
    state.evicting = any(rule is not None for rule in rules)  # rows of different policies may share the step
    state.rotation, state.sinks = None, 0  # the rows' own tokens are the newest: never moved
    return state


def slots_of(layer: CacheLayerMixin) -> HeldSlots:
    """One prefilled cache layer as slots: a policy layer's own, or a sliding-window layer's."""
    if isinstance(layer, PolicyLayer):
        return slots_of_layer(layer)
    # transformers' sliding-window layer (Gemma 3): the newest `sliding_window - 1` tokens
    held = layer.keys.shape[2]
    window = layer.sliding_window - 1
    positions = torch.arange(layer.cumulative_length - held, layer.cumulative_length, device=layer.keys.device)
    store = SlotStore(
        keys=layer.keys,
        values=layer.values,
        positions=positions.expand(*layer.keys.shape[:2], held).clone(),
        scores=layer.keys.new_zeros(layer.keys.shape[:3], dtype=torch.float32),
    )
    return HeldSlots(
        store,
        policy=WindowPolicy(recent=window),
        sizes=Sizes(recent=window),
        evicting=True,
    )


def capacity_for(parts: list[HeldSlots], max_new_tokens: int, bounded: bool = True) -> int:
    """Slots a layer needs: the most its policy holds of the largest budget (`Policy.held_at_most`:
    the token in flight, and the tokens let in before a compression), or (keeping every token,
    or not `bounded` by the budget) the longest held row plus its new tokens, rounded up to 64
    (fewer shapes to compile)."""
    if parts[0].evicting and bounded:
        return max(part.policy.held_at_most(part.sizes.budget) for part in parts)
    held = max(part.positions.shape[2] for part in parts)
    return -(-(held + max_new_tokens) // 64) * 64


def _check_one_step(parts: list[HeldSlots], bounded: bool) -> None:
    """Rows stacked into one step hold their KV in one codec and, evicting, share their policy's
    settings but the per-row counts (`KVSpec.step_key`); else a one-line error."""
    if any(part.codec != parts[0].codec for part in parts):
        raise SparsegenError("rows of one batch must hold their KV in the same number of bits (kv_bits)")
    if bounded and parts[0].evicting and len({policy_step_settings(part.policy) for part in parts}) > 1:
        raise SparsegenError(
            "rows evicting in one batch must share their policy and its settings but heavy and recent "
            "(KVSpec.step_key): decode the others apart"
        )


def _buffers(parts: list[HeldSlots], capacity: int, kv_dtype: torch.dtype, bounded: bool) -> SlotStore:
    """Every row's keys, values, positions and scores in `capacity` slots, the rest free (or DEAD,
    beyond an evicting row's budget where it is `bounded` by it): in the rows' codec's bytes where
    they are held in one, else in `kv_dtype`."""
    rows, (h, device) = sum(part.keys.shape[0] for part in parts), (parts[0].keys.shape[1], parts[0].keys.device)
    dtype = kv_dtype if parts[0].codec is None else torch.uint8
    keys, values = (
        torch.zeros(rows, h, capacity, t.shape[3], dtype=dtype, device=device) for t in (parts[0].keys, parts[0].values)
    )
    positions = torch.full((rows, h, capacity), EMPTY, dtype=torch.long, device=device)
    scores = torch.zeros(rows, h, capacity, device=device)
    row = 0
    for part in parts:
        n, held = part.keys.shape[0], part.keys.shape[2]
        keys[row : row + n, :, :held] = part.keys
        values[row : row + n, :, :held] = part.values
        positions[row : row + n, :, :held] = part.positions
        scores[row : row + n, :, :held] = part.scores
        if part.evicting and bounded:
            positions[row : row + n, :, part.policy.held_at_most(part.sizes.budget) :] = DEAD
        row += n
    ring = {} if parts[0].codec is None else {name: torch.cat([getattr(p, name) for p in parts]) for name in RING}
    return SlotStore(keys, values, positions, scores, parts[0].codec, **ring, kv_heads=parts[0].kv_heads)


def _row_sizes(parts: list[HeldSlots], device: torch.device) -> Sizes:
    """Each row's sizes, as [rows, 1, 1] tensors (a part's counts per row where it has them)."""

    def rows_of(part: HeldSlots, field: str) -> torch.Tensor:
        count = torch.as_tensor(getattr(part.sizes, field), dtype=torch.long, device=device)
        return count.reshape(-1).expand(part.keys.shape[0])

    return Sizes(*(torch.cat([rows_of(part, f) for part in parts]).view(-1, 1, 1) for f in PARTS))


def stack(parts: list[HeldSlots], capacity: int, kv_dtype: torch.dtype, bounded: bool = True) -> LayerState:
    """One layer's slots for all rows, from each row group's prefilled layer (`_buffers`)."""
    _check_one_step(parts, bounded)
    store = _buffers(parts, capacity, kv_dtype, bounded)
    keys, positions = store.keys, store.positions
    codec, device = parts[0].codec, keys.device
    policy, evicting = parts[0].policy, parts[0].evicting
    slot = (positions == EMPTY).int().argmax(-1, keepdim=True)
    rolled_per_slot = parts[0].rotation is not None and not policy.contiguous
    on_cpu = device.type == "cpu" and kernels_available()
    byte_products = (
        codec is not None and on_cpu and not rolled_per_slot and reads_bytes(codec) and not policy.reads_keys
    )
    rolled_products = (
        codec is None and on_cpu and rolled_per_slot and keys.dtype == torch.float32 and not policy.reads_keys
    )
    fused_attention = codec is None and on_cpu and keys.dtype in (torch.float32, torch.float16)
    return LayerState(
        policy=policy,
        sizes=_row_sizes(parts, device),
        evicting=evicting,
        store=store,
        slot=slot,
        rotation=parts[0].rotation,
        rope=parts[0].rope,
        layer=parts[0].layer,
        contiguous=policy.contiguous,
        sinks=max(part.sizes.sinks for part in parts),
        byte_products=byte_products,
        rolled_products=rolled_products,
        fused_attention=fused_attention,
    )


def stack_flat(parts: list[HeldSlots], max_new_tokens: int, kv_dtype: torch.dtype, min_slots: int = 0) -> LayerState:
    """One layer's slots for rows of a head-adaptive policy, their heads held flat (`kv.ragged`):
    each row's held slots, then free slots taken by its heads in turn, room for `max_new_tokens`
    each (and at least `min_slots`, those of the batch they join), rounded up to a multiple of 64
    slots (fewer shapes to compile): about the bytes of the budget, not heads x the largest head."""
    _check_one_step(parts, bounded=False)
    heads = parts[0].kv_heads
    step = math.lcm(64, heads)
    needed = max(part.keys.shape[2] for part in parts) + heads * max_new_tokens
    capacity = max(-(-needed // step) * step, min_slots)
    store = _buffers(parts, capacity, kv_dtype, bounded=False)
    positions = store.positions
    store.head_of = torch.arange(capacity, device=positions.device).remainder(heads).expand_as(positions).clone()
    row = 0
    for part in parts:
        store.head_of[row : row + part.keys.shape[0], :, : part.keys.shape[2]] = part.head_of
        row += part.keys.shape[0]
    return LayerState(
        policy=parts[0].policy,
        sizes=_row_sizes(parts, positions.device),
        evicting=False,
        store=store,
        slot=first_free(positions, store.head_of, heads),
        rotation=parts[0].rotation,
    )
