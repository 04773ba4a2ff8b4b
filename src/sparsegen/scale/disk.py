"""Models larger than RAM: a checkpoint read one decoder block at a time, and written the same way.

`open_lazy` builds the model on the meta device with everything but its decoder blocks read (the
embeddings, the final norm, the head); `DiskBlocks` reads a block's tensors from the safetensors
shards just before the block runs and takes them away after, so calibration (`prune`,
`quantize`) and evaluation (`windowed_ppl`) hold one block's weights at a time. Given an output
folder, each rewritten block is written to its own shard as soon as it is done; a killed run,
started again with the same settings, continues at the first block not yet written.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from sparsegen.assemble import assemble
from sparsegen.distributed import is_writer
from sparsegen.errors import SparsegenError
from sparsegen.gguf_model import is_gguf
from sparsegen.ioutil import save_safetensors, write_json
from sparsegen.layerwise_blocks import Blocks, Codec
from sparsegen.loading import resolve_model_path
from sparsegen.models import decoder_layers

INDEX = "model.safetensors.index.json"
JOB = "job.json"
RAM_SHARE = 0.5  # `auto` streams from disk when the weights pass this share of available memory
GPU_SHARE = 0.7  # rewriting keeps the model on the GPU below this share of its free memory (the rest: calibration)


class Checkpoint:
    """A folder of safetensors shards, read tensor by tensor (each file opened for one read)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        files = sorted(self.folder.glob("model*.safetensors"))
        if not files:
            raise SparsegenError(f"{self.folder} has no model*.safetensors shards; save the model with save_pretrained")
        from sparsegen.prune.checkpoint import is_compressed
        from sparsegen.quant.checkpoint import quantization_config

        if is_compressed(self.folder):
            raise SparsegenError(
                f"{self.folder} stores bitmask-compressed weights, which are read whole; "
                "prune it again without --compressed to stream it from disk"
            )
        self.quantization = quantization_config(self.folder)
        self.files: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), "pt") as handle:
                self.files.update(dict.fromkeys(handle.keys(), file))

    @property
    def weight_bytes(self) -> int:
        return sum(file.stat().st_size for file in set(self.files.values()))

    def read(self, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The named tensors, floats cast to `dtype`; quantized Linears come back as float weights."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        out = {}
        for file, group in by_file.items():
            with safe_open(str(file), "pt") as handle:
                out.update({name: handle.get_tensor(name) for name in group})
        if self.quantization is not None:
            from sparsegen.quant.checkpoint import dequantize_state

            out = dequantize_state(out, self.quantization)
        return {name: t.to(dtype) if t.is_floating_point() else t for name, t in out.items()}

    def names_under(self, prefix: str) -> list[str]:
        return [name for name in self.files if name.startswith(prefix)]


def blocks_prefix(model: nn.Module) -> str:
    """The dotted name of the decoder blocks' list, e.g. `model.layers`."""
    layers = decoder_layers(model)
    return next(name for name, module in model.named_modules() if module is layers)


def open_lazy(
    name_or_path: str, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Checkpoint]:
    """The model of a checkpoint folder with its decoder blocks left on the meta device (to be read
    by `DiskBlocks`), its tokenizer, and the checkpoint."""
    source = resolve_model_path(name_or_path)
    if is_gguf(source):
        raise SparsegenError(
            f"{Path(source).name}: a GGUF file is read whole, not one block at a time; "
            "load it in memory (--in-memory), or save it as a transformers folder first"
        )
    checkpoint = Checkpoint(source)
    config = AutoConfig.from_pretrained(source)
    if checkpoint.quantization is not None:
        del config.quantization_config
    with torch.device("meta"):
        skeleton = _skeleton_prefix(config)
    rest = [name for name in checkpoint.files if not name.startswith(skeleton)]
    state = checkpoint.read(rest, dtype)
    model = assemble(source, config, state, {}, dtype, attn_implementation, away=skeleton)
    return model.eval(), AutoTokenizer.from_pretrained(source), checkpoint


def _skeleton_prefix(config) -> str:
    from transformers import AutoModelForCausalLM

    return blocks_prefix(AutoModelForCausalLM.from_config(config)) + "."


def _weight_bytes(name_or_path: str) -> int:
    """A checkpoint's weight files' bytes (a GGUF file's own size: what its blocks take)."""
    source = resolve_model_path(name_or_path)
    return Path(source).stat().st_size if is_gguf(source) else Checkpoint(source).weight_bytes


def too_large_for_ram(name_or_path: str) -> bool:
    """Whether a checkpoint's weights pass `RAM_SHARE` of the memory available now."""
    available = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemAvailable:")
    )
    return _weight_bytes(name_or_path) > RAM_SHARE * available


def fits_on_gpu(name_or_path: str, device: torch.device) -> bool:
    """Whether a checkpoint's weights stay under `GPU_SHARE` of the GPU's free memory."""
    free, _ = torch.cuda.mem_get_info(device)
    return _weight_bytes(name_or_path) < GPU_SHARE * free


def _take_away(block: nn.Module) -> None:
    """Free a block's weights: each parameter becomes a meta tensor of its shape."""
    for module in block.modules():
        for key, param in module._parameters.items():
            if param is not None:
                module._parameters[key] = nn.Parameter(param.to("meta"), requires_grad=False)


class DiskBlocks(Blocks):
    """Block weights read from `source` before each block runs and freed after; with `out`, each
    rewritten block is written to the output's shard (`finish` completes the folder).

    `job` (the settings of the run) is kept with a partial output: a rerun with the same settings
    resumes at the first unwritten block, one with other settings is refused.
    """

    def __init__(
        self, model: PreTrainedModel, source: Checkpoint, out: str | Path | None = None, job: dict | None = None
    ):
        self.model, self.source = model, source
        self.prefix = blocks_prefix(model)
        self.count = len(decoder_layers(model))
        self.out = None if out is None else Path(out)
        self.writes = self.out is not None and is_writer()  # under torchrun, rank 0 writes
        self.finished: set[int] = set()
        if self.out is not None:
            self.partial = self.out.parent / f".{self.out.name}.partial"
            if self.writes:
                self._start(job or {})
            self.finished = {i for i in range(self.count) if self.shard(i).exists()}

    def _start(self, job: dict) -> None:
        recorded = self.partial / JOB
        if recorded.exists() and json.loads(recorded.read_text()) != job:
            raise SparsegenError(
                f"{self.partial} holds an interrupted run with other settings; delete it, or rerun with its "
                f"settings ({recorded})"
            )
        self.partial.mkdir(parents=True, exist_ok=True)
        write_json(recorded, job)

    def shard(self, index: int) -> Path:
        """The output shard of block `index`; the last shard holds what is not in a block."""
        return self.partial / f"model-{index + 1:05d}-of-{self.count + 1:05d}.safetensors"

    @contextlib.contextmanager
    def held(self, index: int, block: nn.Module, codec: Codec | None = None) -> Iterator[bool]:
        name = f"{self.prefix}.{index}."
        finished = index in self.finished
        if finished:
            with safe_open(str(self.shard(index)), "pt") as handle:
                keys = handle.keys()
                local = {key.removeprefix(name): handle.get_tensor(key) for key in keys}
            local = codec.decode(index, local) if codec is not None else local
        else:
            read = self.source.read(self.source.names_under(name), self.model.dtype)
            local = {key.removeprefix(name): tensor for key, tensor in read.items()}
        block.load_state_dict(local, strict=True, assign=True)
        del local
        try:
            yield finished
            if self.writes and not finished:
                tensors = {key: t.contiguous() for key, t in block.state_dict().items()}
                tensors = codec.encode(index, tensors) if codec is not None else tensors
                save_safetensors(self.shard(index), {name + key: t for key, t in tensors.items()})
        finally:
            _take_away(block)
            gc.collect()  # tensors caught in reference cycles would otherwise outlive their block

    def finish(self, configure: Callable[[Path], None] | None = None) -> Path:
        """Write the shard of what is not in a block, the index, config and tokenizer files, then
        move the folder to `out` (replacing it); `configure(folder)` edits config.json last."""
        if not self.writes or not all(self.shard(i).exists() for i in range(self.count)):
            raise SparsegenError("finish() needs every block written; run prune or quantize with these blocks first")
        rest = [name for name in self.source.files if not name.startswith(self.prefix + ".")]
        state = self.model.state_dict()
        save_safetensors(self.shard(self.count), {name: state[name].contiguous() for name in rest})
        weight_map = {}
        for index in range(self.count + 1):
            with safe_open(str(self.shard(index)), "pt") as handle:
                weight_map.update(dict.fromkeys(handle.keys(), self.shard(index).name))
        total = sum(self.shard(index).stat().st_size for index in range(self.count + 1))
        write_json(self.partial / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        for file in self.source.folder.iterdir():
            if file.is_file() and file.name != "config.json" and not file.name.startswith("model"):
                shutil.copy2(file, self.partial / file.name)
        self.model.config.save_pretrained(self.partial)
        if configure is not None:
            configure(self.partial)
        (self.partial / JOB).unlink()
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.partial, self.out)
        return self.out
