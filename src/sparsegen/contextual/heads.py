"""Deja Vu's attention-head sparsity: per token, run only the heads a low-rank predictor expects to matter.

A head's part of the block output is W_o[:, head] a_head; the labels are each token's top-k heads by
the norm of that part, and the predictor is the neurons' low-rank network over the attention input.
`SparseAttention` replaces a layer's attention module and runs the usual attention forward with
three changes. Queries: a decode step computes only the kept heads' rows of q_proj (one small
product per head, the faster way below half of the heads, measured; above it the dense product),
and a skipped head's query is zero (prefill and teacher-forced rows zero each token's own skipped
heads). Keys and values: computed for every head at every token, so the cache stays complete and a
head skipped now sees every earlier token when it is next selected (Deja Vu's other choice,
recomputing them on demand, would save k/v reads that GQA already makes small). Output: o_proj reads
only the kept heads' columns (stored transposed, `embedding_bag` at one row); a skipped head still
attends, with a zero query, so the KV policies' scores stay defined, and its output is discarded.
A decode step of several rows runs the union of their heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsegen.contextual.attend import attend, rotary
from sparsegen.contextual.predictor import LowRank, fit_low_rank, top_k_labels
from sparsegen.contextual.selector import checked_sparsity
from sparsegen.errors import SparsegenError


class HeadPredictor:
    """A low-rank predictor, per layer, of each token's top heads from the attention input."""

    def __init__(self, sparsity: float, rank: int = 32, steps: int = 200, lr: float = 3e-3, seed: int = 0) -> None:
        self.sparsity = checked_sparsity(sparsity, "head sparsity")
        self.rank, self.steps, self.lr, self.seed = rank, steps, lr, seed
        self.down: torch.Tensor | None = None
        self.up: torch.Tensor | None = None
        self.recall = self.lookahead_recall = torch.tensor(float("nan"))

    def kept_heads(self, heads: int) -> int:
        return max(1, round((1 - self.sparsity) * heads))

    def calibrate(self, inputs: torch.Tensor, part_norms: torch.Tensor, previous: torch.Tensor | None) -> None:
        """Train on attention inputs [t, hidden] against each head's output norm [t, heads];
        `previous` (the previous layer's attention inputs) measures lookahead's recall."""
        labels = top_k_labels(part_norms, self.kept_heads(part_norms.shape[1]))
        settings = (self.rank, self.steps, self.lr, self.seed)
        own, recall = fit_low_rank(inputs, labels, *settings)
        self.down, self.up, self.recall = own.down, own.up, torch.tensor(recall)
        if previous is not None:
            self.lookahead_recall = torch.tensor(fit_low_rank(previous, labels, *settings)[1])

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """Boolean mask [t, heads] for attention inputs [t, hidden]."""
        heads = self.up.shape[1]
        if self.sparsity == 0:
            return torch.ones(x.shape[0], heads, dtype=torch.bool, device=x.device)
        return LowRank(self.down, self.up).top(x, self.kept_heads(heads))

    def state(self) -> dict[str, torch.Tensor]:
        return {"down": self.down, "up": self.up, "recall": self.recall, "lookahead_recall": self.lookahead_recall}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


def head_part_norms(o_proj: nn.Linear, attended: torch.Tensor, heads: int) -> torch.Tensor:
    """||W_o[:, head] a_head|| per token and head [t, heads], from o_proj's inputs [t, heads * head_dim]."""
    per_head = o_proj.weight.float().view(o_proj.out_features, heads, -1).permute(1, 2, 0)  # [heads, d, hidden]
    parts = torch.einsum("thd,hdo->tho", attended.float().view(attended.shape[0], heads, -1), per_head)
    return parts.norm(dim=-1)


class SparseAttention(nn.Module):
    """A layer's attention computing only its predicted heads (see the module docstring)."""

    def __init__(self, attention: nn.Module, predictor: HeadPredictor) -> None:
        super().__init__()
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if not all(type(getattr(attention, name, None)) is nn.Linear for name in names):
            raise SparsegenError(
                f"{type(attention).__name__} has no plain q_proj/k_proj/v_proj/o_proj Linears (teal and wina replace "
                "them): head sparsity needs them; use a neuron selector other than teal or wina"
            )
        self.original, self.predictor = attention, predictor
        self.heads = attention.config.num_attention_heads
        self.head_dim = attention.head_dim
        self.rotate = rotary(attention)
        self.register_buffer("o_t", attention.o_proj.weight.detach().t().contiguous(), persistent=False)
        rows = torch.arange(self.heads * self.head_dim).view(self.heads, self.head_dim)
        self.register_buffer("head_rows", rows, persistent=False)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        attn = self.original
        shape = hidden_states.shape[:-1]
        keep = self.predictor.keep(hidden_states.reshape(-1, hidden_states.shape[-1])).view(*shape, self.heads)
        step = shape[-1] == 1 and not torch.compiler.is_compiling()
        index = None
        if step:  # one token per row: the rows share the union of their heads
            union = keep.reshape(-1, self.heads).any(0)
            keep = union.expand_as(keep)
            index = union.nonzero().squeeze(1)
        query = self._query(hidden_states, keep, index).transpose(1, 2)
        key = attn.k_proj(hidden_states).view(*shape, -1, self.head_dim).transpose(1, 2)
        value = attn.v_proj(hidden_states).view(*shape, -1, self.head_dim).transpose(1, 2)
        out, weights = attend(
            attn, self.rotate, query, key, value, position_embeddings, attention_mask, cache, **kwargs
        )
        return self._output(out, keep, index), weights

    def _query(self, x: torch.Tensor, keep: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        """Queries [b, t, heads, head_dim], zero for skipped heads."""
        q_proj = self.original.q_proj
        if index is None or 2 * index.numel() >= self.heads:
            return q_proj(x).view(*x.shape[:-1], self.heads, self.head_dim) * keep[..., None]
        query = x.new_zeros(*x.shape[:-1], self.heads, self.head_dim)
        for head in index.tolist():
            rows = slice(head * self.head_dim, (head + 1) * self.head_dim)
            bias = None if q_proj.bias is None else q_proj.bias[rows]
            query[..., head, :] = F.linear(x, q_proj.weight[rows], bias)
        return query

    def _output(self, out: torch.Tensor, keep: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        """o_proj over the kept heads' outputs; out [b, t, heads, head_dim]."""
        o_proj = self.original.o_proj
        if index is None or index.numel() == self.heads or out.shape[0] * out.shape[1] > 1:
            return o_proj((out * keep[..., None]).reshape(*out.shape[:2], -1))
        weights = out[0, 0, index].reshape(1, -1)
        result = F.embedding_bag(self.head_rows[index].reshape(1, -1), self.o_t, per_sample_weights=weights, mode="sum")
        result = result if o_proj.bias is None else result + o_proj.bias
        return result.view(1, 1, -1)

    def read_share(self, kept: float, rows: int) -> dict[str, float]:
        """Share of each projection's weight a decode step of `rows` rows reads when `kept` of the heads run."""
        query = kept if 2 * round(kept * self.heads) < self.heads else 1.0
        return {"q_proj": query, "k_proj": 1.0, "v_proj": 1.0, "o_proj": kept if rows == 1 else 1.0}
