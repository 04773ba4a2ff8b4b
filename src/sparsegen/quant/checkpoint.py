"""Quantized checkpoints in compressed-tensors' `pack-quantized` layout, written by that library.

Each quantized Linear stores `weight_packed` (int32 words holding 32/bits integers each),
`weight_scale` (fp16, one per group) and, when asymmetric, `weight_zero_point` (packed the same
way); config.json carries compressed-tensors' `quantization_config`, with one config group per
group size in use. `sparsegen.load` reads these folders back with the same library's decoder.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

import torch
from torch import nn

from sparsegen.errors import SparsegenError
from sparsegen.layerwise_blocks import Codec, Tensors
from sparsegen.models import require_float_linears
from sparsegen.quant.quantizer import QuantReport

FORMAT = "pack-quantized"


def _scheme(report: QuantReport, group_size: int, targets: list[str]):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=report.bits,
        type="int",
        symmetric=report.symmetric,
        strategy="group",
        group_size=group_size,
        scale_dtype=report.scheme.scale_dtype,
        observer="minmax",
    )
    return QuantizationScheme(targets=targets, weights=weights)


def _config(report: QuantReport):
    from compressed_tensors.quantization import QuantizationConfig

    by_size: dict[int, list[str]] = {}
    for suffix, size in sorted(report.group_sizes.items()):
        by_size.setdefault(size, []).append(suffix)
    groups = {
        f"group_{i}": _scheme(report, size, [f"re:.*\\.({'|'.join(suffixes)})$"])
        for i, (size, suffixes) in enumerate(sorted(by_size.items()))
    }
    return QuantizationConfig(config_groups=groups, ignore=["lm_head"], quantization_status="frozen", format=FORMAT)


def block_codec(report: QuantReport, prefix: str) -> Codec:
    """How a quantized block is stored, one at a time: each quantized Linear's weight packed by
    compressed-tensors' own compressor from the grid `report` holds for it (the layout
    `save_quantized` writes), and unpacked to its float weight when read back. `prefix` is the
    blocks' list, e.g. `model.layers`."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(FORMAT)

    def encode(index: int, tensors: Tensors) -> Tensors:
        out = dict(tensors)
        for name, weight in tensors.items():
            grid = report.grids.get(f"{prefix}.{index}.{name.removesuffix('.weight')}")
            if grid is None or not name.endswith(".weight"):
                continue
            local = {"weight": weight, "weight_scale": grid.scale.to(report.scheme.scale_dtype)}
            if not report.symmetric:
                local["weight_zero_point"] = grid.zero_point.to(torch.int8)
            del out[name]
            scheme = _scheme(report, grid.group_size, ["Linear"])
            out.update({name.removesuffix("weight") + key: t for key, t in compressor.compress(local, scheme).items()})
        return out

    def decode(index: int, tensors: Tensors) -> Tensors:
        out = _float_tensors(tensors)
        for module in _quantized_modules(tensors):
            local = {key: tensors[f"{module}.{key}"] for key in ("weight_packed", "weight_scale", "weight_shape")}
            if f"{module}.weight_zero_point" in tensors:
                local["weight_zero_point"] = tensors[f"{module}.weight_zero_point"]
            group = int(local["weight_shape"][1]) // local["weight_scale"].shape[1]
            out[f"{module}.weight"] = compressor.decompress(local, _scheme(report, group, ["Linear"]))["weight"]
        return out

    return Codec(encode, decode)


def save_quantized(model: nn.Module, tokenizer, out: str | Path, report: QuantReport) -> Path:
    """Write the quantized model (and tokenizer) to `out` atomically; the model itself is left as is."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config

    require_float_linears(model, "save it as a checkpoint")
    if not report.grids:
        raise SparsegenError("nothing to save: the report holds no quantized layers (run quantize first)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = _config(report)
    packed = copy.deepcopy(model)
    apply_quantization_config(packed, config, show_progress=False)
    modules = dict(packed.named_modules())
    for name, grid in report.grids.items():
        module = modules[name]
        module.weight_scale = nn.Parameter(grid.scale.to(report.scheme.scale_dtype), requires_grad=False)
        if not report.symmetric:
            module.weight_zero_point.data.copy_(grid.zero_point.to(module.weight_zero_point.dtype))
    _record(packed.config, report)
    compressor = ModelCompressor(quantization_config=config, force_compression_format=FORMAT)
    compressor.compress_model(packed)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        folder = Path(tmp) / "model"
        packed.save_pretrained(folder)
        compressor.update_config(str(folder))
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        if out.exists():
            shutil.rmtree(out)
        os.replace(folder, out)
    return out


def _record(config, report: QuantReport) -> None:
    """Put the run's settings in the model config (a pruned model's zeros are now packed, dense)."""
    config.sparsegen_quantization = {f.name: getattr(report, f.name) for f in fields(report) if f.name != "grids"}
    if isinstance(getattr(config, "sparsity_config", None), dict):
        config.sparsity_config = {**config.sparsity_config, "format": "dense"}


def finish_quantized(blocks, report: QuantReport) -> Path:
    """Complete a checkpoint whose blocks `scale.disk.DiskBlocks` wrote one at a time (`block_codec`)."""
    from compressed_tensors.compressors import ModelCompressor

    _record(blocks.model.config, report)
    compressor = ModelCompressor(quantization_config=_config(report), force_compression_format=FORMAT)
    return blocks.finish(lambda folder: compressor.update_config(str(folder)))


def quantization_config(folder: str | Path) -> dict | None:
    """The compressed-tensors quantization config of a checkpoint folder, or None."""
    config = Path(folder) / "config.json"
    if not config.exists():
        return None
    found = json.loads(config.read_text()).get("quantization_config")
    return found if found and found.get("quant_method") == "compressed-tensors" else None


def _parse(config: dict):
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(config)
    if parsed.format != FORMAT:
        raise SparsegenError(f"quantized checkpoints in format {parsed.format!r} are not supported; use {FORMAT!r}")
    return parsed


def _quantized_modules(state: dict[str, torch.Tensor]) -> list[str]:
    return [name[: -len(".weight_packed")] for name in state if name.endswith(".weight_packed")]


def _float_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in state.items() if not name.rsplit(".", 1)[-1].startswith("weight_")}


def dequantize_state(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Replace each packed Linear's tensors in `state` by its float weight, using compressed-tensors."""
    from compressed_tensors.compressors import BaseCompressor

    parsed = _parse(config)
    compressor = BaseCompressor.get_value_from_registry(FORMAT)
    out = _float_tensors(state)
    for module in _quantized_modules(state):
        scheme = _scheme_for(module, parsed)
        local = {key: state[f"{module}.{key}"] for key in ("weight_packed", "weight_scale", "weight_shape")}
        if f"{module}.weight_zero_point" in state:
            local["weight_zero_point"] = state[f"{module}.weight_zero_point"]
        out[f"{module}.weight"] = compressor.decompress(local, scheme)["weight"]
    return out


def packed_state(
    state: dict[str, torch.Tensor],
    config: dict,
    dtype: torch.dtype,
    device: torch.device,
    activation_bits: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, nn.Module], dict[str, str]]:
    """Split a checkpoint's tensors into float tensors and packed layers (`quant.packed`) built from
    its integers as they are stored, for the kernels of `device` (integer-dot products where
    `activation_bits=8`, said once where a layer keeps weight-only ones); a layer no kernel takes
    gets its float weight instead, with why."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from sparsegen.kernels import Unpacked
    from sparsegen.quant.packed import dequantized, pack_linear

    parsed = _parse(config)
    floats, layers, unpacked, verdicts = _float_tensors(state), {}, {}, {}
    for module in _quantized_modules(state):
        bits = _scheme_for(module, parsed).weights.num_bits
        shape = torch.Size(state[f"{module}.weight_shape"].tolist())
        integers = unpack_from_int32(state[f"{module}.weight_packed"], bits, shape)
        scale = state[f"{module}.weight_scale"]
        zero_point = torch.zeros_like(scale, dtype=torch.int8)
        if f"{module}.weight_zero_point" in state:
            zp_shape = (shape[0], scale.shape[-1])
            zero_point = unpack_from_int32(state[f"{module}.weight_zero_point"], bits, zp_shape, packed_dim=0)
        bias = floats.get(f"{module}.bias")
        grid = (t.to(device) for t in (integers, scale, zero_point))
        bias = None if bias is None else bias.to(device, dtype)
        layer = pack_linear(*grid, bits, bias, verdicts, activation_bits)
        if isinstance(layer, Unpacked):
            floats[f"{module}.weight"] = dequantized(integers, scale, zero_point)
            unpacked[module] = layer.reason
        else:
            floats.pop(f"{module}.bias", None)
            layers[module] = layer
    if verdicts.get("integer-dot"):
        print(f"sparsegen: some layers keep weight-only products ({verdicts['integer-dot'].reason})", file=sys.stderr)
    return floats, layers, unpacked


def _scheme_for(module: str, config):
    for scheme in config.config_groups.values():
        for target in scheme.targets:
            if target.startswith("re:") and re.match(target[3:], module) or module.endswith(target):
                return scheme
    raise SparsegenError(f"quantized layer {module} matches no config group of the checkpoint's quantization_config")
