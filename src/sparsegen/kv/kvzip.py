"""KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction"): a context token matters if the model needs it to reproduce the context. Once the
prompt is read, the model re-reads it after itself (teacher-forced, in chunks, the cache left
whole), and each held token scores the most attention any query of its group paid it while its
chunk was re-read. The layer keeps the highest scores of all its heads together (a head-adaptive
pool, held in exactly the budget's bytes), the first `sinks` tokens always. Decoding then keeps
every new token. The score does not depend on any question, so one compressed context answers many.

The re-reading is one more pass over the context, each chunk attending over the context and its
copy. Running it is decode's work (`decode.kvzip_read.reconstruct`): `decode.reading.read` runs it
for a fresh cache whose policy `reconstructs`, `decode.shared.SharedPrefill` once per context for
every budget; this module scores with what it found. Choices beside kvpress's
press: the chunks are re-read without an instruction text ("Repeat the previous context
exactly."), so no tokenizer is needed and base models work too; the attention is the model's own
(softmax over the whole cache), where kvpress renormalises it over the sinks, the chunk and its
copy; the pool is per layer (kvpress's `layerwise=True` budget split).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv.policy import KEEP, Policy, attention_chunks, register_policy


@register_policy
@dataclass
class KVzipPolicy(Policy):
    """Keep the context tokens the model attends to most while reproducing the context (KVzip)."""

    name = "kvzip"
    prefill_only = True
    head_adaptive = True
    reconstructs = True

    sinks: int = 4
    """First tokens every head keeps."""
    heavy: int | float = 256
    """Context tokens per head, on average over the layer, kept by score: a count or a share."""
    chunk: int = 2048
    """Context tokens re-read per forward (bounds the re-reading's attention memory)."""
    cue: int = 8
    """Tokens of the previous chunk re-read before each later chunk, so its copy starts in place."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk < 1 or self.cue < 0:
            raise SparsegenError(f"kvzip needs chunk >= 1 and cue >= 0, got chunk={self.chunk}, cue={self.cue}")

    def probes(self, length: int) -> list[tuple[int, int, int]]:
        """How a `length`-token context is re-read: (first token read, first scored, end) per chunk."""
        return [
            (max(0, start - self.cue), start, min(length, start + self.chunk)) for start in range(0, length, self.chunk)
        ]

    def score(self, step):
        if step.reconstruction is not None:
            return step.reconstruction
        if step.sizes is None or step.positions.shape[-1] <= step.sizes.budget:
            return None  # nothing to choose
        raise SparsegenError(
            "kvzip scores the prompt by re-reading it: read the prompt with sparsegen.decode.read(model, ids, cache) "
            "into a fresh cache (sparsegen.generate and the server do), not through model.generate"
        )

    def priority(self, step):
        return step.scores.masked_fill(step.is_sink(), KEEP)


def attention_and_peaks(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float):
    """One attention call computed by hand, with what KVzip scores by: the output [b, q, hq, d] (as
    transformers' attention functions return it) and the most attention any query of its group
    paid each key, float32 [b, hkv, s]. One pass instead of the model's attention and a second
    scoring pass over the same queries and keys."""
    b, hq, q, d = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    out = torch.empty(b, hkv, hq // hkv, q, d, dtype=torch.float32, device=query.device)
    peak = torch.zeros(b, hkv, s, dtype=torch.float32, device=query.device)
    for start, stop, seen, probabilities in attention_chunks(query, keys, scaling):
        torch.maximum(peak[..., :seen], probabilities.amax(dim=2), out=peak[..., :seen])
        out[:, :, :, start:stop] = (probabilities @ values[..., :seen, :].float()).view(b, hkv, -1, stop - start, d)
    return out.view(b, hq, q, d).transpose(1, 2).to(query.dtype).contiguous(), peak
