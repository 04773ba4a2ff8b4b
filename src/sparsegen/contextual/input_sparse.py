"""Input sparsity in execution: a block whose projections read, per token, only the weight rows of
their largest inputs (TEAL).

Projections that read the same input share one selection and one gather: q, k and v are one
`InputSparseLinear`, gate and up another, so a kept input is one contiguous row of all their
weights side by side (measured on the Xeon host: 19.2 ms against 25.3 ms for the seven projections
gathered one by one, 30 layers of SmolLM2 at 75% kept). The weights are stored transposed and
`embedding_bag` sums the kept rows, in two bags that split the kept rows between the two cores.
On a GPU, a Triton gather-GEMV (`sparsegen.kernels.gather`) reads each row's own kept rows for
the few rows of a decode step (or, `shared`, the union of a batch's kept rows once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sparsegen.contextual.attend import attend, rotary
from sparsegen.contextual.parts import MLPParts, NeuronChoice

KERNEL_ROWS = 16  # rows a GPU gathers for; more (a prefill) run the masked dense product on tensor cores


class InputSparseLinear(nn.Module):
    """Linears over one input, as one: zeroes all but the `keep` largest |x| of each input row and
    returns their outputs side by side. One row (a decode step) reads only the kept inputs' weight
    rows; more rows run the dense product of the masked input, which is the same arithmetic."""

    def __init__(
        self, linears: Sequence[nn.Linear], sparsity: float, shared: bool = False, weighted: bool = False
    ) -> None:
        super().__init__()
        self.shared = shared  # on a GPU, several rows read the union of their kept inputs' rows once
        self.linears = tuple(linears)  # registered in the wrapped module already; here for the dense case
        self.in_features = linears[0].in_features
        self.splits = [linear.out_features for linear in linears]
        self.keep = min(self.in_features, max(1, round((1 - sparsity) * self.in_features)))
        weight_t = torch.cat([linear.weight.detach() for linear in linears]).t().contiguous()
        self.register_buffer("weight_t", weight_t, persistent=False)  # [in, sum of outs]
        # WINA: an input's score is |x| times the norm of the weights it multiplies (None: |x| alone)
        self.register_buffer("input_norms", weight_t.norm(dim=1) if weighted else None, persistent=False)
        has_bias = any(linear.bias is not None for linear in linears)
        bias = torch.cat([_bias(linear) for linear in linears]) if has_bias else None
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("bags", torch.tensor([0, self.keep // 2], device=weight_t.device), persistent=False)

    @property
    def read_share(self) -> float:
        """Share of the weights one decode step reads."""
        return self.keep / self.in_features

    def gathered(self, row: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """The two bags' sums [2, outs] of the kept inputs' weight rows, weighted by their values."""
        return F.embedding_bag(top, self.weight_t, self.bags, per_sample_weights=row[top], mode="sum")

    def kept(self, rows: torch.Tensor) -> torch.Tensor:
        """Each row's kept inputs [rows, keep]: its largest scores (`input_scores`)."""
        return input_scores(rows, self.input_norms).topk(self.keep, dim=-1, sorted=False).indices

    def gathered_per_row(self, rows: torch.Tensor) -> torch.Tensor:
        """[rows, outs] by the Triton gather-GEMV: each row reads only its own kept inputs' rows."""
        from sparsegen.kernels.gather import gathered_product  # triton: imported only on a GPU

        return gathered_product(rows, self.weight_t, self.kept(rows))

    def gathered_shared(self, rows: torch.Tensor) -> torch.Tensor:
        """[rows, outs] by the Triton gather-GEMV over the union of the rows' kept inputs, each
        row's other inputs zeroed: the same values as `gathered_per_row`, each weight row read once."""
        from sparsegen.kernels.gather import gathered_product  # triton: imported only on a GPU

        chosen = torch.zeros_like(rows, dtype=torch.bool).scatter_(1, self.kept(rows), True)
        return gathered_product(rows * chosen, self.weight_t, chosen.any(0).nonzero().squeeze(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.keep == self.in_features:  # the original arithmetic, so that all kept equals dense exactly
            return torch.cat([linear(x) for linear in self.linears], -1)
        if rows.is_cuda and rows.shape[0] <= KERNEL_ROWS:
            out = self.gathered_shared(rows) if self.shared and rows.shape[0] > 1 else self.gathered_per_row(rows)
        elif rows.shape[0] == 1:
            out = self.gathered(rows[0], self.kept(rows)[0]).sum(0, keepdim=True)
        else:
            top = self.kept(rows)
            out = torch.zeros_like(rows).scatter_(1, top, rows.gather(1, top)) @ self.weight_t
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], -1)


class InputSparseAttention(nn.Module):
    """A layer's attention with input-sparse q/k/v (one selection) and o projections."""

    def __init__(
        self, attention: nn.Module, qkv_sparsity: float, o_sparsity: float, shared: bool = False, weighted: bool = False
    ) -> None:
        super().__init__()
        self.original = attention
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        self.qkv = InputSparseLinear(projections, qkv_sparsity, shared, weighted)
        self.o = InputSparseLinear([attention.o_proj], o_sparsity, shared, weighted)
        self.rotate = rotary(attention)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        attn, shape = self.original, hidden_states.shape[:-1]
        query, key, value = (
            part.view(*shape, -1, attn.head_dim).transpose(1, 2)
            for part in self.qkv(hidden_states).split(self.qkv.splits, -1)
        )
        out, weights = attend(
            attn, self.rotate, query, key, value, position_embeddings, attention_mask, cache, **kwargs
        )
        return self.o(out.reshape(*shape, -1)), weights


class InputSparseMLP(nn.Module):
    """An MLP with input-sparse gate and up (one selection) and down projections."""

    def __init__(
        self,
        mlp: nn.Module,
        parts: MLPParts,
        selector: NeuronChoice,
        in_sparsity: float,
        h_sparsity: float,
        shared: bool = False,
        weighted: bool = False,
    ):
        super().__init__()
        self.original, self.selector, self.act, self.gated = mlp, selector, parts.act, parts.gate is not None
        inputs = [parts.gate, parts.up] if self.gated else [parts.up]
        self.gate_up = InputSparseLinear(inputs, in_sparsity, shared, weighted)
        self.down = InputSparseLinear([parts.down], h_sparsity, shared, weighted)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.down(self.act(self.gate_up(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


def input_scores(rows: torch.Tensor, norms: torch.Tensor | None) -> torch.Tensor:
    """How much each input [.., in] matters to the product: |x| (TEAL), or |x| times the norm of the
    weights it multiplies (WINA: a large input on small weights changes the output less)."""
    return rows.abs() if norms is None else rows.abs() * norms


def _bias(linear: nn.Linear) -> torch.Tensor:
    return linear.bias.detach() if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
