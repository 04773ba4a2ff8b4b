"""Where a decoder block's weights are while `layerwise` runs it: in the model (the default), moved
to the device it runs on (`OnDevice`), or read from a checkpoint's shards and written back out
(`scale.disk`), so that only one block's weights are ever held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Codec:
    """How a rewritten block's tensors (names local to the block) are stored, and read back."""

    encode: Callable[[int, Tensors], Tensors]
    decode: Callable[[int, Tensors], Tensors]


class Blocks:
    """Where block weights live while the blocks run: in the model, always (the default). A
    subclass may fill a block before it runs and take its weights away after (`scale.disk`), or
    move it to the device it runs on (`OnDevice`)."""

    writes = False  # whether rewritten blocks are written out as they finish (then `finish` the output)
    device: torch.device | None = None  # where blocks run, when not where the model is

    @contextlib.contextmanager
    def held(self, index: int, block: nn.Module, codec: Codec | None = None) -> Iterator[bool]:
        """Hold `block`'s weights while the body runs; yields whether it was rewritten by an
        earlier, interrupted run (then it is only run, not rewritten)."""
        yield False


IN_MEMORY = Blocks()


class OnDevice(Blocks):
    """Blocks kept where the model is (CPU RAM) and run on `device` one at a time, as SparseGPT's
    reference does: a model larger than the GPU's memory is calibrated and rewritten on the GPU."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)

    @contextlib.contextmanager
    def held(self, index: int, block: nn.Module, codec: Codec | None = None) -> Iterator[bool]:
        home = next(block.parameters()).device
        block.to(self.device)
        try:
            yield False
        finally:
            block.to(home)
