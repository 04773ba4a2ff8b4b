"""The base of every Linear whose weights stay integer: `quant.packed`'s weight-only layers and
`quant.int_dot`'s integer-dot layers (which `quant.packed.pack_linear` chooses between, so the base
lives below both)."""

from __future__ import annotations

import torch
from torch import nn

KERNEL_DTYPE = torch.bfloat16
"""The activations PyTorch's weight-only kernels take (`quant.packed`)."""


class PackedLinear(nn.Module):
    """A Linear computed from packed integer weights: the input is cast to bf16 for the kernel."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        out = self.product(flat).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
