"""Sparse kernels where they are measured faster, dense everywhere else.

On CPU, a CSR matrix (int32 indices) only beats a dense GEMV at high sparsity (about 90%);
unstructured 50% is slower. `accelerate` times every pruned Linear both ways on batch-1 inputs,
sweeping all layers between repeats so weights come from memory as in real decoding, and swaps in
`CSRLinear` only where it wins. The result is for inference; save checkpoints before accelerating.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch import nn

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


def _sweep_times(modules: list[nn.Module], inputs: list[torch.Tensor], repeats: int) -> list[float]:
    times = [0.0] * len(modules)
    with torch.inference_mode():
        for _ in range(repeats):
            for i, (module, x) in enumerate(zip(modules, inputs, strict=True)):
                start = time.perf_counter()
                module(x)
                times[i] += time.perf_counter() - start
    return times


def accelerate(model: nn.Module, min_speedup: float = 1.1, repeats: int = 20) -> dict[str, float]:
    """Swap pruned decoder Linears for CSRLinear where measured at least `min_speedup` faster.

    Returns {layer name: measured dense/CSR time ratio} for every pruned layer considered.
    """
    found = []
    for i, block in enumerate(decoder_layers(model)):
        for name, linear in block_linears(block).items():
            if (linear.weight == 0).any():
                found.append((f"{i}.{name}", block, name, linear))
    if not found:
        return {}
    inputs = [
        torch.randn(1, linear.in_features, dtype=linear.weight.dtype, device=linear.weight.device)
        for *_, linear in found
    ]
    dense = _sweep_times([linear for *_, linear in found], inputs, repeats)
    sparse_modules = [CSRLinear(linear) for *_, linear in found]
    sparse = _sweep_times(sparse_modules, inputs, repeats)
    ratios = {}
    for (label, block, name, _), module, t_dense, t_sparse in zip(found, sparse_modules, dense, sparse, strict=True):
        ratios[label] = t_dense / t_sparse
        if ratios[label] >= min_speedup:
            parent = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
            setattr(parent, name.rsplit(".", 1)[-1], module)
    return ratios
