"""Compress, then prompt: a learned soft prompt that wins back a compressed model's quality."""

from sparsegen.prompt.soft import SoftPrompt
from sparsegen.prompt.train import PromptReport, PromptTraining, prompt_loss, train_prompt

__all__ = ["PromptReport", "PromptTraining", "SoftPrompt", "prompt_loss", "prompted_ppl", "train_prompt"]
