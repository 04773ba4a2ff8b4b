"""One prefill, many policies: read a context once, then hand each policy the cache it would have
made reading that context itself.

When a context is read in one forward, a policy layer evicts only after its attention call, and
the next layer's input is that attention over the whole context: every layer's queries, keys and
values of the context are the same whatever the policy. So they are recorded once (under the full
cache) and each policy's scoring and eviction is replayed on the record, through the same
`PolicyLayer` code a separate run goes through: the same cache, bit for bit, for the cost of the
scoring alone. What several policies score with (the attention each key received from the last
`n` queries: H2O, TOVA, SnapKV, ...) is computed once per layer and shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparsegen.decode.forward import as_given, read_rows, token_rows
from sparsegen.decode.kvzip_read import RepeatFrame, reconstruct
from sparsegen.errors import SparsegenError
from sparsegen.kv.cache import PolicyLayer
from sparsegen.kv.factory import make_cache
from sparsegen.kv.kvzip import OutputNorms, Probe, attention_and_peaks
from sparsegen.kv.policy import Policy
from sparsegen.kv.policy_cache import PolicyCache, layer_state, load_layer_state
from sparsegen.kv.spec import KVSpec


@dataclass
class Recorded:
    """One layer's attention call over the context: what `PolicyLayer.after_attention` is handed."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scaling: float
    weights: torch.Tensor | None
    received: dict = field(default_factory=dict)


class RecordingLayer(PolicyLayer):
    """A policy layer that keeps what its last attention call handed it (under `full`, everything)."""

    recorded: Recorded | None = None
    probing: Probe | None = None
    """While KVzip re-reads the context (`decode.kvzip_read.reconstruct`), the chunk it re-reads:
    compute the attention here and keep in `peak` the most attention each key received."""
    peak: torch.Tensor | None = None
    output_norms: OutputNorms | None = None
    """KVzip+'s weights for the re-read call about to run (set just before it, where asked)."""

    def own_attention(self, query, keys, values, scaling):
        if self.probing is None:
            return super().own_attention(query, keys, values, scaling)
        out, self.peak = attention_and_peaks(query, keys, values, scaling, self.probing, self.output_norms)
        return out

    def after_attention(self, query, keys, scaling, weights=None, received=None, values=None) -> None:
        self.recorded = Recorded(query, keys, self.values[:, :, : self.size], scaling, weights)
        super().after_attention(query, keys, scaling, weights, received)


class SharedPrefill:
    """The context `ids` (one row's list, or rows [b, n]) read once; `cache_for(policy)` is that
    policy's cache after reading it.

    `logits` are the last context token's next-token logits ([vocab], or [b, vocab]). The model's
    re-reading of the context (`kv.kvzip`) is run once for every policy that asks for it, inside
    `frame` (`decode.kvzip_read.RepeatFrame`: the words asking to repeat it) for an `instructed` one.
    """

    @torch.inference_mode()
    def __init__(self, model: torch.nn.Module, ids: list[int] | torch.Tensor, frame: RepeatFrame | None = None) -> None:
        self.model = model
        self.frame = frame
        self.rows = token_rows(model, ids)
        self.length = self.rows.shape[1]
        self.record = make_cache(model, "full", layer_class=RecordingLayer)
        self.logits = as_given(read_rows(model, self.rows, self.record, max(self.length, 1), all_logits=False), ids)
        self._reconstructions: dict[tuple, list] = {}

    @torch.inference_mode()
    def cache_for(self, kv: KVSpec | Policy) -> PolicyCache:
        """A new cache, as `read(model, ids, make_cache(model, kv))` leaves it."""
        cache = make_cache(self.model, KVSpec.coerce(kv).resolved(self.length))
        self.replay_into(cache)
        return cache

    @torch.inference_mode()
    def replay_into(self, cache: PolicyCache) -> None:
        """Let the fresh `cache` hold what reading the context into it would."""
        peaks = [None] * len(cache.layers)
        if cache.policy.reconstructs:
            peaks = self._reconstruction(cache.policy)
            cache.pool_layers(self.length, peaks)
        for layer, source, peak in zip(cache.layers, self.record.layers, peaks, strict=True):
            if isinstance(layer, PolicyLayer):
                call = source.recorded
                keys, values = layer.update(call.keys, call.values)
                layer.after_attention(call.query, keys, call.scaling, call.weights, call.received, peak, values)
            else:  # a sliding-window layer (Gemma 3) keeps its own window (replaced, never written in place)
                load_layer_state(layer, layer_state(source))

    def layer_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `index`'s context keys and values [h, S, d] as every policy's cache holds them
        (None for a layer without a policy, or several rows read at once)."""
        call = getattr(self.record.layers[index], "recorded", None)
        if call is None or self.rows.shape[0] != 1:
            return None
        return call.keys[0], call.values[0]

    def _reconstruction(self, policy: Policy) -> list[torch.Tensor | None]:
        instructed = policy.asks_to_repeat
        if instructed and self.frame is None:
            raise SparsegenError(
                f"{policy.name} with instructed=True asks the model to repeat the prompt in words from its "
                "tokenizer: give the tokenizer (sparsegen.generate(..., tokenizer=...); "
                "read(..., frame=repeat_frame(tokenizer))), or set instructed=False"
            )
        key = (tuple(policy.probes(self.length)), instructed, policy.weighs_writes)
        if key not in self._reconstructions:
            frame = self.frame if instructed else None
            self._reconstructions[key] = reconstruct(self.model, self.record, self.rows, key[0], frame, key[2])
        return self._reconstructions[key]
