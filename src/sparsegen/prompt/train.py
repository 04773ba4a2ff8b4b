"""Learn a soft prompt for a (compressed) model: next-token loss on calibration text, the model frozen.

Compress-Then-Prompt's recipe is the default: 100 virtual tokens from real token embeddings,
AdamW at lr 1e-3, no loss on prompt positions, 1024-token samples. `distill` > 0 mixes in the KL
divergence to a teacher's (the dense model's) next-token distribution. The run checkpoints its
state every few steps and the same call resumes it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from sparsegen.errors import SparsegenError
from sparsegen.ioutil import save_torch, write_json
from sparsegen.models import require_float_linears
from sparsegen.prompt.soft import SoftPrompt

STATE = "train_state.pt"


@dataclass
class PromptTraining:
    """Settings of one training run (recorded next to the prompt). A run resumed with more `steps`
    continues where it stopped."""

    tokens: int = 100
    steps: int = 200
    lr: float = 1e-3
    batch: int = 1
    distill: float = 0.0  # weight of the KL to the teacher; 0 = next-token loss only
    seed: int = 0
    checkpoint_every: int = 10


@dataclass
class PromptReport:
    settings: PromptTraining
    samples: int
    seqlen: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def prompted_logits(model: nn.Module, prompt: SoftPrompt | None, ids: torch.Tensor) -> torch.Tensor:
    """Logits predicting each token of `ids` [b, n] (from the one before it; the first from the last
    prompt token), [b, n, vocab] for prompted input, [b, n - 1, vocab] without a prompt."""
    embeds = model.get_input_embeddings()(ids)
    if prompt is None:
        return model(inputs_embeds=embeds, use_cache=False).logits[:, :-1]
    logits = model(inputs_embeds=prompt.prepend(embeds), use_cache=False).logits
    return logits[:, prompt.tokens - 1 : -1]


def prompt_loss(
    model: nn.Module, prompt: SoftPrompt, ids: torch.Tensor, teacher: nn.Module | None = None, distill: float = 0.0
) -> torch.Tensor:
    """Mean next-token NLL over the text's tokens, mixed with the KL to `teacher` when `distill` > 0."""
    logits = prompted_logits(model, prompt, ids).float()
    loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
    if distill > 0:
        with torch.no_grad():
            target = prompted_logits(teacher, None, ids).float().log_softmax(-1)
        student = logits[:, 1:].log_softmax(-1)
        kl = F.kl_div(student.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")
        loss = (1 - distill) * loss + distill * kl
    return loss


def train_prompt(
    model: nn.Module,
    samples: torch.Tensor,
    out: str | Path,
    settings: PromptTraining | None = None,
    teacher: nn.Module | None = None,
    base_model: str = "",
    progress: bool = True,
) -> tuple[SoftPrompt, PromptReport]:
    """Train a soft prompt on `samples` [n, seqlen]; write it to `out` in peft's format, with the loss
    curve (JSON and PNG). An interrupted run resumes from `out`/train_state.pt."""
    settings = settings or PromptTraining()
    require_float_linears(model, "train a prompt through it (the integer kernels have no backward)")
    if samples.dim() != 2:
        raise SparsegenError("prompt training needs token ids [n_samples, seqlen]")
    if settings.distill > 0 and teacher is None:
        raise SparsegenError("distillation needs a teacher model (the dense model): pass teacher= or --teacher")
    out = Path(out)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    prompt = SoftPrompt.from_vocabulary(model, settings.tokens, settings.seed)
    optimizer = torch.optim.AdamW(prompt.parameters(), lr=settings.lr)
    report = PromptReport(settings, samples.shape[0], samples.shape[1])
    state_file = out / STATE
    if state_file.exists():
        state = torch.load(state_file, weights_only=True)
        if {**state["settings"], "steps": settings.steps} != asdict(settings):
            raise SparsegenError(f"{state_file} was written with other settings; delete it or use another --out")
        prompt.load_state_dict(state["prompt"])
        optimizer.load_state_dict(state["optimizer"])
        report.losses, report.seconds = state["losses"], state["seconds"]
    order = torch.randperm(samples.shape[0], generator=torch.Generator().manual_seed(settings.seed))
    bar = tqdm(total=settings.steps, initial=len(report.losses), desc="soft prompt", unit="step", disable=not progress)
    while len(report.losses) < settings.steps:
        started = time.perf_counter()
        step = len(report.losses)
        picks = [int(order[(step * settings.batch + i) % len(order)]) for i in range(settings.batch)]
        loss = prompt_loss(model, prompt, samples[picks], teacher, settings.distill)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        report.losses.append(loss.item())
        report.seconds += time.perf_counter() - started
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if len(report.losses) % settings.checkpoint_every == 0 or len(report.losses) == settings.steps:
            _checkpoint(state_file, prompt, optimizer, report)
    bar.close()
    prompt.save(out, model, base_model)
    _write_curve(out, report)
    return prompt, report


def _checkpoint(path: Path, prompt: SoftPrompt, optimizer, report: PromptReport) -> None:
    state = {
        "settings": asdict(report.settings),
        "prompt": prompt.state_dict(),
        "optimizer": optimizer.state_dict(),
        "losses": report.losses,
        "seconds": report.seconds,
    }
    save_torch(path, state)


def _write_curve(out: Path, report: PromptReport) -> None:
    from sparsegen.report import plot_lines, running_mean

    write_json(out / "training.json", asdict(report))
    width = max(1, len(report.losses) // 40)
    plot_lines(
        {
            "loss": (list(range(len(report.losses))), report.losses),
            f"mean of {width}": running_mean(report.losses, width),
        },
        out / "loss.png",
        "step",
        "loss",
        title=f"soft prompt: {report.settings.tokens} tokens, {report.samples} samples x {report.seqlen}",
    )
