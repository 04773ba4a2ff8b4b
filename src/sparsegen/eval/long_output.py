"""Fidelity while the model writes: each KV policy against the full cache along the full cache's own output.

Reasoning and code models write thousands of tokens, and a policy that evicts while decoding
decides on what the model itself wrote, not on a text it read. Here the full cache writes `tokens`
greedy tokens after a prompt; every policy's decoder is fed that same output token by token (teacher
forcing on the one token loop, `Decoder.step`), in lockstep with the full cache's, and at every
position its next-token distribution is compared with the full cache's: top-1 agreement (its
choice equals the token the full cache wrote) and KL(full || policy). No output is stored: the
full cache's distribution at a position is compared while both are at that position.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparsegen.decode import Decoder
from sparsegen.errors import SparsegenError
from sparsegen.few_rows import pack_weights
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.policy import make_policy

SEGMENT = 512
"""Positions per point of the agreement-along-the-output curve."""


@dataclass
class Following:
    """One policy's decoder following the full cache's output, and its running comparison."""

    label: str
    decoder: Decoder
    logits: torch.Tensor
    agree: list[bool] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)

    def compare(self, reference: torch.Tensor, token: int) -> None:
        """Score this position against the full cache's log-probabilities and the token it wrote."""
        mine = self.logits[0].double().log_softmax(-1)
        self.agree.append(int(mine.argmax()) == token)
        self.kl.append(float((reference.exp() * (reference - mine)).sum()))

    def summary(self, segment: int) -> dict:
        count = len(self.agree)
        segments = [slice(start, min(start + segment, count)) for start in range(0, count, segment)]
        return {
            "policy": self.label,
            "agreement": sum(self.agree) / count,
            "kl_mean": sum(self.kl) / count,
            "agreement_last_quarter": _mean(self.agree[count - count // 4 :]),
            "agreement_by_segment": [_mean(self.agree[s]) for s in segments],
            "kl_by_segment": [_mean(self.kl[s]) for s in segments],
        }


def _mean(values: list) -> float:
    return sum(values) / len(values) if values else math.nan


@torch.inference_mode()
def follow_full_output(
    model: torch.nn.Module,
    prompt: list[int],
    tokens: int,
    policies: dict[str, dict],
    segment: int = SEGMENT,
    compile: str = "never",
    tick: Callable[[], None] | None = None,
) -> tuple[list[int], list[dict]]:
    """The full cache's `tokens` greedy tokens after `prompt`, and for each policy of `policies`
    (label: {"policy": name, **budget}) its agreement and KL along them, per `segment` positions."""
    packed = pack_weights(model)  # the few-row kernel's copy of the weights, one for every decoder
    full = Decoder(model, "full", compile=compile, packed=packed)
    followers: list[Following] = []
    try:
        with policy_attention(model):
            full_logits = full.start([prompt], tokens)
            for label, settings in policies.items():
                decoder = Decoder(model, make_policy(**settings), compile=compile, packed=packed)
                followers.append(Following(label, decoder, decoder.start([prompt], tokens)))
            written = _follow(full, full_logits, followers, tokens, tick)
    finally:  # a compiled decoder changed the model's Linear layers: given back
        for decoder in [full, *(follower.decoder for follower in followers)]:
            decoder.release()
    return written, [follower.summary(segment) for follower in followers]


def _follow(full: Decoder, logits: torch.Tensor, followers: list[Following], tokens: int, tick) -> list[int]:
    """Write `tokens` greedy tokens with the full cache, every follower fed each one in lockstep."""
    written: list[int] = []
    for _ in range(tokens):
        reference = logits[0].double().log_softmax(-1)
        token = int(reference.argmax())
        for follower in followers:
            follower.compare(reference, token)
        written.append(token)
        fed = torch.tensor([token])
        logits = full.step(fed)
        for follower in followers:
            follower.logits = follower.decoder.step(fed)
        if tick is not None:
            tick()
    return written


DECODING_POLICIES = ("window", "streaming", "h2o", "streaming_h2o", "tova", "rkv", "triattention")
"""The policies that evict while decoding (the prompt-compressing ones keep every new token)."""
CODE_REQUEST = (
    "Write a complete, well-documented Python module for a small inventory system: classes for items, "
    "warehouses and orders, persistence to JSON, a command-line interface, and unit tests for every class."
)


def long_output_prompt(tokenizer, kind: str, text: str) -> list[int]:
    """`text`: the opening of a text to continue (128 tokens); `code`: a request for a long
    program, in the model's chat template where it has one."""
    from sparsegen.data import load_text

    if kind == "text":
        return tokenizer(load_text(text), add_special_tokens=False)["input_ids"][:128]
    if kind != "code":
        raise SparsegenError(f"--prompt must be text or code, got {kind!r}")
    if getattr(tokenizer, "chat_template", None):  # rendered, then tokenized: ids whatever the template call returns
        messages = [{"role": "user", "content": CODE_REQUEST}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return tokenizer(f"# {CODE_REQUEST}\n", add_special_tokens=False)["input_ids"]


COLUMNS = [
    ("policy", "policy"),
    ("budget", "KV budget (tokens)"),
    ("agreement", "top-1 agreement"),
    ("agreement_last_quarter", "agreement, last quarter"),
    ("kl_mean", "mean KL (nats)"),
]


def long_output(
    model_name: str,
    prompt_kind: str = "text",
    tokens: int = 2048,
    share: float = 0.25,
    policies: tuple[str, ...] = DECODING_POLICIES,
    text: str = "shakespeare",
    out: Path = Path("results/long_output"),
    compile: str = "never",
    device: str | None = None,
    centres: Path | None = None,
    compress_every: int = 1,
) -> dict:
    """Each policy at a budget of `share` of `tokens` against the full cache along its output;
    writes `long_output.json`, `.md` and `.png` into `out` (a finished run of the same settings is
    read back, not run again). TriAttention reads its query centres from `centres`, else from
    2,048 tokens of `text` (`out/centres.json`, said). `compress_every` > 1 evicts that many tokens
    every that many steps (kvpress's decoding protocol), holding up to the budget + that - 1."""
    from tqdm.auto import tqdm

    from sparsegen.loading import load
    from sparsegen.report import run_meta
    from sparsegen.sampling import stop_tokens

    budget = max(1, round(share * tokens))
    every = {"compress_every": compress_every} if compress_every > 1 else {}  # (older runs' settings read back)
    settings = {"model": model_name, "prompt": prompt_kind, "tokens": tokens, "budget": budget}
    settings |= {"policies": list(policies), "centres": None if centres is None else str(centres), **every}
    done = out / "long_output.json"
    if done.exists() and (previous := _read(done)).get("settings") == settings:
        return previous
    runs = {name: {"policy": name, "budget": budget, **every} for name in policies}
    for run in runs.values():  # a bad policy or setting fails here, before the model loads
        make_policy(**run)
    model, tokenizer = load(model_name, device=device)
    prompt = long_output_prompt(tokenizer, prompt_kind, text)
    if "triattention" in runs:
        runs["triattention"]["centres"] = str(centres or _calibrated_centres(model, tokenizer, text, model_name, out))
    with tqdm(total=tokens, unit="tok", desc=f"following the full cache with {len(runs)} policies") as bar:
        written, rows = follow_full_output(model, prompt, tokens, runs, compile=compile, tick=bar.update)
    rows = [{**row, "budget": budget} for row in rows]
    stops = stop_tokens(model, tokenizer)  # the full cache writes on past its answer's end: said where that is
    result = {
        "settings": settings,
        "meta": run_meta(prompt_tokens=len(prompt)),
        "rows": rows,
        "first_stop_token_at": next((i for i, token in enumerate(written) if token in stops), None),
        "output_preview": tokenizer.decode(written[:200]),
        "written": written,
    }
    every_said = f", evicting every {compress_every} steps" if every else ""
    _write_run(out, result, f"{model_name}: {tokens} written tokens, KV budget {budget} ({share:.0%}){every_said}")
    return result


def _write_run(out: Path, result: dict, title: str) -> None:
    """`long_output.json` (atomically), its table as `.md` and the agreement along the output as `.png`."""
    from sparsegen.ioutil import write_json, write_text
    from sparsegen.report import markdown_table, plot_lines

    rows = result["rows"]
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "long_output.json", result)
    write_text(out / "long_output.md", f"# {title}\n\n" + markdown_table(rows, COLUMNS))
    series = {
        row["policy"]: (
            [(i + 0.5) * SEGMENT for i in range(len(row["agreement_by_segment"]))],
            row["agreement_by_segment"],
        )
        for row in rows
    }
    plot_lines(series, out / "long_output.png", "written tokens", "top-1 agreement with the full cache", title)


def _calibrated_centres(model, tokenizer, text: str, model_name: str, out: Path) -> Path:
    """TriAttention's query centres from 2,048 tokens of `text`, written to `out/centres.json`."""
    import sys

    from tqdm.auto import tqdm

    from sparsegen.data import load_text
    from sparsegen.eval.calibrate_heads import query_centres, save_centres

    path = out / "centres.json"
    ids = tokenizer(load_text(text), add_special_tokens=False)["input_ids"][:2048]
    save_centres(*query_centres(model, ids), path, model_name, text)
    tqdm.write(f"triattention: query centres from {len(ids)} tokens of {text} -> {path}", file=sys.stderr)
    return path


def _read(path: Path) -> dict:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
