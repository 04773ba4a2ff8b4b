"""Streaming perplexity (StreamingLLM's protocol) for several KV policies in lockstep.

The text is fed `chunk` tokens at a time (chunk=1 is exact token-by-token streaming); every policy
sees the same chunk, so fidelity to the full cache (KL divergence, top-1 agreement) is measured on
the fly without storing logits. Per-token NLLs are appended to one plain file per policy as they
are computed, and the caches are checkpointed, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import math
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from sparsegen.errors import SparsegenError
from sparsegen.ioutil import save_torch
from sparsegen.kv import Policy, PolicyCache, make_cache
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.spec import KVSpec

RECOMPUTE = "recompute"


@dataclass
class PolicyRun:
    """One configuration under evaluation.

    `kv` is the KV spec the stream is read under (a bare policy name: that policy at its
    defaults), or None for the sliding window with re-computation baseline (`RECOMPUTE`), where
    every token re-encodes its last `window` tokens from scratch. `max_tokens` stops this run
    early (the full cache stops at the model's pretrained window).
    """

    label: str
    kv: KVSpec | str | None
    max_tokens: int | None = None
    window: int = 0
    note: str = ""

    def __post_init__(self) -> None:
        self.kv = None if self.kv is None else KVSpec.coerce(self.kv)


@dataclass
class StreamResult:
    label: str
    policy: str
    position: str | None
    chunk: int
    tokens: int
    ppl: float
    window: int
    window_ppl: list[float]
    kv_mb: float
    tokens_per_s: float
    kl: float | None = None
    top1: float | None = None
    fidelity_tokens: int = 0
    note: str = ""
    nll_file: str | None = None
    kv: dict | None = None
    """The run's KV spec as `KVSpec.to_dict` records it (None: the recompute baseline)."""
    nll: Sequence[float] = field(default_factory=list, repr=False)

    def ppl_between(self, start: int, stop: int | None = None) -> float:
        """Perplexity over scored tokens [start, stop) of the stream."""
        part = self.nll[start:stop]
        return math.exp(sum(part) / len(part)) if part else float("nan")

    def summary(self) -> dict:
        data = asdict(self)
        data.pop("nll")
        return data


class _Runner:
    """State of one PolicyRun while streaming."""

    def __init__(self, model, run: PolicyRun) -> None:
        self.run = run
        self.recompute = run.kv is None
        if self.recompute and run.window < 1:
            raise SparsegenError("the recompute baseline needs window >= 1")
        self.cache: PolicyCache | None = None
        if not self.recompute:
            self.cache = make_cache(model, run.kv)
        self.nll = array("d")  # 8 bytes a token, not a float object's 32: a stream of millions stays flat
        self.seconds = 0.0
        self.kv_bytes = 0
        self.kl_sum = 0.0
        self.top1 = 0
        self.compared = 0

    def active(self, start: int) -> int:
        """How many of the next chunk's tokens this run still takes (0 once stopped)."""
        limit = self.run.max_tokens
        return 1 << 62 if limit is None else max(0, limit - start)

    def describe(self) -> str:
        if self.recompute:
            return f"recompute(window={self.run.window})"
        return self.cache.policy.describe()

    def state(self) -> dict:
        return {
            "cache": self.cache.state_dict() if self.cache is not None else None,
            "seconds": self.seconds,
            "kv_bytes": self.kv_bytes,
            "kl_sum": self.kl_sum,
            "top1": self.top1,
            "compared": self.compared,
        }

    def restore(self, state: dict, nll: list[float]) -> None:
        if self.cache is not None:
            self.cache.load_state_dict(state["cache"])
        for key in ("seconds", "kv_bytes", "kl_sum", "top1", "compared"):
            setattr(self, key, state[key])
        self.nll = array("d", nll)

    def step(self, model, ids: torch.Tensor, done: int, take: int) -> torch.Tensor:
        """Feed the next `take` tokens from `done`; record their NLLs; return their log-probs."""
        began = time.perf_counter()
        if self.recompute:
            logits = _recompute_logits(model, ids, done, take, self.run.window)
        else:
            tokens = ids[None, done : done + take]
            logits = model(input_ids=tokens, cache=self.cache, use_cache=True).logits[0]
            self.kv_bytes = max(self.kv_bytes, self.cache.kv_bytes())
        self.seconds += time.perf_counter() - began
        logp = logits.float().log_softmax(-1)
        nll = -logp.gather(-1, ids[done + 1 : done + 1 + take, None])[:, 0]
        self.nll.extend(nll.tolist())
        return logp

    def compare(self, reference_logp: torch.Tensor, logp: torch.Tensor) -> None:
        """Accumulate KL divergence and top-1 agreement against the reference's log-probs."""
        m = min(logp.shape[0], reference_logp.shape[0])
        ref = reference_logp[:m]
        self.kl_sum += (ref.exp() * (ref - logp[:m])).sum().item()
        self.top1 += (ref.argmax(-1) == logp[:m].argmax(-1)).sum().item()
        self.compared += m

    def result(self, chunk: int, window: int, nll_file: str | None) -> StreamResult:
        nll = self.nll
        windows = [math.exp(sum(nll[i : i + window]) / len(nll[i : i + window])) for i in range(0, len(nll), window)]
        return StreamResult(
            label=self.run.label,
            policy=self.describe(),
            position=None if self.recompute else self.cache.position,
            chunk=chunk,
            tokens=len(nll),
            ppl=math.exp(sum(nll) / len(nll)) if nll else float("nan"),
            window=window,
            window_ppl=windows,
            kv_mb=self.kv_bytes / 2**20,
            tokens_per_s=len(nll) / self.seconds if self.seconds else float("nan"),
            kl=self.kl_sum / self.compared if self.compared else None,
            top1=self.top1 / self.compared if self.compared else None,
            fidelity_tokens=self.compared,
            note=self.run.note,
            nll_file=nll_file,
            kv=None if self.recompute else self.run.kv.to_dict(),
            nll=nll,
        )


class _Checkpoint:
    """Per-run NLL files appended as the stream goes, and cache states saved every so often.

    `resume()` returns how many tokens a matching earlier checkpoint covered (0 otherwise) and
    truncates the NLL files to it; `save()` writes the checkpoint atomically.
    """

    def __init__(self, out: Path, runners: list[_Runner], fingerprint: str) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "stream_state.pt"
        self.runners, self.fingerprint = runners, fingerprint
        self.files = {r.run.label: out / f"nll_{r.run.label}.txt" for r in runners}
        self.handles: dict = {}

    def resume(self) -> int:
        done = 0
        if self.path.exists():
            saved = torch.load(self.path, weights_only=True)
            if saved["fingerprint"] == self.fingerprint:
                done = saved["done"]
                for runner in self.runners:
                    entry = saved["runners"][runner.run.label]
                    runner.restore(entry["state"], _read_nll(self.files[runner.run.label], entry["count"]))
        for runner in self.runners:  # truncate to what the checkpoint covers (or start afresh)
            self.files[runner.run.label].write_text("".join(f"{v:.6f}\n" for v in runner.nll))
        self.handles = {label: open(path, "a") for label, path in self.files.items()}  # noqa: SIM115
        return done

    def append(self, runner: _Runner, count: int) -> None:
        self.handles[runner.run.label].write("".join(f"{v:.6f}\n" for v in runner.nll[-count:]))

    def save(self, done: int) -> None:
        for handle in self.handles.values():
            handle.flush()
        runners = {r.run.label: {"state": r.state(), "count": len(r.nll)} for r in self.runners}
        save_torch(self.path, {"fingerprint": self.fingerprint, "done": done, "runners": runners})

    def close(self, finished: bool) -> None:
        for handle in self.handles.values():
            handle.close()
        if finished:
            self.path.unlink(missing_ok=True)


def _recompute_logits(model, ids: torch.Tensor, start: int, n: int, window: int, batch: int = 16) -> torch.Tensor:
    """Logits for positions start..start+n-1, each from a fresh forward over its last `window` tokens."""
    if start + n <= window:  # every token still sees the whole prefix: one causal forward
        return model(ids[None, : start + n]).logits[0, start:]
    rows = [model(ids[None, : t + 1]).logits[0, -1:] for t in range(start, min(start + n, window - 1))]
    full = range(max(start, window - 1), start + n)
    for lo in range(0, len(full), batch):
        windows = torch.stack([ids[t + 1 - window : t + 1] for t in full[lo : lo + batch]])
        rows.append(model(windows).logits[:, -1])
    return torch.cat(rows)


def _fingerprint(ids: torch.Tensor, runs: list[PolicyRun], chunk: int) -> str:
    digest = hashlib.sha256(ids.numpy().tobytes())
    settings = [(r.label, r.kv and r.kv.to_dict(), r.max_tokens, r.window) for r in runs]
    digest.update(repr(settings).encode())
    digest.update(str(chunk).encode())
    return digest.hexdigest()


def _read_nll(path: Path, count: int) -> list[float]:
    values = [float(line) for line in path.read_text().split()] if path.exists() else []
    if len(values) < count:
        raise SparsegenError(
            f"{path} holds {len(values)} values but the checkpoint needs {count}; delete the run folder"
        )
    return values[:count]


def _checked_labels(input_ids: torch.Tensor, runs: list[PolicyRun], chunk: int, reference: str | None) -> list[str]:
    """`stream_compare`'s arguments checked before any model work: the runs' labels, in order."""
    if input_ids.dim() != 1 or input_ids.numel() < 2:
        raise SparsegenError("stream evaluation needs a 1-D sequence of at least 2 tokens")
    if chunk < 1:
        raise SparsegenError("chunk must be >= 1")
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise SparsegenError(f"run labels must be unique: {labels}")
    if reference is not None and reference not in labels:
        raise SparsegenError(f"reference {reference!r} is not one of the runs {labels}")
    return labels


def _step_all(
    model,
    ids: torch.Tensor,
    runners: list[_Runner],
    done: int,
    n: int,
    reference: str | None,
    checkpoint: _Checkpoint | None,
) -> None:
    """The lockstep: the next `n` tokens from `done` through every run still going, each compared with
    the reference's log-probs (the reference runs first), their NLLs appended to the checkpoint."""
    reference_logp = None
    for runner in runners:
        take = min(n, runner.active(done))
        if take == 0:
            continue
        logp = runner.step(model, ids, done, take)
        if checkpoint is not None:
            checkpoint.append(runner, take)
        if runner.run.label == reference:
            reference_logp = logp
        elif reference_logp is not None:
            runner.compare(reference_logp, logp)


@torch.inference_mode()
def stream_compare(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    runs: list[PolicyRun],
    chunk: int = 1,
    reference: str | None = None,
    out_dir: str | Path | None = None,
    window: int = 1024,
    checkpoint_every: int = 4096,
    progress: bool = True,
    watch: Callable[[int], None] | None = None,
) -> dict[str, StreamResult]:
    """Stream `input_ids` (1-D) through every run in lockstep; return results by label.

    `reference` names the run (normally the full cache) that fidelity is measured against, over
    the tokens it covers. With `out_dir`, NLLs go to `nll_<label>.txt` as they are computed and a
    checkpoint lets an interrupted call resume with the same arguments. `watch(done)` is called
    after every chunk with the tokens streamed so far (a caller's probe of memory, say).
    """
    labels = _checked_labels(input_ids, runs, chunk, reference)
    ids = input_ids.to(next(model.parameters()).device)
    total = ids.numel() - 1  # tokens that have a next token to predict
    runners = [_Runner(model, run) for run in sorted(runs, key=lambda r: r.label != reference)]
    checkpoint = None
    done = 0
    if out_dir is not None:
        checkpoint = _Checkpoint(Path(out_dir), runners, _fingerprint(input_ids.cpu(), runs, chunk))
        done = checkpoint.resume()
    bar = tqdm(
        total=total, initial=done, unit="tok", desc=f"streaming {len(runs)} runs", disable=not progress, mininterval=2.0
    )
    try:
        with bar, policy_attention(model):  # the model's own attention again when the stream ends
            next_save = done + checkpoint_every
            while done < total:
                n = min(chunk, total - done)
                _step_all(model, ids, runners, done, n, reference, checkpoint)
                done += n
                bar.update(n)
                if watch is not None:
                    watch(done)
                if checkpoint is not None and next_save <= done < total:
                    checkpoint.save(done)
                    next_save = done + checkpoint_every
    finally:
        if checkpoint is not None:
            checkpoint.close(finished=done >= total)
    results = {
        r.run.label: r.result(chunk, window, checkpoint.files[r.run.label].name if checkpoint else None)
        for r in runners
    }
    return {label: results[label] for label in labels}


def stream_ppl(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    kv: KVSpec | str | Policy = "streaming",
    chunk: int = 1,
    out_dir: str | Path | None = None,
    window: int = 1024,
    progress: bool = True,
) -> StreamResult:
    """Streaming perplexity under the KV spec `kv` over `input_ids` (1-D), fed `chunk` tokens at a time."""
    kv = KVSpec.coerce(kv)
    run = PolicyRun(label=kv.name, kv=kv)
    return stream_compare(model, input_ids, [run], chunk=chunk, out_dir=out_dir, window=window, progress=progress)[
        run.label
    ]


def recompute_nll(model: torch.nn.Module, input_ids: torch.Tensor, window: int, chunk: int = 64) -> list[float]:
    """Per-token NLL of the sliding window with re-computation baseline (each token re-encodes its window)."""
    run = PolicyRun(label=RECOMPUTE, kv=None, window=window)
    return stream_compare(model, input_ids, [run], chunk=chunk, progress=False)[RECOMPUTE].nll
