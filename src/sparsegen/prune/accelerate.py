"""Sparse kernels where they are measured faster, dense everywhere else.

On CPU, a CSR matrix (int32 indices) only beats a dense GEMV at high sparsity (about 90%);
unstructured 50% is slower. On a GPU, a 2:4 weight can be PyTorch's semi-structured sparse tensor
(`SemiStructuredLinear`: cuSPARSELt/CUTLASS, fp16 or bf16, compute capability 8.0 and up).
`accelerate` times every pruned Linear both ways on batch-1 inputs, sweeping all layers between
repeats so weights come from memory as in real decoding, and swaps in the sparse form only where it
wins; where none can be built, it says why. The result is for inference; save checkpoints before
accelerating.
"""

from __future__ import annotations

import sys
import time
import warnings

import torch
from torch import nn

from sparsegen.kernels import Unpacked
from sparsegen.layerwise import block_linears
from sparsegen.models import decoder_layers


def to_csr(weight: torch.Tensor, index_dtype: torch.dtype = torch.int32) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "CSR support is in beta"
        csr = weight.detach().to_sparse_csr()
        return torch.sparse_csr_tensor(
            csr.crow_indices().to(index_dtype), csr.col_indices().to(index_dtype), csr.values(), csr.shape
        )


class CSRLinear(nn.Module):
    """A Linear layer whose weight is a CSR tensor."""

    def __init__(self, linear: nn.Linear, index_dtype: torch.dtype = torch.int32) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_csr = to_csr(linear.weight, index_dtype)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.sparse.mm(self.weight_csr, flat.t()).t().reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class SemiStructuredLinear(nn.Module):
    """A Linear whose 2:4 weight is PyTorch's semi-structured sparse tensor (half the values and
    their positions: about 56% of the dense bytes a step reads)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from torch.sparse import to_sparse_semi_structured

        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(to_sparse_semi_structured(linear.weight.detach()), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.nn.functional.linear(flat, self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def is_two_four(weight: torch.Tensor) -> bool:
    """Whether every group of 4 consecutive inputs of every row holds at most 2 non-zeros."""
    return weight.shape[1] % 4 == 0 and bool(((weight != 0).view(-1, 4).sum(-1) <= 2).all())


def sparse_form(linear: nn.Linear) -> nn.Module | Unpacked:
    """The sparse module for a pruned Linear on its device, or why none can be built: on a GPU
    the semi-structured form of a 2:4 weight, else a CSR matrix."""
    if linear.weight.is_cuda and is_two_four(linear.weight):
        try:
            return SemiStructuredLinear(linear)
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            return Unpacked(f"2:4 as semi-structured: {str(exc).splitlines()[0][:120]}")
    return CSRLinear(linear)


def _sweep_times(modules: list[nn.Module], inputs: list[torch.Tensor], repeats: int) -> list[float]:
    times = [0.0] * len(modules)
    settle = torch.cuda.synchronize if inputs and inputs[0].is_cuda else (lambda: None)
    with torch.inference_mode():
        for _ in range(repeats):
            for i, (module, x) in enumerate(zip(modules, inputs, strict=True)):
                settle()
                start = time.perf_counter()
                module(x)
                settle()
                times[i] += time.perf_counter() - start
    return times


def accelerate(model: nn.Module, min_speedup: float = 1.1, repeats: int = 20) -> dict[str, float]:
    """Swap pruned decoder Linears for their sparse form (`sparse_form`) where measured at least
    `min_speedup` faster; layers for which none can be built stay dense, said once on stderr.

    Returns {layer name: measured dense/CSR time ratio} for every pruned layer considered.
    """
    found = []
    for i, block in enumerate(decoder_layers(model)):
        for name, linear in block_linears(block).items():
            if (linear.weight == 0).any():
                found.append((f"{i}.{name}", block, name, linear))
    forms = [sparse_form(linear) for *_, linear in found]
    reasons = {label: form.reason for (label, *_), form in zip(found, forms, strict=True) if isinstance(form, Unpacked)}
    if reasons:
        first = next(iter(reasons))
        print(f"{len(reasons)} pruned layer(s) stay dense ({first}, ...): {reasons[first]}", file=sys.stderr)
    kept = [(entry, form) for entry, form in zip(found, forms, strict=True) if not isinstance(form, Unpacked)]
    if not kept:
        return {}
    found, sparse_modules = [entry for entry, _ in kept], [form for _, form in kept]
    inputs = [
        torch.randn(1, linear.in_features, dtype=linear.weight.dtype, device=linear.weight.device)
        for *_, linear in found
    ]
    dense = _sweep_times([linear for *_, linear in found], inputs, repeats)
    sparse = _sweep_times(sparse_modules, inputs, repeats)
    ratios = {}
    for (label, block, name, _), module, t_dense, t_sparse in zip(found, sparse_modules, dense, sparse, strict=True):
        ratios[label] = t_dense / t_sparse
        if ratios[label] >= min_speedup:
            parent = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
            setattr(parent, name.rsplit(".", 1)[-1], module)
    return ratios
