"""Run a model one decoder block at a time over many sequences: what calibration (pruning,
quantization) and layer-by-layer evaluation share.

The inputs of block 0 are captured for every sequence, then each block runs over all of them and
its outputs become the next block's inputs (`Hidden`, spilled to files past a share of RAM). A
`Blocks` source (`layerwise_blocks`) says where a block's weights are while it runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from abc import ABC
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils._pytree import tree_map
from tqdm.auto import tqdm

from sparsegen.distributed import all_reduce_sum, broadcast_rewrite, owner, rank_and_size
from sparsegen.layerwise_blocks import IN_MEMORY, Blocks, Codec
from sparsegen.models import cpu_bf16_flag, decoder_layers
from sparsegen.report import say_estimate

SPILL_SHARE = 0.25  # hidden states beyond this share of the machine's RAM go to files


@dataclass
class InputStats:
    """Calibration statistics of one Linear layer's inputs, accumulated over samples.

    Each sample's sums are added in float64, so the totals do not depend on how the samples were
    batched or split over ranks (SparseGPT's masks follow small changes of H^-1 a long way).
    """

    columns: int
    need_hessian: bool
    samples: int = 0  # tokens seen
    sq_norm: torch.Tensor | None = None  # sum over tokens of x_j^2, per input column (fp64)
    gram: torch.Tensor | None = None  # sum over tokens of x x^T (fp64)

    @property
    def hessian(self) -> torch.Tensor:
        """H = (2 / n) sum x x^T, as SparseGPT and GPTQ define it (fp64)."""
        return self.gram * (2 / self.samples)

    def add(self, x: torch.Tensor) -> None:
        """Add a batch of inputs [..., tokens, columns], one sample (the leading index) at a time."""
        with torch.autocast(x.device.type, enabled=False):  # statistics always in fp32 and up
            x = x.float()
            for sample in x.reshape(-1, x.shape[-2] if x.dim() > 2 else x.shape[0], self.columns):
                self._add(sample)

    def _add(self, x: torch.Tensor) -> None:
        if self.sq_norm is None:
            self.sq_norm = torch.zeros(self.columns, device=x.device, dtype=torch.float64)
        self.sq_norm += x.square().sum(0, dtype=torch.float64)
        if self.need_hessian:
            if self.gram is None:
                self.gram = torch.zeros(self.columns, self.columns, device=x.device, dtype=torch.float64)
            self.gram += x.t() @ x
        self.samples += x.shape[0]

    def all_reduce(self) -> None:
        """Sum the statistics of every rank's share of the samples (a no-op in one process)."""
        if rank_and_size()[1] == 1:
            return
        count = torch.tensor([float(self.samples)], dtype=torch.float64, device=self.sq_norm.device)
        all_reduce_sum(count)
        all_reduce_sum(self.sq_norm)
        if self.gram is not None:
            all_reduce_sum(self.gram)
        self.samples = int(count.item())


@dataclass
class LinearRewrite(ABC):
    """What `rewrite_layerwise` runs on each Linear, the base of pruners and quantizers: a
    dataclass whose fields are the method's settings. `needs_calibration`: it reads `InputStats`;
    `needs_hessian`: their Gram matrix too."""

    name: ClassVar[str]
    needs_calibration: ClassVar[bool] = False
    needs_hessian: ClassVar[bool] = False


def machine_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Hidden:
    """Hidden states of every sequence batch between two blocks: tensors in RAM, or one raw file
    per batch, memory-mapped when read, once their total passes `SPILL_SHARE` of RAM."""

    def __init__(self, spill: bool = False) -> None:
        self._tensors: list[torch.Tensor] = []
        self._files: list[tuple[str, torch.Size, torch.dtype]] = []
        self._folder = tempfile.mkdtemp(prefix="sparsegen-hidden-") if spill else None

    @property
    def spilled(self) -> bool:
        return self._folder is not None

    def append(self, tensor: torch.Tensor) -> None:
        if self._folder is None:
            self._tensors.append(tensor)
            return
        path = os.path.join(self._folder, f"{len(self._files)}.bin")
        tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tofile(path)
        self._files.append((path, tensor.shape, tensor.dtype))

    def __len__(self) -> int:
        return len(self._files) if self.spilled else len(self._tensors)

    def __getitem__(self, k: int) -> torch.Tensor:
        if not self.spilled:
            return self._tensors[k]
        path, shape, dtype = self._files[k]
        return torch.from_file(path, shared=False, size=shape.numel(), dtype=dtype).view(shape)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[k] for k in range(len(self)))

    def like(self) -> Hidden:
        return Hidden(self.spilled)

    def close(self) -> None:
        self._tensors.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def __del__(self) -> None:
        self.close()


def _onto(block: nn.Module, kwargs: dict) -> tuple[torch.device, dict]:
    """The block's device, and its keyword arguments (masks, rotary tables) moved there."""
    device = next(block.parameters()).device
    return device, tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, kwargs)


def block_linears(block: nn.Module) -> dict[str, nn.Linear]:
    return {name: module for name, module in block.named_modules() if isinstance(module, nn.Linear)}


def fast_calibration_dtype(device: torch.device) -> torch.dtype | None:
    """bfloat16 where the hardware computes it natively (CUDA, or CPUs with AVX-512 BF16 / AMX), else None.

    Calibration forwards only produce statistics and the next block's inputs; the published
    methods run them in half precision on GPUs. Statistics are still accumulated in fp32 and up.
    """
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and cpu_bf16_flag() is not None:  # the one rule: `models.cpu_bf16_flag`
        return torch.bfloat16
    return None


class _Stop(Exception):
    pass


def _on_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


@contextlib.contextmanager
def blocks_skipped(layers: nn.ModuleList, output: Callable[[int, torch.Tensor], torch.Tensor]):
    """Run the model's own forward with every block replaced by `output(index, its input)`: the
    blocks whose weights are away (on the meta device) run on meta tensors, costing nothing, so
    the model computes everything around them (masks, rotary tables, the head) as it would."""
    held: dict[int, torch.Tensor] = {}

    def before(index):
        def hook(module, args, kwargs):
            held[index] = args[0] if args else kwargs["hidden_states"]
            if not _on_meta(module):
                return None
            to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
            return tree_map(to_meta, args), tree_map(to_meta, kwargs)

        return hook

    def after(index):
        def hook(module, args, kwargs, out):
            replaced = output(index, held.pop(index))
            return replaced if isinstance(out, torch.Tensor) else (replaced, *out[1:])

        return hook

    handles = [layer.register_forward_pre_hook(before(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(after(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def capture_inputs(
    model: nn.Module,
    ids: torch.Tensor,
    batch: int = 8,
    calibration_dtype: torch.dtype | None | str = "auto",
    blocks_device: torch.device | None = None,
) -> tuple[Hidden, list[dict], torch.dtype | None]:
    """Inputs of block 0 for `ids` [sequences, seqlen] in batches, the keyword arguments each
    block is called with (recorded from one sequence's pass), and the forward dtype ("auto":
    `fast_calibration_dtype` of where the blocks run, `blocks_device` or the model's device).
    Blocks whose weights are away are not needed."""
    layers = decoder_layers(model)
    device = next(p for p in model.parameters() if not p.is_meta).device
    runs_on = blocks_device or device
    dtype = fast_calibration_dtype(runs_on) if calibration_dtype == "auto" else calibration_dtype
    ids = ids.to(device)
    width = model.config.get_text_config(decoder=True).hidden_size
    spill = 2 * ids.numel() * width * torch.finfo(model.dtype).bits // 8 > SPILL_SHARE * machine_ram_bytes()
    inputs, block_kwargs = Hidden(spill), [{} for _ in layers]

    def record(module, args, kwargs):
        index = next(i for i, layer in enumerate(layers) if layer is module)
        block_kwargs[index] = {k: v for k, v in kwargs.items() if k != "hidden_states"}

    def first(module, args, kwargs):
        inputs.append(args[0] if args else kwargs["hidden_states"])
        raise _Stop

    def stop_after_last(index, hidden):
        if index == len(layers) - 1:
            raise _Stop
        return hidden

    with torch.no_grad():
        handles = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
        try:
            with blocks_skipped(layers, stop_after_last), contextlib.suppress(_Stop):
                model(ids[:1], use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        handle = layers[0].register_forward_pre_hook(first, with_kwargs=True)
        try:
            for start in range(0, ids.shape[0], batch):
                with contextlib.suppress(_Stop):
                    model(ids[start : start + batch], use_cache=False)
        finally:
            handle.remove()
    return inputs, block_kwargs, dtype


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def run_block(block: nn.Module, inputs: Hidden, kwargs: dict, dtype: torch.dtype | None) -> Hidden:
    """The block's outputs for every input batch."""
    outputs = inputs.like()
    device, kwargs = _onto(block, kwargs)
    with torch.no_grad():
        for hidden in inputs:
            with _autocast(device, dtype):
                out = block(hidden.to(device), **kwargs)
            outputs.append(out[0] if isinstance(out, tuple) else out)
    return outputs


def collect_stats(
    block: nn.Module, inputs: Hidden, kwargs: dict, dtype: torch.dtype | None, need_hessian: bool
) -> tuple[dict[str, nn.Linear], dict[str, InputStats]]:
    """Run the block over the inputs, accumulating each Linear's input statistics. Linears that
    read the same tensor (q/k/v, gate/up) share one `InputStats`: the sums are the same, computed
    and held once (a 7B block's Gram matrices: 1.4 GB instead of 1.8)."""
    linears = block_linears(block)
    stats: dict[str, InputStats] = {}
    adding: list[str] = []  # the Linears whose hook adds, in call order (ranks reduce in one order)
    first_inputs: list[tuple[torch.Tensor, InputStats]] = []  # inputs of the first forward so far

    def add(name: str, x: torch.Tensor) -> None:
        if name not in stats:
            shared = next((seen for tensor, seen in first_inputs if tensor is x), None)
            if shared is None:
                shared = InputStats(linears[name].in_features, need_hessian)
                first_inputs.append((x, shared))
                adding.append(name)
            stats[name] = shared
        if name in adding:
            stats[name].add(x)

    handles = [
        linear.register_forward_hook(lambda m, args, out, name=name: add(name, args[0]))
        for name, linear in linears.items()
    ]
    device, kwargs = _onto(block, kwargs)
    try:
        with torch.no_grad():
            for hidden in inputs:
                with _autocast(device, dtype):
                    block(hidden.to(device), **kwargs)
                first_inputs.clear()
    finally:
        for handle in handles:
            handle.remove()
    for name in adding:
        stats[name].all_reduce()
    return linears, stats


def rewrite_layerwise(
    layers: nn.ModuleList,
    rewrite: Callable[[int, str, nn.Linear, InputStats | None], Any],
    record: Callable[[int, str, nn.Linear, Any], None],
    inputs: Hidden | None,
    kwargs: list[dict] | None,
    dtype: torch.dtype | None,
    need_hessian: bool,
    desc: str,
    progress: bool = True,
    blocks: Blocks = IN_MEMORY,
    codec: Codec | None = None,
) -> None:
    """Call `rewrite(block_index, name, linear, stats)`, then `record(block_index, name, linear,
    what rewrite returned)`, on every Linear of every block, in order.

    With calibration `inputs`, each block's statistics come from its dense forward over the
    outputs of the already rewritten blocks before it (the standard sequential protocol);
    without, `stats` is None. A block an interrupted run already rewrote (`blocks`) is only
    recorded (with None) and run. Under torchrun, each Linear is rewritten by one rank and sent to
    the others (`distributed`). `codec` says how `blocks` stores a rewritten block (as it is, by default).
    """
    started = time.perf_counter()
    for i, block in enumerate(tqdm(layers, desc=desc, unit="block", disable=not progress)):
        if i == 1 and progress:
            say_estimate(time.perf_counter() - started, len(layers), "block", "--n-samples and --seqlen scale it")
        with blocks.held(i, block, codec) as finished:
            if finished or inputs is None:
                linears, stats = block_linears(block), {}
            else:
                linears, stats = collect_stats(block, inputs, kwargs[i], dtype, need_hessian)
            for k, (name, linear) in enumerate(linears.items()):
                result = None
                if not finished:
                    mine = owner(k) == rank_and_size()[0]
                    result = rewrite(i, name, linear, stats.get(name)) if mine else None
                    result = broadcast_rewrite(linear.weight.data, result, owner(k))
                record(i, name, linear, result)
            stats.clear()
            if inputs is not None and i + 1 < len(layers):
                outputs = run_block(block, inputs, kwargs[i], dtype)
                inputs.close()  # the caller hands the inputs over: only one block's are kept
                inputs = outputs
