"""What a quantizer is: a rule that maps one Linear layer's weight onto 2^bits levels per group.

Weight-only, per group of `group_size` consecutive inputs of each output row, symmetric (levels
around zero) or asymmetric (a zero point per group). Integers follow compressed-tensors' signed
convention, q in [-2^(bits-1), 2^(bits-1) - 1] and w = (q - zero_point) * scale, so checkpoints
are written and read by that library. Zero is always on the grid, so pruned weights stay zero.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field

import torch

from sparsegen.errors import SparsegenError
from sparsegen.layerwise import InputStats, LinearRewrite
from sparsegen.registry import Registry

QUANTIZERS = Registry("quantization method", "quantizer")
register_quantizer = QUANTIZERS.register


def default_group_size(bits: int) -> int:
    """128 inputs a scale up to 4 bits; one scale a row above, the layout the int8 kernel runs."""
    return 128 if bits <= 4 else 0


@dataclass(frozen=True)
class QuantScheme:
    """Bits, group size and symmetry; scales are stored in `scale_dtype` (fp16, as the papers count)."""

    bits: int = 4
    group_size: int = 128
    symmetric: bool = False
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise SparsegenError(f"bits must be between 2 and 8, got {self.bits}")
        if self.group_size < 0:
            raise SparsegenError(
                f"group size must be a number of inputs, or 0 for one group a row; got {self.group_size}"
            )

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def group_for(self, columns: int) -> int:
        """The group size used for a layer: the largest divisor of `columns` not above `group_size`.

        compressed-tensors needs groups that tile a row; SmolLM2's 576 inputs at 128 become 96.
        Group size 0 is one group a row (per output channel).
        """
        if self.group_size == 0:
            return columns
        return max(g for g in range(1, min(self.group_size, columns) + 1) if columns % g == 0)

    def params(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point of each group, min-max, over the last dimension of `groups`."""
        if self.symmetric:
            scale = groups.abs().amax(-1) / self.qmax
            scale = _representable(scale, self.scale_dtype)
            return scale, torch.zeros_like(scale)
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = _representable((high - low) / (self.qmax - self.qmin), self.scale_dtype)
        zero = (self.qmin - torch.round(low / scale)).clamp(self.qmin, self.qmax)
        return scale, zero

    def integers(self, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return (torch.round(weight / scale) + zero).clamp(self.qmin, self.qmax)

    def fake_quantize(self, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Round `weight` to the grid of `scale`/`zero` (broadcast against it) and map back, rounding
        the product to the scales' dtype as dequantizing kernels (and compressed-tensors) do."""
        return ((self.integers(weight, scale, zero) - zero) * scale).to(self.scale_dtype).float()


def _representable(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round scales up to their storage dtype (so the checkpoint reproduces the weights exactly and
    the group's extremes stay on the grid); an all-zero group gets scale 1."""
    stored = scale.to(dtype)
    stored = torch.where(stored.float() < scale, torch.nextafter(stored, torch.full_like(stored, torch.inf)), stored)
    stored = stored.float()
    return torch.where(stored > 0, stored, torch.ones_like(stored))


@dataclass
class Grid:
    """The integer grid of one layer: scale and zero point [out, groups], and the group size."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    group_size: int


@dataclass
class QuantizedWeight:
    """The dequantized weight [out, in] and the grid that produced it: scale and zero [out, groups]."""

    weight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    group_size: int

    @property
    def grid(self) -> Grid:
        return Grid(self.scale, self.zero_point, self.group_size)


@dataclass
class QuantReport:
    """What was done (stored in checkpoints); `grids` holds each layer's scales for saving (the
    weights themselves are the model's)."""

    method: str
    bits: int
    group_size: int
    symmetric: bool
    n_samples: int
    seqlen: int
    group_sizes: dict[str, int] = field(default_factory=dict)  # per Linear name suffix: the size used
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)  # the quantizer's own (`registry.settings_of`)
    grids: dict[str, Grid] = field(default_factory=dict, repr=False)

    @property
    def scheme(self) -> QuantScheme:
        return QuantScheme(self.bits, self.group_size, self.symmetric)


@dataclass
class Quantizer(LinearRewrite):
    """Base class: set `name`, `needs_calibration`, `needs_hessian`; implement `quantize_weight`."""

    @abstractmethod
    def quantize_weight(self, weight: torch.Tensor, scheme: QuantScheme, stats: InputStats | None) -> QuantizedWeight:
        """Quantize a float32 weight [out, in]; entries that are zero must stay zero."""


def make_quantizer(method: str, **settings) -> Quantizer:
    """A registered quantizer by name with its settings (e.g. GPTQ's `damping`)."""
    return QUANTIZERS.make(method, **settings)
