"""An MLP that computes only the neurons its selector keeps.

One token per row (decoding) takes the gathered path: rows of up (and of gate, unless the
selector needs the whole gate) are gathered for the kept neurons, and down is stored transposed
([neurons, hidden], Deja Vu's column-major W2) so that `embedding_bag` sums just the kept rows
weighted by h, reading no other memory. With several rows, their kept sets are united (Deja Vu's
batching). Longer inputs (prefill, teacher-forced evaluation) take the masked path: the dense MLP
with each token's unkept neurons zeroed, which is what the gathered path computes token by token.
A static selector's rows are gathered once, at construction: a smaller dense MLP. On a GPU the
gathers are Triton kernels (`sparsegen.kernels.gather`) that read only the kept rows. On a CPU,
`fused` (set by `contextual.fused.fuse`) replaces the gathers with one kernel over neuron-major
records of the weights, given the keep mask itself: no shape depends on the selection, so a
compiled decode step is one graph (the gathers' `nonzero` breaks it and recompiles it per count)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsegen.contextual.parts import MLPParts, NeuronChoice, mlp_activations
from sparsegen.few_rows import linear


class SparseMLP(nn.Module):
    def __init__(self, parts: MLPParts, selector: NeuronChoice) -> None:
        super().__init__()
        self.parts, self.selector = parts, selector
        self.original: nn.Module | None = None  # the module this one replaced, set by `sparsify`
        self.gate, self.up, self.act = parts.gate, parts.up, parts.act
        self.register_buffer("down_t", parts.down.weight.detach().t().contiguous(), persistent=False)
        # gate and up rows of each neuron side by side: one gather reads both (measured 1.2x faster
        # than two index_selects, and faster than a pre-gathered static MLP, on this CPU)
        paired = parts.up.weight if parts.gate is None else torch.stack([parts.gate.weight, parts.up.weight], 1)
        self.register_buffer("paired", paired.detach().reshape(parts.neurons, -1).contiguous(), persistent=False)
        self.down_bias = parts.down.bias
        self.fused: nn.Module | None = None  # a `contextual.fused.FusedMLP`, set by `fuse`
        self.compact: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None
        kept = getattr(selector, "kept", None)
        if kept is not None:
            gate = parts.gate.weight[kept].contiguous() if parts.gate is not None else None
            self.compact = (gate, parts.up.weight[kept].contiguous(), self.down_t[kept].t().contiguous())

    @property
    def neurons(self) -> int:
        return self.parts.neurons

    def _activated(self, up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return self.act(gate) * up if gate is not None else self.act(up)

    def _down(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden @ self.down_t
        return out + self.down_bias if self.down_bias is not None else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if self.compact is not None and shape[-2] == 1:
            return self._static(rows).reshape(*shape[:-1], -1)
        if shape[-2] == 1 and not self.selector.needs_hidden:
            return self._gathered(rows).reshape(*shape[:-1], -1)
        return self._masked(rows).reshape(*shape[:-1], -1)

    def _masked(self, rows: torch.Tensor) -> torch.Tensor:
        gate_act, hidden = mlp_activations(self.parts, rows)
        keep = self.selector.keep(rows, gate_act, hidden)
        return self._down(hidden * keep)

    def _static(self, rows: torch.Tensor) -> torch.Tensor:
        """A smaller dense MLP (through the compiled decode step's fast batch-1 product)."""
        gate_w, up_w, down_w = self.compact
        gate = linear(rows, gate_w) if gate_w is not None else None
        out = linear(self._activated(linear(rows, up_w), gate), down_w)
        return out + self.down_bias if self.down_bias is not None else out

    def _paired_rows(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """h of the kept neurons [rows, k], reading only their gate and up rows."""
        weights = F.embedding(index, self.paired).view(-1, rows.shape[-1])  # [k * (2 or 1), hidden_size]
        return self._activate_pairs((weights @ rows.t()).t(), index)

    def _activate_pairs(self, out: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """h of the kept neurons from their gate and up outputs side by side [rows, k * (2 or 1)]."""
        if self.gate is None:
            up = out + self.up.bias[index] if self.up.bias is not None else out
            return self.act(up)
        gate, up = out.view(out.shape[0], -1, 2).unbind(-1)
        if self.gate.bias is not None:
            gate = gate + self.gate.bias[index]
        if self.up.bias is not None:
            up = up + self.up.bias[index]
        return self.act(gate) * up

    def _gathered(self, rows: torch.Tensor) -> torch.Tensor:
        gate_act = None
        if self.selector.needs_gate:
            gate_act = self.act(self.gate(rows)) if self.gate is not None else self.act(self.up(rows))
        keep = self.selector.keep(rows, gate_act, None).any(0)
        if self.fused is not None and not rows.is_cuda:  # the mask as it is: no shape depends on it
            return self.fused(rows, keep, gate_act)
        index = keep.nonzero().squeeze(1)
        if index.numel() == self.neurons:
            return self.parts.down(self._activated(self.up(rows), self.gate(rows) if self.gate is not None else None))
        if rows.is_cuda:
            return self._gathered_on_gpu(rows, index, gate_act)
        if gate_act is not None:  # the gate is known: gather only up's rows
            up = _selected_rows(self.up, rows, index)
            hidden = gate_act[:, index] * up if self.gate is not None else gate_act[:, index]
        else:
            hidden = self._paired_rows(rows, index)
        if rows.shape[0] == 1:
            out = F.embedding_bag(index[None], self.down_t, per_sample_weights=hidden[0][None], mode="sum")
        else:
            out = hidden @ self.down_t.index_select(0, index)
        return out + self.down_bias if self.down_bias is not None else out

    def _gathered_on_gpu(self, rows: torch.Tensor, index: torch.Tensor, gate_act: torch.Tensor | None):
        """The gathered path as two Triton kernels: the kept neurons' gate and up rows (or up's
        alone, the gate being known), then their rows of the transposed down projection."""
        from sparsegen.kernels.gather import gathered_product, product_of_rows  # triton: only on a GPU

        if gate_act is not None:
            up = product_of_rows(rows, self.up.weight, index)
            up = up + self.up.bias[index] if self.up.bias is not None else up
            hidden = gate_act[:, index] * up if self.gate is not None else gate_act[:, index]
        else:
            pairs = 1 if self.gate is None else 2
            paired_index = (index[:, None] * pairs + torch.arange(pairs, device=index.device)).flatten()
            out = product_of_rows(rows, self.paired.view(-1, rows.shape[-1]), paired_index)
            hidden = self._activate_pairs(out, index)
        out = gathered_product(hidden, self.down_t, index, compact=True)
        return out + self.down_bias if self.down_bias is not None else out


def _selected_rows(linear: nn.Linear, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    bias = None if linear.bias is None else linear.bias[index]
    return F.linear(rows, linear.weight.index_select(0, index), bias)
