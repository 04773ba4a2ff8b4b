"""sparsegen's own kernels, in one package: the C++ sources (each one torch extension, built on
first use by `build`), their loaders, and the Triton kernels of contextual sparsity (`gather`).

Each loader returns its source's built module (its ops registered with torch's dispatcher as
`torch.ops.sparsegen.*`), or None where it cannot be built (said once on stderr; the caller keeps
its torch path); a packer that finds no kernel for a layer returns `Unpacked(reason)` instead of
the layer. This package imports nothing of sparsegen's but the cache folder: `kv/`, `quant/`,
`decode/` and `few_rows.py` import it. `python -m sparsegen.kernels` builds every source now.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsegen.kernels import build as builder

SOURCES = builder.SOURCES
KV_INT = SOURCES / "kv_int.cpp"
INT_DOT = SOURCES / "int_dot.cpp"
GGUF_DOT = SOURCES / "gguf_dot.cpp"
FLOAT_ROWS = SOURCES / "float_rows.cpp"
SPARSE_MLP = SOURCES / "sparse_mlp.cpp"
LAYER_OPS = SOURCES / "layer_ops.cpp"


@dataclass(frozen=True)
class Unpacked:
    """Why no kernel takes a layer, which then keeps its float form: what a packer
    (`quant.packed.pack_linear`, `prune.accelerate.sparse_form`, ...) returns in place of the layer."""

    reason: str

    def __str__(self) -> str:
        return self.reason


def load_kv_int():
    """The KV products over byte rows and slots (`kv.kernels`), or None."""
    return builder.build(KV_INT, "the KV kernels")


def load_int_dot():
    """The integer-dot products of int4 and int8 weights (`quant.int_dot`), or None."""
    return builder.build(INT_DOT, "the integer-dot kernels")


def load_gguf_dot():
    """The integer-dot products over a GGUF tensor's own blocks (`quant.gguf_blocks`), or None."""
    return builder.build(GGUF_DOT, "the GGUF block kernels")


def load_float_rows():
    """The few-row fp32 product over packed weights (`few_rows`), or None."""
    return builder.build(FLOAT_ROWS, "the few-row fp32 kernel")


def load_sparse_mlp():
    """The fused sparse MLP over kept neurons' records (`contextual.fused`), or None."""
    return builder.build(SPARSE_MLP, "the fused sparse MLP kernel")


def load_layer_ops():
    """A decoder layer's RMSNorm and SiLU-times-up in one pass each (`fused_layers`), or None."""
    return builder.build(LAYER_OPS, "the fused layer ops")
