"""The joined q/k/v products of a GGUF model's attention (`sparsegen.gguf_attention`) against
transformers' own attention forward over the separate projections, each built from the file by a load
that joins nothing: the same logits, greedy tokens through a KV policy, and a compiled step's tokens."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_tiny import IDS, logits, same, write_tiny

import sparsegen
from sparsegen import gguf_model
from sparsegen.bench.measure import weight_bytes
from sparsegen.decode import generate
from sparsegen.kv.spec import KVSpec
from sparsegen.quant.gguf_blocks import GGUFLinear, kernels_ready

pytestmark = pytest.mark.skipif(not kernels_ready(), reason="the GGUF block kernels are not built here")

CASES = {  # name: (architecture, formats, the joined groups)
    "llama-q4_1": ("llama", {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1}, ["q_proj__k_proj__v_proj"]),
    "qwen2-q4_k-q6_k": ("qwen2", {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K}, ["q_proj__k_proj"]),
    "llama-q8_0-rows": ("llama", {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0}, ["q_proj__v_proj"]),
}


def _load(path, monkeypatch, join: bool):
    with monkeypatch.context() as patch:
        if not join:
            patch.setattr(gguf_model, "join_projections", lambda model: 0)
        model, _ = sparsegen.load(str(path), attn_implementation="eager", device="cpu")
    return model


@pytest.fixture(params=list(CASES))
def pair(request, tmp_path_factory, monkeypatch):
    """(joined model, separate model, the joined groups) of one tiny GGUF file."""
    arch, types, groups = CASES[request.param]
    path = tmp_path_factory.mktemp("joined") / f"{request.param}.gguf"
    write_tiny(path, arch, types, tied=arch == "llama", theta=1e6 if arch == "qwen2" else 10000.0)
    monkeypatch.setenv("SPARSEGEN_CACHE", str(path.parent / "cache"))
    return _load(path, monkeypatch, True), _load(path, monkeypatch, False), groups


def test_the_joined_layers_are_views_of_one_buffer(pair):
    joined, separate, groups = pair
    for layer, plain in zip(joined.model.layers, separate.model.layers, strict=True):
        attention = layer.self_attn
        assert list(attention.joined_projections) == groups
        assert "forward" not in plain.self_attn.__dict__ and not hasattr(plain.self_attn, "joined_projections")
        for key, product in attention.joined_projections.items():
            names = key.split("__")
            assert product.out_features == sum(getattr(attention, name).out_features for name in names)
            for name in names:
                view, own = getattr(attention, name).blocks, getattr(plain.self_attn, name).blocks
                assert view.untyped_storage().data_ptr() == product.blocks.untyped_storage().data_ptr()
                assert torch.equal(view, own)
    assert weight_bytes(joined) == weight_bytes(separate)  # the joined rows are not counted twice


def test_the_joined_forward_gives_the_separate_logits(pair):
    joined, separate, _ = pair
    same(logits(joined), logits(separate))


def test_a_policy_decode_gives_the_separate_tokens(pair):
    joined, separate, _ = pair
    spec = KVSpec.of("h2o", budget=8)
    ids = IDS.repeat(1, 2)
    ours = generate(joined, ids, 10, spec, compile="never", eos_token_id=[])
    theirs = generate(separate, ids, 10, spec, compile="never", eos_token_id=[])
    assert ours.tokens == theirs.tokens


def test_the_compiled_step_runs_the_joined_products(tmp_path, monkeypatch):
    arch, types, _ = CASES["llama-q4_1"]
    path = tmp_path / "tiny.gguf"
    write_tiny(path, arch, types, tied=True)
    monkeypatch.setenv("SPARSEGEN_CACHE", str(tmp_path / "cache"))
    joined, separate = _load(path, monkeypatch, True), _load(path, monkeypatch, False)
    assert sum(isinstance(m, GGUFLinear) for m in joined.modules()) == sum(
        isinstance(m, GGUFLinear) for m in separate.modules()
    ) + len(joined.model.layers)
    compiled = generate(joined, IDS, 8, compile="always", eos_token_id=[], notify=lambda _: None)
    eager = generate(separate, IDS, 8, compile="never", eos_token_id=[])
    assert compiled.tokens == eager.tokens
