"""KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction"): a context token matters if the model needs it to reproduce the context. Once the
prompt is read, the model re-reads it after itself (teacher-forced, in chunks, the cache left
whole), and each held token scores the most attention any query of its group paid it while its
chunk was re-read. The model keeps the highest scores of all its layers' heads together (one
pool: a layer the context matters little to gives its slots to one it matters to, as in the
paper), each layer holding its share in exactly its bytes (heads flat), the first `sinks` tokens
always. Decoding then keeps every new token. The score does not depend on any question, so one
compressed context answers many.

The re-reading is one more pass over the context, each chunk attending over the context and its
copy. Running it is decode's work (`decode.kvzip_read.reconstruct`): `decode.reading.read` runs it
for a fresh cache whose policy `reconstructs`, `decode.shared.SharedPrefill` once per context for
every budget; this module scores with what it found. As in the paper and kvpress, each re-read
query's attention is renormalised over the sinks, the chunk and its copy (`scope="chunk"`;
"cache": the model's own softmax over all it sees). By default the chunks are re-read bare (no
tokenizer needed, base models work too); the paper and kvpress ask the model to repeat the context
first (`instructed`: words from the tokenizer, `decode.kvzip_read.RepeatFrame`), which scored no
better on RULER at 4k (docs/benchmarks.md). `pool="layer"` keeps each layer's budget as it is
(kvpress's `layerwise=True`). `output_norms` weighs each probability by what it writes (KVzip+).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv.policy import KEEP, Policy, Sizes, attention_chunks, register_policy

POOLS = ("model", "layer")
SCOPES = ("cache", "chunk")


class Probe(NamedTuple):
    """One re-read: the context's tokens [first, stop) read again after it, the cue [first, start)
    then the chunk [start, stop) it scores. `sinks`: with a chunk-scoped softmax, the first tokens
    it keeps beside the chunk and its copy (None: the model's softmax over all the re-read sees)."""

    first: int
    start: int
    stop: int
    sinks: int | None = None


class OutputNorms(NamedTuple):
    """KVzip+'s weights for one layer's re-read call: `gram` [hkv, group, d, d], W_j^T W_j of each
    query head j's slice of the output projection (so ||W_j v||^2 = v . gram_j v), and `hidden` [b, q],
    the norm of each re-read token's hidden state entering the attention."""

    gram: torch.Tensor
    hidden: torch.Tensor


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
    pool: str = "model"
    """"model": every layer's heavy slots in one pool, the highest peaks of the whole model;
    "layer": each layer keeps the budget's count per head, its heads pooled."""
    scope: str = "chunk"
    """What a re-read query's attention is normalised over where it scores: "chunk", the first `sinks`
    tokens, the chunk and its copy only (the paper's and kvpress's), so a chunk's scores do not
    shrink as the context holds more chunks; "cache", all it sees (the model's own softmax, as the
    next layer reads it)."""
    instructed: bool = False
    """Re-read each chunk after an instruction to repeat the context, in the model's chat turn (the
    paper's; `decode.kvzip_read.RepeatFrame`, built from the tokenizer), instead of bare."""
    output_norms: bool = False
    """KVzip+ (the KVzap paper's; kvpress's `kvzip_plus_normalization`): each re-read query's
    probability of a key times the norm of what that key's value writes through the query head's
    slice of the output projection, over the norm of the query token's hidden state: a key that
    draws attention but writes little to the residual stream scores less."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk < 1 or self.cue < 0:
            raise SparsegenError(f"kvzip needs chunk >= 1 and cue >= 0, got chunk={self.chunk}, cue={self.cue}")
        if self.pool not in POOLS:
            raise SparsegenError(f"kvzip's pool is one of {', '.join(POOLS)}, got {self.pool!r}")
        if self.scope not in SCOPES:
            raise SparsegenError(f"kvzip's scope is one of {', '.join(SCOPES)}, got {self.scope!r}")

    @property
    def asks_to_repeat(self) -> bool:
        return self.instructed

    @property
    def weighs_writes(self) -> bool:
        return self.output_norms

    def probes(self, length: int) -> list[Probe]:
        """How a `length`-token context is re-read, chunk by chunk (a chunk-scoped softmax keeps the
        sinks before its chunk: the first chunk holds them itself, counted once)."""
        return [
            Probe(max(0, start - self.cue), start, min(length, start + self.chunk), self._sinks_before(start))
            for start in range(0, length, self.chunk)
        ]

    def _sinks_before(self, start: int) -> int | None:
        return min(self.sinks, start) if self.scope == "chunk" else None

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

    def pooled_sizes(self, sizes: list[Sizes], scores: list[torch.Tensor]) -> list[Sizes]:
        return model_pool(sizes, scores) if self.pool == "model" else sizes


def model_pool(sizes: list[Sizes], scores: list[torch.Tensor]) -> list[Sizes]:
    """The layers' heavy counts when their heavy slots are one pool: the highest of every layer's
    scores [b, h, n] past its sinks, counted per layer and row and rounded to whole tokens per head
    by largest remainders, each row's total unchanged (ints where the rows agree, else one count
    per row, [b, 1, 1])."""
    heads = scores[0].shape[1]
    if any(score.shape[1] != heads for score in scores):
        raise SparsegenError("kvzip's model-wide pool needs every layer to hold as many KV heads")
    free = [score[..., size.sinks :].flatten(1) for size, score in zip(sizes, scores, strict=True)]
    pool = torch.cat(free, dim=1)
    rows, layers = pool.shape[0], len(free)
    chosen = pool.topk(min(sum(size.heavy for size in sizes) * heads, pool.shape[1]), dim=1).indices
    ends = torch.tensor([part.shape[1] for part in free], device=pool.device).cumsum(0)
    layer_of = torch.bucketize(chosen, ends, right=True) + layers * torch.arange(rows, device=pool.device)[:, None]
    shares = torch.bincount(layer_of.flatten(), minlength=rows * layers).view(rows, layers).double() / heads
    heavy = shares.floor().long()
    short = (shares.sum(1).round().long() - heavy.sum(1)).unsqueeze(1)  # [b, 1]
    by_remainder = (shares - heavy).argsort(dim=1, descending=True, stable=True)
    heavy.scatter_add_(1, by_remainder, (torch.arange(layers, device=pool.device) < short).long())
    same = bool((heavy == heavy[0]).all())
    counts = heavy[0].tolist() if same else heavy.T.reshape(layers, rows, 1, 1)
    return [Sizes(size.sinks, count, size.recent) for size, count in zip(sizes, counts, strict=True)]


def attention_and_peaks(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    probe: Probe | None = None,
    norms: OutputNorms | None = None,
):
    """One attention call computed by hand, with what KVzip scores by: the output [b, q, hq, d] (as
    transformers' attention functions return it) and the most attention any query of its group
    paid each key, float32 [b, hkv, s]. One pass instead of the model's attention and a second
    scoring pass over the same queries and keys. With a chunk-scoped `probe`, the scores are each
    query's probabilities renormalised over the probe's sinks, its chunk and the new keys (the
    output stays the model's); with `norms`, KVzip+'s weights on the scores (`OutputNorms`)."""
    b, hq, q, d = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    out = torch.empty(b, hkv, hq // hkv, q, d, dtype=torch.float32, device=query.device)
    peak = torch.zeros(b, hkv, s, dtype=torch.float32, device=query.device)
    scoped = probe is not None and probe.sinks is not None
    if norms is not None:  # ||W_j v|| of every key for every query head j [b, hkv, group, s]
        held = values.float()
        written = torch.einsum("bksd,kgde,bkse->bkgs", held, norms.gram, held).clamp_min(0).sqrt()
    for start, stop, seen, probabilities in attention_chunks(query, keys, scaling):
        scores = probabilities
        if scoped:
            within = probabilities[..., : probe.sinks].sum(-1, keepdim=True) + probabilities[..., s - q :].sum(-1, True)
            scores = probabilities / (within + probabilities[..., probe.start : probe.stop].sum(-1, keepdim=True))
        if norms is not None:  # rows group-major: head j's queries start:stop together
            weight = written[..., None, :seen] / norms.hidden[:, None, None, start:stop, None]
            scores = scores * weight.reshape(b, hkv, -1, seen)
        torch.maximum(peak[..., :seen], scores.amax(dim=2), out=peak[..., :seen])
        out[:, :, :, start:stop] = (probabilities @ values[..., :seen, :].float()).view(b, hkv, -1, stop - start, d)
    return out.view(b, hq, q, d).transpose(1, 2).to(query.dtype).contiguous(), peak
