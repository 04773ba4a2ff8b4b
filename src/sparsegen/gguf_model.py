"""Load a GGUF file as a transformers model whose quantized Linear layers keep the file's blocks.

The file is memory-mapped copy-on-write (its header read here, its blocks decoded by `gguf`): a
Linear whose tensor is in one of the block formats the GGUF kernels read (`gguf_blocks.KERNEL_TYPES`)
becomes a `GGUFLinear` over the file's own bytes for that tensor, still mapped (the pages are the
file's, read on first use and shared with the page cache; nothing is copied, except the llama query
and key rows that llama.cpp stores permuted, put back in transformers' order, and Q4_0/Q4_1/Q4_K
tensors repacked into panels of eight rows, whose mapped pages are then released). Every other
tensor (norms, biases, F32/F16 tensors, block formats without a kernel) is dequantized to the
model's float dtype. An attention's q, k and v projections of one block format then run as one
product (`gguf_attention.join_projections`).

The token embedding in a kernel format becomes a `GGUFEmbedding` over its blocks (a lookup decodes
the rows it reads; a scaled embedding, as Gemma's, is dequantized). The output head: a file's own
`output.weight` in a kernel format becomes a GGUFLinear; a head tied to the token embedding (no
`output.weight`) becomes a GGUFLinear over the embedding's blocks (the config then says the two are
no longer tied).

The config and tokenizer are transformers' reading of the file's metadata (names mapped as its own
GGUF loader maps them), saved once in the cache folder keyed by the file's path, size and time, so
that a reload skips converting the vocabulary again.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import struct
import sys
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map
from gguf.quants import dequantize, quant_shape_to_byte_shape
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor, TensorProcessor

from sparsegen.assemble import assemble
from sparsegen.assets import console, ensure_asset
from sparsegen.errors import SparsegenError
from sparsegen.gguf_attention import join_projections
from sparsegen.quant.gguf_blocks import KERNEL_TYPES, GGUFEmbedding, GGUFLinear

SUFFIX = ".gguf"
BLOCK_SAFE = (TensorProcessor, LlamaTensorProcessor)
"""Processors whose change to a weight is at most a permutation of its rows, which moves whole rows
of blocks: a file of another architecture (whose processor transposes or splits) is dequantized."""
_READ_ERRORS = (ValueError, OSError, IndexError, KeyError, UnicodeDecodeError, OverflowError, struct.error)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_LIBC = ctypes.CDLL(None, use_errno=True)  # madvise, to release mapped pages a repacked tensor left
_VALUES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # F32/F16 values, else uint8 [rows..., row bytes]: a view of the mapped file


class GGUFFile(NamedTuple):
    """A GGUF file's metadata (arrays as their lengths) and tensors, memory-mapped copy-on-write.

    Read here rather than with `gguf.GGUFReader`, which parses every element of the vocabulary
    and merge arrays in Python (23 s per load for a 151k-token vocabulary, against 0.1 s)."""

    path: Path
    metadata: dict
    tensors: list[GGUFTensor]

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix; the loader checks the contents)."""
    path = Path(path).expanduser()
    return path.suffix.lower() == SUFFIX and path.is_file()


def _string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    if pos + 8 + length > blob.size:
        raise ValueError("a string runs past the end of the file")
    return bytes(blob[pos + 8 : pos + 8 + length]).decode("utf-8"), pos + 8 + length


def _value(blob: np.ndarray, pos: int, kind: int):
    """One metadata value (an array as its length) and the position after it."""
    if kind in _SCALARS:
        return struct.unpack_from("<" + _SCALARS[kind], blob, pos)[0], pos + struct.calcsize(_SCALARS[kind])
    if kind == _STRING:
        return _string(blob, pos)
    if kind != _ARRAY:
        raise ValueError(f"unknown metadata value type {kind}")
    element, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if element in _SCALARS:
        return count, pos + count * struct.calcsize(_SCALARS[element])
    if element == _STRING:  # a vocabulary or merge table: walked, not kept
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
        return count, pos
    for _ in range(count):  # nested arrays
        _, pos = _value(blob, pos, element)
    return count, pos


def _tensor(blob: np.ndarray, name: str, dims: tuple[int, ...], kind: int, start: int) -> GGUFTensor:
    qtype = GGMLQuantizationType(kind)
    shape = tuple(reversed(dims))  # ggml lists the fastest dimension first
    if qtype in _VALUES:
        dtype, byte_shape = np.dtype(_VALUES[qtype]), shape
        size = int(np.prod(shape)) * dtype.itemsize
    else:
        dtype, byte_shape = np.dtype(np.uint8), quant_shape_to_byte_shape(shape, qtype)
        size = int(np.prod(byte_shape))
    if start + size > blob.size:
        raise SparsegenError(f"truncated: tensor {name} ends at byte {start + size}, the file has {blob.size}")
    return GGUFTensor(name, qtype, blob[start : start + size].view(dtype).reshape(byte_shape))


def _parse(path: Path) -> GGUFFile:
    blob = np.memmap(path, mode="c")
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError("it does not start with the bytes 'GGUF'")
    version, tensor_count, metadata_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; versions 2 and 3 are read")
    metadata, pos = {}, 24
    for _ in range(metadata_count):
        key, pos = _string(blob, pos)
        metadata[key], pos = _value(blob, pos + 4, struct.unpack_from("<I", blob, pos)[0])
    table = []
    for _ in range(tensor_count):
        name, pos = _string(blob, pos)
        (dim_count,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{dim_count}Q", blob, pos + 4)
        kind, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dim_count)
        table.append((name, dims, kind, offset))
        pos += 4 + 8 * dim_count + 12
    alignment = metadata.get("general.alignment", 32)
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = [_tensor(blob, name, dims, kind, data_start + offset) for name, dims, kind, offset in table]
    if "general.architecture" not in metadata or not tensors:
        raise ValueError("no general.architecture or no tensors: not a model GGUF")
    return GGUFFile(path, metadata, tensors)


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and memory-mapped tensors, or one line saying why it cannot be read."""
    path = Path(path).expanduser()
    try:
        return _parse(path)
    except SparsegenError as exc:
        raise SparsegenError(f"{path} is {exc}. Download or copy it again.") from None
    except _READ_ERRORS as exc:
        raise SparsegenError(
            f"{path} is not a readable GGUF file ({exc or type(exc).__name__}): it is truncated or not GGUF. "
            "Download or copy it again, or pass a transformers model folder."
        ) from None


def metadata_folder(path: str | Path) -> Path:
    """A folder in the cache with the file's config.json and tokenizer, as transformers reads them
    from the GGUF metadata (once per file: converting a large vocabulary takes seconds)."""
    path = Path(path).expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return ensure_asset(f"gguf/{path.stem}-{key}", lambda out: _save_metadata(path, out))


def _save_metadata(path: Path, out: Path) -> None:
    console.print(f"Reading the config and tokenizer of {path.name} (once)")
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SparsegenError(
            f"{path.name}: transformers cannot read this GGUF's config or tokenizer ({reason}); "
            "use a GGUF of a supported architecture (llama, mistral, qwen2, ...) or a transformers folder"
        ) from None
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def gguf_config(path: str | Path) -> PretrainedConfig:
    """The transformers config of the GGUF file's model."""
    return AutoConfig.from_pretrained(metadata_folder(path))


def _names(model: PreTrainedModel, file: GGUFFile, config: PretrainedConfig) -> tuple[dict, TensorProcessor]:
    """{GGUF tensor name: transformers parameter name}, and the architecture's tensor processor
    (llama.cpp's layout undone: the llama query/key rows un-permuted), as transformers' GGUF loader
    maps them (`get_gguf_hf_weights_map`, which builds gguf's name table once per submodule: 13 s
    for 28 layers; built once here, a name tried whole, then without its leading parts)."""
    processor = TENSOR_PROCESSORS.get(file.architecture, TensorProcessor)(config=config.to_dict())
    arch = next((arch for arch, name in MODEL_ARCH_NAMES.items() if name == file.architecture), None)
    if arch is None:
        raise SparsegenError(f"{file.path.name}: gguf-py knows no tensor names for architecture {file.architecture!r}")
    table = get_tensor_name_map(arch, config.num_hidden_layers)
    names = {}
    for parameter in model.state_dict():
        name = processor.preprocess_name(parameter)
        stem, leaf = name.rsplit(".", 1) if name.endswith((".weight", ".bias")) else (name, "")
        parts = stem.split(".")
        found = next(filter(None, (table.get_name(".".join(parts[i:])) for i in range(len(parts)))), None)
        if found:
            names[found + (f".{leaf}" if leaf else "")] = parameter
    return names, processor


def _head_name(model: PreTrainedModel) -> str | None:
    head = model.get_output_embeddings()
    return next((name for name, module in model.named_modules() if module is head), None)


def _plan_blocks(file: GGUFFile, names: dict[str, str], model: PreTrainedModel, blocks: bool) -> dict[str, list[str]]:
    """{GGUF tensor name: the modules that keep it as blocks}: Linear layers, and the token
    embedding where it is a plain `nn.Embedding` (a lookup decodes its rows), also for the head
    where the head is tied to it (no `output.weight` in the file)."""
    if not blocks:
        return {}
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    plan = {}
    for tensor in file.tensors:
        parameter = names.get(tensor.name, "")
        owner, _, leaf = parameter.rpartition(".")
        if tensor.tensor_type in KERNEL_TYPES and leaf == "weight" and owner in linears:
            plan[tensor.name] = [owner]
    types = {t.name: t.tensor_type for t in file.tensors}
    if types.get("token_embd.weight") not in KERNEL_TYPES:
        return plan
    embedding = next(name for name, module in model.named_modules() if module is model.get_input_embeddings())
    users = [embedding] if type(model.get_input_embeddings()) is nn.Embedding else []  # a scaled one: floats
    head = _head_name(model)
    if "output.weight" not in types and head in linears:
        users.append(head)
    if users:
        plan["token_embd.weight"] = users
    return plan


def _as_float(weights: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(weights))


def read_tensors(
    file: GGUFFile, model: PreTrainedModel, config: PretrainedConfig, blocks: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[np.ndarray, GGMLQuantizationType]], Counter, Counter]:
    """The file's tensors under transformers' names: `(floats, kept, kept_types, dequantized_types)`,
    `kept` being {Linear module name: (blocks [out, row bytes], type)} (with `blocks`)."""
    names, processor = _names(model, file, config)
    plan = _plan_blocks(file, names, model, blocks and type(processor) in BLOCK_SAFE)
    state, kept, kept_types, dequantized = {}, {}, Counter(), Counter()
    parsed = {"tensors": state}  # where processors that split tensors (MoE experts) write them
    for tensor in file.tensors:
        qtype = GGMLQuantizationType(tensor.tensor_type)
        if tensor.name in plan:
            rows = processor.process(weights=tensor.data, name=tensor.name).weights
            kept.update({module: (rows, qtype) for module in plan[tensor.name]})
            kept_types[qtype.name] += 1
            if names.get(tensor.name, "").rpartition(".")[0] in plan[tensor.name]:
                continue  # else the tied head's blocks, the embedding's floats below
        weights = dequantize(tensor.data, qtype)
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed
        )
        if result.name in names:
            state[names[result.name]] = _as_float(result.weights)
            dequantized[qtype.name] += 1
    return state, kept, kept_types, dequantized


def _block_layers(
    kept: dict[str, tuple[np.ndarray, GGMLQuantizationType]], model: PreTrainedModel, state: dict, dtype: torch.dtype
) -> dict[str, GGUFLinear | GGUFEmbedding]:
    """A GGUFLinear (a GGUFEmbedding for the token embedding) for each kept tensor, its bias (an F32
    tensor of its own in the file) taken from `state`."""
    layers = {}
    for name, (rows, qtype) in kept.items():
        linear = model.get_submodule(name)
        bias = state.pop(f"{name}.bias", None)
        blocks = torch.from_numpy(rows)
        lookup = isinstance(linear, nn.Embedding)
        expected = linear.num_embeddings if lookup else linear.out_features
        if blocks.shape[0] != expected:
            raise SparsegenError(f"{name}: the GGUF tensor has {blocks.shape[0]} rows, the config says {expected}")
        if lookup:
            layers[name] = GGUFEmbedding(blocks, qtype, linear.embedding_dim, dtype)
        else:
            layers[name] = GGUFLinear(blocks, qtype, linear.in_features, None if bias is None else bias.to(dtype))
            if layers[name].paneled:
                _release_mapped_pages(rows)
    return layers


def _release_mapped_pages(rows: np.ndarray) -> None:
    """Drop this process's pages of a file-mapped tensor that a layer holds a repacked copy of: they
    were read once to repack it and are never read again, yet counted in the process's RSS (the
    1.5B model's Q4_K tensors, 580 MB). The file's bytes are untouched (a read would map them back);
    anonymous memory is never released, and pages shared with a neighbouring tensor are kept."""
    if not isinstance(rows, np.memmap):
        return
    page, address = mmap.PAGESIZE, rows.ctypes.data
    first, last = -(-address // page) * page, (address + rows.nbytes) // page * page
    if last > first:
        _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)


def _say(path: Path, kept: Counter, dequantized: Counter, dtype: torch.dtype, why: str) -> None:
    """One line on stderr: how many tensors stay blocks (of which types), how many became floats."""
    short = str(dtype).removeprefix("torch.")
    if kept:
        head = f"kept {sum(kept.values())} tensors in their GGUF blocks ({', '.join(sorted(kept))}); "
    else:
        head = f"no GGUF blocks kept{why}; "
    rest = f"{sum(dequantized.values())} dequantized to {short} ({', '.join(sorted(dequantized))})"
    print(f"{path.name}: {head}{rest}", file=sys.stderr)


def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    blocks: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`(model, tokenizer)` of a GGUF file, in eval mode on the CPU: its Linear layers in a kernel
    block format as `GGUFLinear` over the file's bytes (`blocks`), everything else in `dtype`;
    `blocks=False` dequantizes every tensor to `dtype` (the float model pruning and training need)."""
    from transformers import AutoModelForCausalLM

    path = Path(path).expanduser()
    file = open_gguf(path)
    folder = metadata_folder(path)
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    state, kept, kept_types, dequantized = read_tensors(file, skeleton, config, blocks)
    layers = _block_layers(kept, skeleton, state, dtype)
    if _head_name(skeleton) in layers and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False  # the head is its own layer over the embedding's blocks
    model = assemble(str(path), config, state, layers, dtype, attn_implementation)
    join_projections(model)
    why = " (packed=False)" if not blocks else f" ({file.architecture}: no Linear weight in a block format kept as is)"
    _say(path, kept_types, dequantized, dtype, why)
    return model.eval(), AutoTokenizer.from_pretrained(folder)
