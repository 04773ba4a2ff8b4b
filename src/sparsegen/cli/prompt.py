"""`sparsegen prompt ...`: learn and evaluate soft prompts for a compressed model."""

from __future__ import annotations

from pathlib import Path

import typer

from sparsegen.cli.common import DeviceOpt, ModelOpt, out, prompt_app


@prompt_app.command("train")
def prompt_train_command(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text", help="Embedded text name or a .txt file to learn from."),
    tokens: int = typer.Option(100, "--tokens", help="Virtual tokens."),
    steps: int = typer.Option(200, "--steps"),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate."),
    batch: int = typer.Option(1, "--batch"),
    n_samples: int = typer.Option(400, "--n-samples", help="Training samples drawn from the text."),
    seqlen: int = typer.Option(1024, "--seqlen", help="Tokens per sample."),
    distill: float = typer.Option(
        0.0, "--distill", help="Weight of the KL to --teacher's logits (0 = next-token loss)."
    ),
    teacher: str | None = typer.Option(None, "--teacher", help="The dense model to distil from."),
    seed: int = typer.Option(0, "--seed"),
    out_dir: Path = typer.Option(..., "--out", help="Prompt folder (peft format); the same command resumes it."),
    device: str | None = DeviceOpt,
) -> None:
    """Learn a soft prompt for a (compressed) model; progress bar, loss curve, resumable."""
    from sparsegen.data import calibration_samples, load_text
    from sparsegen.loading import load
    from sparsegen.prompt import PromptTraining, train_prompt

    loaded, tokenizer = load(model, packed=False, device=device)  # changes or trains on float weights
    samples = calibration_samples(tokenizer, load_text(text), n_samples, seqlen, seed)
    settings = PromptTraining(tokens=tokens, steps=steps, lr=lr, batch=batch, distill=distill, seed=seed)
    teacher_model = load(teacher, dtype=loaded.dtype, device=device)[0] if teacher else None  # as the student
    _, report = train_prompt(loaded, samples, out_dir, settings, teacher=teacher_model, base_model=model)
    tail = report.losses[-min(20, len(report.losses)) :]
    out.print(
        f"{tokens} virtual tokens, {len(report.losses)} steps in {report.seconds:.0f} s; "
        f"loss {report.losses[0]:.3f} -> {sum(tail) / len(tail):.3f} (mean of the last {len(tail)}) -> {out_dir}"
    )


@prompt_app.command("eval")
def prompt_eval_command(
    prompt_file: Path = typer.Argument(..., help="Soft prompt folder."),
    model: str = ModelOpt,
    text: str = typer.Option("milton", "--text", help="Embedded text name or a .txt file."),
    seqlen: int = typer.Option(1024, "--seqlen"),
    max_windows: int | None = typer.Option(16, "--max-windows"),
    json_out: Path | None = typer.Option(None, "--json"),
    device: str | None = DeviceOpt,
) -> None:
    """Windowed perplexity of MODEL on TEXT without and with the soft prompt."""
    from sparsegen.data import load_text, tokenize_long
    from sparsegen.eval.perplexity import prompted_ppl
    from sparsegen.ioutil import write_json
    from sparsegen.loading import load
    from sparsegen.prompt import SoftPrompt

    loaded, tokenizer = load(model, device=device)
    soft = SoftPrompt.load(prompt_file, loaded)
    ids = tokenize_long(tokenizer, load_text(text))
    plain = prompted_ppl(loaded, None, ids, seqlen, max_windows)
    prompted = prompted_ppl(loaded, soft, ids, seqlen, max_windows)
    out.print(
        f"{text}, {plain.windows} windows x {seqlen}: perplexity {plain.ppl:.3f} without the prompt, "
        f"{prompted.ppl:.3f} with it"
    )
    if json_out is not None:
        write_json(
            json_out,
            {
                "model": model,
                "prompt": str(prompt_file),
                "text": text,
                "plain": plain.summary(),
                "prompted": prompted.summary(),
            },
        )
