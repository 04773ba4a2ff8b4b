"""Past one machine's memory: models read and written one decoder block at a time from disk."""

from sparsegen.scale.disk import Checkpoint, DiskBlocks, fits_on_gpu, open_lazy, too_large_for_ram

__all__ = ["Checkpoint", "DiskBlocks", "fits_on_gpu", "open_lazy", "too_large_for_ram"]
