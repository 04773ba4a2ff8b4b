"""The memory a server may hold, stated when it starts: what it holds then, the KV it may add, and
a workspace for the largest reads and steps it lets in.

`at_start` is the process's resident memory once the engine is ready (interpreter, libraries,
the weights and the few-row kernel's packed copy of them, both also given on their own); `kv` is
`max_kv_bytes`, which admission never lets active rows and held conversations pass; `workspace`
is, in fp32, one prompt chunk through one layer (its hidden states, the MLP's widths and the
attention scores over every position the model has: a policy that scores keys holds them), the
logits of a chunk and of `rows` decode rows with their log-softmax. `bench soak` holds the
server's peak RSS to `total`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from sparsegen.rss import current_rss_mb

GB = 1e9


@dataclass(frozen=True)
class MemoryBound:
    at_start: int
    weights: int
    packed: int
    kv: int
    workspace: int

    @property
    def total(self) -> int:
        return self.at_start + self.kv + self.workspace

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}

    def describe(self) -> str:
        return (
            f"memory bound {self.total / GB:.2f} GB: {self.at_start / GB:.2f} at start (weights "
            f"{self.weights / GB:.2f}, packed copy {self.packed / GB:.2f}) + KV {self.kv / GB:.2f} "
            f"+ workspace {self.workspace / GB:.2f}"
        )


def memory_bound(model: torch.nn.Module, packed: dict, max_kv_bytes: int, prefill_chunk: int, rows: int) -> MemoryBound:
    """The bound of a server over `model` and its `packed` weights, measured now (the engine ready)."""
    return MemoryBound(
        at_start=int(current_rss_mb() * 2**20),
        weights=tensor_bytes([*model.parameters(), *model.buffers()]),
        packed=tensor_bytes(packed.values()),
        kv=max_kv_bytes,
        workspace=workspace_bytes(model.config, prefill_chunk, rows),
    )


def tensor_bytes(tensors) -> int:
    """Bytes of the storages under `tensors`, each storage once (tied weights, views)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device.type == "cpu"}
    return sum(storages.values())


def workspace_bytes(config, prefill_chunk: int, rows: int) -> int:
    """fp32 bytes of one `prefill_chunk` through one layer and of the logits of a chunk and of `rows` rows."""
    text = config.get_text_config(decoder=True)
    heads, positions = text.num_attention_heads, text.max_position_embeddings
    per_token = 4 * text.hidden_size + 3 * text.intermediate_size + heads * (positions + prefill_chunk)
    return 4 * (prefill_chunk * per_token + (prefill_chunk + 2 * rows) * text.vocab_size)
