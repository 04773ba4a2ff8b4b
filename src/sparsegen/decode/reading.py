"""Reading text into a policy cache: `read` (a prompt, the last logits) and `stream` (a long
text in chunks, with the logits of every token: streaming perplexity). Generating is
`generate()`'s one token loop, which continues such a cache (`held=`), as chats and the server do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from sparsegen.decode.forward import as_given, read_rows, token_rows
from sparsegen.decode.kvzip_read import RepeatFrame
from sparsegen.decode.shared import SharedPrefill
from sparsegen.errors import SparsegenError
from sparsegen.fused_layers import fused_layers
from sparsegen.kv.attention import PackedEngine, policy_attention
from sparsegen.kv.cache import PolicyLayer
from sparsegen.kv.factory import make_cache
from sparsegen.kv.policy import Policy
from sparsegen.kv.policy_cache import PolicyCache
from sparsegen.kv.spec import KVSpec
from sparsegen.models import decoder_layers


class Abandoned(Exception):
    """A read stopped between two decoder layers because its `stop` said so (the server's
    cancelled request); the cache it was filling is half-written and must be dropped."""


@contextmanager
def stoppable(model: torch.nn.Module, stop: Callable[[], bool] | None) -> Iterator[None]:
    """Within the block, every decoder layer first asks `stop()` and raises `Abandoned` when it
    says so: a prompt read in one forward can still be left after one layer's work."""
    if stop is None:
        yield
        return

    def check(_module, _args) -> None:
        if stop():
            raise Abandoned("the read was stopped")

    handles = [layer.register_forward_pre_hook(check) for layer in decoder_layers(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class StreamStep:
    """One forward step: the tokens fed [b, n] and their logits [b, n, vocab]."""

    tokens: torch.Tensor
    logits: torch.Tensor


@torch.inference_mode()
def read(
    model: torch.nn.Module,
    ids: list[int] | torch.Tensor,
    cache: PolicyCache,
    chunk: int | None = None,
    all_logits: bool = False,
    stop: Callable[[], bool] | None = None,
    frame: RepeatFrame | None = None,
) -> torch.Tensor | None:
    """Read token `ids` (one row's list, or rows [b, n]) into `cache`, `chunk` tokens per forward
    (default: one forward), so the policy evicts between chunks. Returns the logits of every id
    ([n, vocab], or [b, n, vocab]) with `all_logits`, else of the last one ([vocab], or [b, vocab];
    None for no ids); only what is returned is computed, so long prompts stay cheap. A policy that
    compresses the prompt once (`prefill_only`) reads a fresh cache's prompt in one forward, so
    that its one choice sees the whole prompt; one that re-reads the prompt to score it
    (`kv.kvzip`) does so then, inside `frame` where its policy is `instructed`. `stop`, asked before
    every decoder layer, abandons the read (`Abandoned`) when it says so."""
    with stoppable(model, stop):
        return _read(model, ids, cache, chunk, all_logits, frame)


def _read(model, ids, cache: PolicyCache, chunk: int | None, all_logits: bool, frame: RepeatFrame | None):
    rows = token_rows(model, ids)
    step = chunk or max(rows.shape[1], 1)
    if reads_whole(cache) and rows.shape[1]:
        step = rows.shape[1]
        if cache.policy.reconstructs:
            return as_given(_read_reconstructing(model, rows, cache, all_logits, frame), ids)
    return as_given(read_rows(model, rows, cache, step, all_logits), ids)


@torch.inference_mode()
def read_packed(
    model: torch.nn.Module,
    prompts: list[list[int]],
    caches: list[PolicyCache],
    stop: Callable[[], bool] | None = None,
) -> torch.Tensor:
    """Read each prompt into its own fresh cache in one forward of the prompts packed end to end,
    so the weights are read once for all of them (the server's waiting prompts); every prompt
    attends only to itself, as `read` alone would read it. Returns each prompt's last logits
    [prompts, vocab]. Every cache must be `packable`; `stop` as for `read`."""
    if not prompts or len(prompts) != len(caches) or not all(prompts):
        raise SparsegenError("read_packed needs one non-empty prompt per cache")
    if not all(packable(cache) for cache in caches):
        raise SparsegenError("read_packed reads only into fresh caches of plain policy layers: use read() for the rest")
    device = next(model.parameters()).device
    ids = torch.tensor([[token for prompt in prompts for token in prompt]], device=device)
    positions = torch.cat([torch.arange(len(prompt), device=device) for prompt in prompts])[None]
    ends = torch.tensor([len(prompt) for prompt in prompts]).cumsum(0)
    bounds = [(int(end) - len(prompt), int(end)) for prompt, end in zip(prompts, ends, strict=True)]
    with stoppable(model, stop), fused_layers(model), policy_attention(model):
        out = model(
            input_ids=ids,
            position_ids=positions,
            use_cache=False,
            attention_engine=PackedEngine(caches, bounds),
            logits_to_keep=(ends - 1).to(device),
        )
    return out.logits[0].float()


def packable(cache: PolicyCache) -> bool:
    """Whether a prompt can be read into `cache` packed with others: nothing held yet, every layer
    a policy layer (no model's own sliding window), and no policy that re-reads the prompt."""
    plain = all(isinstance(layer, PolicyLayer) for layer in cache.layers)
    return plain and cache.get_seq_length() == 0 and not cache.policy.reconstructs


def reads_whole(cache: PolicyCache) -> bool:
    """Whether the next prompt read into `cache` must come in one forward: its policy compresses
    the prompt once, and nothing is held yet (the server's prefill asks this too)."""
    return cache.policy.prefill_only and cache.get_seq_length() == 0


def _read_reconstructing(model, rows: torch.Tensor, cache: PolicyCache, all_logits: bool, frame) -> torch.Tensor:
    """A policy that scores the prompt by the model re-reading it (`kv.kvzip`): `rows` [b, n] read
    in one forward under the full cache, re-read, then replayed into `cache` (`decode.shared`); the
    last token's logits [b, vocab]."""
    if all_logits:
        raise SparsegenError(
            f"{cache.policy.name} re-reads the prompt to score it and gives only the last token's logits: "
            "drop the prompt's logprobs (echo) or choose another policy"
        )
    shared = SharedPrefill(model, rows, frame)
    shared.replay_into(cache)
    return shared.logits


@torch.inference_mode()
def stream(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    kv: KVSpec | str | Policy = "streaming",
    chunk: int = 1,
    cache: PolicyCache | None = None,
) -> Iterator[StreamStep]:
    """Feed `input_ids` [b, n] (or [n]) `chunk` tokens at a time, yielding each forward's tokens
    and logits. Pass `cache` to continue an earlier stream (the next part of a long text);
    otherwise one is made from the KV spec `kv` (or a bare policy name). To generate after
    the text, hand the cache to `sparsegen.generate(..., held=[cache])`: the one token loop."""
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    if cache is None:
        cache = make_cache(model, kv)
    device = next(model.parameters()).device
    with policy_attention(model):  # held while the caller iterates; undone when the stream ends or is closed
        for start in range(0, input_ids.shape[1], chunk):
            tokens = input_ids[:, start : start + chunk].to(device)
            yield StreamStep(tokens, model(input_ids=tokens, cache=cache, use_cache=True).logits)
