"""The fused sparse MLP kernel (`kernels/sparse_mlp.cpp` through `contextual.fused`): each record
format against a float64 MLP written here with the unkept neurons' h zeroed, the mask's edge cases,
and whole tiny models whose logits equal the gathered path's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparsegen.contextual import SparseMLP, sparsify
from sparsegen.contextual.fused import ENGINES, FORMATS, FusedMLP, activation_code, fuse
from sparsegen.contextual.parts import MLPParts
from sparsegen.errors import SparsegenError
from sparsegen.kernels import Unpacked, load_sparse_mlp
from sparsegen.models import decoder_layers
from tests.conftest import build_tiny

pytestmark = pytest.mark.skipif(load_sparse_mlp() is None, reason="the fused kernel does not build here")

# (atol as a share of the largest output, rtol) against float64 on the weights the records hold:
# fp32 and bf16 differ by summation order only; the integer formats also round x to int8 per block
# of 32 (about 1% of the output), which `_rounded` does too for the tight comparison.
TOLERANCE = {"fp32": (1e-5, 1e-5), "bf16": (1e-5, 1e-5), "int8": (3e-2, 3e-2), "int4": (3e-2, 3e-2)}


def _parts(hidden: int = 64, neurons: int = 96, seed: int = 0, act: nn.Module | None = None) -> MLPParts:
    torch.manual_seed(seed)
    gate, up = nn.Linear(hidden, neurons, bias=False), nn.Linear(hidden, neurons, bias=False)
    return MLPParts(gate, up, nn.Linear(neurons, hidden, bias=False), act or nn.SiLU())


def reference(x, gate, up, down, keep: torch.Tensor, act=F.silu) -> torch.Tensor:
    """The dense MLP in float64 with every neuron outside the mask `keep` zeroed before down."""
    x, gate, up, down = (t.double() for t in (x, gate, up, down))
    hidden = act(x @ gate.t()) * (x @ up.t())
    return (hidden * keep) @ down.t()


def _assert_near(out: torch.Tensor, expected: torch.Tensor, fmt: str) -> None:
    atol, rtol = TOLERANCE[fmt]
    torch.testing.assert_close(out.double(), expected, atol=atol * expected.abs().max().item(), rtol=rtol)


def _kept(neurons: int, share: float, seed: int = 1) -> torch.Tensor:
    """A mask over `neurons` with a random `share` of them set."""
    order = torch.randperm(neurons, generator=torch.Generator().manual_seed(seed))
    return torch.zeros(neurons, dtype=torch.bool).index_fill_(0, order[: int(neurons * share)], True)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_each_format_equals_the_masked_float64_mlp(fmt, rows):
    parts = _parts()
    fused = FusedMLP.pack(parts, fmt)
    assert isinstance(fused, FusedMLP)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    kept = _kept(96, 0.5)
    _assert_near(fused(x, kept), reference(x, *fused.weights(), kept), fmt)


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the integer formats see it: int8 codes times one step per block of 32 (max |x| / 127)."""
    blocks = x.view(x.shape[0], -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    return ((blocks / step.clamp_min(1e-30)).round() * step).view_as(x)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 4])
def test_the_integer_formats_are_exact_on_the_rounded_rows(fmt, rows):
    fused = FusedMLP.pack(_parts(hidden=128, neurons=200), fmt)
    x, kept = torch.randn(rows, 128), _kept(200, 0.5)
    expected = reference(_rounded(x), *fused.weights(), kept)
    torch.testing.assert_close(fused(x, kept).double(), expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_records_hold_the_weights_up_to_their_rounding(fmt):
    parts = _parts()
    gate, up, down = FusedMLP.pack(parts, fmt).weights()
    error = {"fp32": 0, "bf16": 2**-8, "int8": 1 / 127, "int4": 1 / 15}[fmt]
    for got, want in ((gate, parts.gate.weight), (up, parts.up.weight), (down, parts.down.weight)):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= error * want.abs().max() + 1e-7


def test_a_hidden_size_off_the_blocks_is_padded():
    parts = _parts(hidden=40, neurons=50)
    for fmt in FORMATS:
        fused = FusedMLP.pack(parts, fmt)
        x = torch.randn(2, 40)
        kept = _kept(50, 0.6)
        _assert_near(fused(x, kept), reference(x, *fused.weights(), kept), fmt)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_known_gate_is_used_instead_of_the_gate_rows(fmt):
    parts = _parts()
    fused = FusedMLP.pack(parts, fmt)
    x, kept = torch.randn(3, 64), _kept(96, 0.4)
    gate, up, down = fused.weights()
    gate_act = F.silu(x @ parts.gate.weight.t())  # the float gate, not the records'
    expected = (gate_act.double() * (x.double() @ up.double().t()) * kept) @ down.double().t()
    _assert_near(fused(x, kept, gate_act), expected, fmt)


def test_no_neuron_kept_is_zero_and_every_neuron_is_the_dense_mlp():
    parts = _parts()
    fused = FusedMLP.pack(parts, "fp32")
    x = torch.randn(2, 64)
    assert torch.equal(fused(x, torch.zeros(96, dtype=torch.bool)), torch.zeros(2, 64))
    dense = parts.down(F.silu(parts.gate(x)) * parts.up(x))
    torch.testing.assert_close(fused(x, torch.ones(96, dtype=torch.bool)), dense, atol=1e-5, rtol=1e-5)


def test_a_mask_of_another_size_or_type_or_a_gate_of_another_shape_is_a_clear_error():
    fused = FusedMLP.pack(_parts(), "fp32")
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="bool mask over the 96 neurons"):
        fused(x, torch.ones(95, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="bool mask"):
        fused(x, torch.arange(48))  # a list of neurons is not a mask
    with pytest.raises(RuntimeError, match=r"gate_act must be \[rows, neurons\]"):
        fused(x, _kept(96, 0.5), torch.randn(1, 48))
    with pytest.raises(SparsegenError, match="no fused format"):
        FusedMLP.pack(_parts(), "int3")


def test_the_activation_is_matched_by_value_and_others_are_refused():
    assert activation_code(nn.SiLU()) == 0
    assert activation_code(nn.GELU(approximate="tanh")) == 1
    assert activation_code(nn.ReLU()) == 3
    gelu = _parts(act=nn.GELU())
    fused = FusedMLP.pack(gelu, "fp32")
    x, kept = torch.randn(2, 64), _kept(96, 0.5)
    _assert_near(fused(x, kept), reference(x, *fused.weights(), kept, F.gelu), "fp32")
    assert isinstance(FusedMLP.pack(_parts(act=nn.Tanh()), "fp32"), Unpacked)
    biased = _parts()
    biased.up = nn.Linear(64, 96)
    assert "biases" in str(FusedMLP.pack(biased, "fp32"))


def test_two_threads_give_the_one_thread_result():
    parts = _parts(hidden=128, neurons=512)
    fused = FusedMLP.pack(parts, "fp32")
    x, kept = torch.randn(2, 128), _kept(512, 0.5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused(x, kept)
        torch.set_num_threads(2)
        two = fused(x, kept)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, two, atol=1e-5, rtol=1e-5)


def test_the_op_compiles_to_one_graph_whatever_the_mask_keeps():
    """The op is opaque to inductor (its meta function gives the shape): no break, no recompile."""
    from torch._dynamo.utils import counters

    fused = FusedMLP.pack(_parts(), "int8")
    compiled = torch.compile(fused, fullgraph=True, dynamic=False)
    graphs = counters["stats"]["unique_graphs"]
    x = torch.randn(2, 64)
    for share in (0.2, 0.5, 0.9, 0.0):
        kept = _kept(96, share, seed=int(10 * share))
        torch.testing.assert_close(compiled(x, kept), fused(x, kept), atol=0, rtol=0)
    assert counters["stats"]["unique_graphs"] - graphs == 1


def _calibration() -> torch.Tensor:
    return torch.randint(3, 96, (4, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("selector", ["threshold", "predictor"])
@pytest.mark.parametrize("engine", ["fused", "fused-bf16", "fused-int8"])
def test_decode_logits_equal_the_gathered_path(arch, selector, engine):
    model = build_tiny(arch)
    sparsify(model, selector, 0.5, calibration=_calibration(), progress=False)
    prompt = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values
        step = torch.randint(3, 96, (2, 1), generator=torch.Generator().manual_seed(3))
        gathered = model(step, past_key_values=_copy(cache)).logits
        assert fuse(model, engine) == [None] * len(decoder_layers(model))
        calls = _count_calls(model)
        fused = model(step, past_key_values=_copy(cache)).logits
        assert calls == [1] * len(decoder_layers(model))
        fuse(model, "gather")
        dense = _dense_step(model, step, cache)
    assert (dense - gathered).abs().max() > 1e-3  # half the neurons skipped: not the dense model
    tol = {"fused": 1e-4, "fused-bf16": 5e-2, "fused-int8": 1e-1}[engine]
    torch.testing.assert_close(fused, gathered, atol=tol, rtol=tol)


def _count_calls(model) -> list[int]:
    """A list counting, per decoder layer, the calls of its fused MLP (filled as the model runs)."""
    calls = [0] * len(decoder_layers(model))
    for i, layer in enumerate(decoder_layers(model)):
        layer.mlp.fused.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def _dense_step(model, step, cache) -> torch.Tensor:
    from sparsegen.contextual import densify

    densify(model)
    return model(step, past_key_values=cache).logits


def _copy(cache):
    import copy

    return copy.deepcopy(cache)


def test_the_engine_is_an_option_of_sparsify_and_gather_undoes_it():
    model = build_tiny("llama")
    sparsify(model, "threshold", 0.5, calibration=_calibration(), progress=False, engine="fused-int4")
    mlps = [layer.mlp for layer in decoder_layers(model)]
    assert all(isinstance(m, SparseMLP) and m.fused is not None and m.fused.fmt == "int4" for m in mlps)
    fuse(model, "gather")
    assert all(m.fused is None for m in mlps)
    with pytest.raises(SparsegenError, match="no sparse MLP engine"):
        fuse(model, "fastest")
    assert "gather" in ENGINES


def test_the_contextual_bench_runs_the_fused_engine(tiny_folder, tiny_text, tmp_path):
    import json

    from sparsegen.bench.contextual import bench_contextual

    bench = bench_contextual(
        str(tiny_folder), ("threshold",), (0.5,), (1,), context=8, tokens=3, rounds=1, calib_text=str(tiny_text),
        out=tmp_path, progress=lambda m: None, engine="fused-int8",
    )  # fmt: skip
    assert [r["selector"] for r in bench] == ["dense", "threshold"] and all(r["ms"] > 0 for r in bench)
    assert json.loads((tmp_path / "bench_contextual.json").read_text())["meta"]["engine"] == "fused-int8"
    assert "fused-int8 engine" in (tmp_path / "bench_contextual.md").read_text()


def _eager_kept_counts(model, prompt: torch.Tensor, steps: int) -> tuple[list[list[int]], list[int]]:
    """The eager fused decode's tokens, and the kept count of every fused MLP call it made."""
    from sparsegen.decode import generate

    kept: list[int] = []
    hooks = [
        layer.mlp.fused.register_forward_hook(lambda _, args, __: kept.append(int(args[1].sum())))
        for layer in decoder_layers(model)
    ]
    try:
        return generate(model, prompt, steps, compile="never", eos_token_id=[]).tokens, kept
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("selector", ["threshold", "predictor"])
def test_the_compiled_decode_traces_one_graph_whatever_is_kept(selector):
    """Two rows, whose union of kept neurons changes from step to step and layer to layer: the
    compiled step with the fused engine is one graph (no break at the selection, no recompile for
    a new count) and decodes the eager gathered path's tokens."""
    from torch._dynamo.utils import counters

    from sparsegen.decode import generate

    model = build_tiny("llama", layers=2)
    sparsify(model, selector, 0.5, calibration=_calibration(), progress=False, engine="fused")
    prompt = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(2))
    eager, kept = _eager_kept_counts(model, prompt, 8)
    assert len(set(kept)) > 2 and max(kept) < model.config.intermediate_size
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    compiled = generate(model, prompt, 8, compile="always", eos_token_id=[], notify=lambda _: None)
    assert compiled.mode == "compiled"
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert sum(counters["graph_break"].values()) == breaks
    fuse(model, "gather")
    gathered = generate(model, prompt, 8, compile="never", eos_token_id=[]).tokens
    assert compiled.tokens == eager == gathered
