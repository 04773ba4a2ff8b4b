"""A soft prompt: k learned input embeddings put before the text, stored in peft's prompt-tuning format.

The folder holds `adapter_config.json` (peft's `PromptTuningConfig`) and `adapter_model.safetensors`
with the single tensor `prompt_embeddings` [k, hidden], so `peft.PeftModel.from_pretrained` reads it
and peft-trained prompts load here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from sparsegen.errors import SparsegenError

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
KEY = "prompt_embeddings"


class SoftPrompt(nn.Module):
    """`embeddings` [k, hidden]; `prepend` puts them before a batch of token embeddings."""

    def __init__(self, embeddings: torch.Tensor) -> None:
        super().__init__()
        self.embeddings = nn.Parameter(embeddings.detach().clone().float())

    @property
    def tokens(self) -> int:
        return self.embeddings.shape[0]

    @classmethod
    def from_vocabulary(cls, model: nn.Module, tokens: int = 100, seed: int = 0) -> SoftPrompt:
        """Initialise from the embeddings of `tokens` random real tokens (peft's SAMPLE_VOCAB, the
        paper's choice; N(0, 1) would be far larger than real embeddings)."""
        if tokens < 1:
            raise SparsegenError(f"a soft prompt needs at least one virtual token, got {tokens}")
        table = model.get_input_embeddings().weight
        ids = torch.randint(0, table.shape[0], (tokens,), generator=torch.Generator().manual_seed(seed))
        return cls(table[ids].detach())

    def prepend(self, embeds: torch.Tensor) -> torch.Tensor:
        prompt = self.embeddings.to(embeds.dtype).expand(embeds.shape[0], -1, -1)
        return torch.cat([prompt, embeds], dim=1)

    def check_fits(self, model: nn.Module) -> None:
        hidden = model.get_input_embeddings().embedding_dim
        if self.embeddings.shape[1] != hidden:
            raise SparsegenError(
                f"the soft prompt has {self.embeddings.shape[1]}-wide embeddings but the model's hidden size is "
                f"{hidden}: it was trained for another model; train one for this model with `sparsegen prompt train`"
            )

    def save(self, folder: str | Path, model: nn.Module, base_model: str = "") -> Path:
        """Write peft's prompt-tuning folder (config + `prompt_embeddings`)."""
        from peft import PromptTuningConfig

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = model.config.get_text_config(decoder=True)
        PromptTuningConfig(
            task_type="CAUSAL_LM",
            num_virtual_tokens=self.tokens,
            token_dim=self.embeddings.shape[1],
            num_transformer_submodules=1,
            num_attention_heads=config.num_attention_heads,
            num_layers=config.num_hidden_layers,
            prompt_tuning_init="SAMPLE_VOCAB",
            base_model_name_or_path=base_model,
            inference_mode=True,
        ).save_pretrained(str(folder))
        tmp = folder / f".{WEIGHTS}.tmp"
        save_file({KEY: self.embeddings.detach().contiguous()}, str(tmp))
        tmp.replace(folder / WEIGHTS)
        return folder

    @classmethod
    def load(cls, folder: str | Path, model: nn.Module | None = None) -> SoftPrompt:
        """Read a peft prompt-tuning folder; with `model`, check it was made for that hidden size."""
        folder = Path(folder)
        if not (folder / WEIGHTS).is_file() or not (folder / CONFIG).is_file():
            raise SparsegenError(
                f"{folder} is not a soft-prompt folder (needs {CONFIG} and {WEIGHTS}); "
                "make one with `sparsegen prompt train`"
            )
        peft_type = json.loads((folder / CONFIG).read_text()).get("peft_type")
        if peft_type != "PROMPT_TUNING":
            raise SparsegenError(f"{folder} holds a peft {peft_type} adapter, not a prompt-tuning one")
        try:
            prompt = cls(load_file(str(folder / WEIGHTS))[KEY])
        except (SafetensorError, KeyError) as exc:
            raise SparsegenError(f"{folder / WEIGHTS} is truncated or lacks {KEY!r} ({exc}); save it again") from None
        if model is not None:
            prompt.check_fits(model)
        return prompt
