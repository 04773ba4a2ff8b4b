"""Tiny Llama and Qwen2 GGUF files for the loader's tests (`test_gguf_load.py`), written with gguf's
own writer (32-blocks quantized by `gguf.quants.quantize`, K-quant blocks as random bytes with sane
fp16 scales), and their reference: the same model built in transformers from the blocks decoded by
`gguf.quants.dequantize`, in HF order (the file holds llama's query/key rows permuted as llama.cpp's
converter writes them)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from sparsegen.quant.gguf_blocks import GGUFLinear

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, CONTEXT = 256, 512, 4, 2, 2, 128
MERGES = ["Ġ t", "h e", "Ġt he"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = [bytes_to_unicode()[b] for b in range(256)] + ["Ġt", "he", "Ġthe"] + SPECIAL
VOCAB = len(TOKENS)
SIMPLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
SCALES = {  # (byte offset, size) of each fp16 scale in a K-quant block; elsewhere the bytes are random codes
    Q.Q3_K: ((108, 1e-3),),
    Q.Q4_K: ((0, 2e-4), (2, 2e-4)),
    Q.Q5_K: ((0, 1e-4), (2, 1e-4)),
    Q.Q6_K: ((208, 2e-5),),
}
PROJECTIONS = {  # GGUF name: (transformers name, rows, inputs)
    "attn_q": ("self_attn.q_proj", HIDDEN, HIDDEN),
    "attn_k": ("self_attn.k_proj", KV_HEADS * HIDDEN // HEADS, HIDDEN),
    "attn_v": ("self_attn.v_proj", KV_HEADS * HIDDEN // HEADS, HIDDEN),
    "attn_output": ("self_attn.o_proj", HIDDEN, HIDDEN),
    "ffn_gate": ("mlp.gate_proj", FFN, HIDDEN),
    "ffn_up": ("mlp.up_proj", FFN, HIDDEN),
    "ffn_down": ("mlp.down_proj", HIDDEN, FFN),
}


def random_blocks(qtype: Q, rows: int, inputs: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] of `qtype`: quantized normal weights, or random K-quant codes."""
    if qtype in SIMPLE:
        return quantize(rng.normal(0, 0.05, (rows, inputs)).astype(np.float32), qtype)
    per_block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, inputs // per_block, size), dtype=np.uint8)
    for offset, scale in SCALES[qtype]:
        half = (rng.uniform(0.5, 1.0, raw.shape[:2]) * scale).astype(np.float16)
        raw[..., offset : offset + 2] = half[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes a llama query/key weight in."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _float(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def _tensors(arch: str, types: dict, tied: bool, rng) -> tuple[list, dict, dict]:
    """([(GGUF name, array, type or None)], reference HF state, {GGUF name: HF-order blocks})."""
    tensors, state, blocks = [], {}, {}

    def add(name, hf_name, qtype, rows, inputs, permute_heads=None):
        if qtype in (Q.F32, Q.F16):
            values = rng.normal(0, 0.05, (rows, inputs)).astype(np.float16 if qtype == Q.F16 else np.float32)
            tensors.append((name, values, None))
            state[hf_name] = _float(values)
            return
        hf_blocks = random_blocks(qtype, rows, inputs, rng)
        blocks[name] = hf_blocks
        state[hf_name] = _float(dequantize(hf_blocks, qtype))
        written = llama_cpp_permute(hf_blocks, permute_heads) if permute_heads else hf_blocks
        tensors.append((name, written, qtype))

    add("token_embd.weight", "model.embed_tokens.weight", types["token_embd"], VOCAB, HIDDEN)
    for layer in range(LAYERS):
        for short, (hf_short, rows, inputs) in PROJECTIONS.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(short) if arch == "llama" else None
            add(
                f"blk.{layer}.{short}.weight",
                f"model.layers.{layer}.{hf_short}.weight",
                types[short],
                rows,
                inputs,
                heads,
            )
            if arch == "qwen2" and short in ("attn_q", "attn_k", "attn_v"):
                bias = rng.normal(0, 0.1, rows).astype(np.float32)
                tensors.append((f"blk.{layer}.{short}.bias", bias, None))
                state[f"model.layers.{layer}.{hf_short}.bias"] = _float(bias)
        for short, hf_short in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            norm = rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32)
            tensors.append((f"blk.{layer}.{short}.weight", norm, None))
            state[f"model.layers.{layer}.{hf_short}.weight"] = _float(norm)
    norm = rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32)
    tensors.append(("output_norm.weight", norm, None))
    state["model.norm.weight"] = _float(norm)
    if not tied:
        add("output.weight", "lm_head.weight", types["output"], VOCAB, HIDDEN)
    return tensors, state, blocks


def write_tiny(path, arch="llama", types=None, tied=True, theta=10000.0, seed=0) -> tuple[dict, dict]:
    """Write a tiny `arch` GGUF; return (reference HF state, {GGUF name: blocks in HF row order})."""
    types = {"token_embd": Q.F16, "output": Q.Q6_K, **(types or {})}
    for short in PROJECTIONS:
        types.setdefault(short, Q.Q8_0)
    tensors, state, blocks = _tensors(arch, types, tied, np.random.default_rng(seed))
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(1e-5)
    if arch == "llama":
        writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "llama-bpe")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * (VOCAB - len(SPECIAL)) + [3] * len(SPECIAL))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(VOCAB - 3)
    writer.add_eos_token_id(VOCAB - 1)
    for name, array, qtype in tensors:
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state, blocks


def reference(arch: str, state: dict, tied: bool, theta: float = 10000.0) -> nn.Module:
    """The same model in transformers, from the decoded weights, eager attention."""
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5,
        rope_theta=theta,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(LlamaConfig(**shape)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**shape))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.set_attn_implementation("eager")
    return model.eval()


IDS = torch.tensor([[VOCAB - 3, 71, 104, 101, 32, 258, 259, 3, 99, 200, 17]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=2e-4 * b.abs().max().item(), rtol=1e-4)


def linears(model) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear | GGUFLinear)}
