"""TriAttention (Mao et al. 2026, "TriAttention: Efficient Long Reasoning with Trigonometric KV
Compression"): while the model writes, keep the keys the queries still to come will attend to,
predicted from where a head's queries sit before RoPE, without an attention matrix.

RoPE turns each pair of dimensions (i, i + r/2 of the r rotary ones) as one complex number, band f
at frequency w_f. Before RoPE a head's queries cluster about a centre m (per band). A query at
position t is then about m turned to t, so the logit it gives a held key k (as attention saw it,
turned to its own position) is a trigonometric series in t: sum_f Re(m_f e^{i w_f t} conj(k_f)),
plus the unrotated dimensions' plain product. Averaged over the future distances 1, 2, 4, ...,
`future` from the newest query, that is one dot product with an effective query. The queries'
spread about the centre adds sum_f (E|q_f| - |m_f|) |k_f|: a key with large bands gains from
queries pointing any way. Each query head's scores become attention over the competing keys
(softmax at the layer's scaling), averaged over its KV head's group; the sinks and the `recent`
newest always stay. Scores are recomputed every step (the distances move).

The centres come from a calibration (`eval.calibrate_heads.query_centres`, `sparsegen eval
calibrate-centres`, given as `centres=`), as the paper's offline statistics; without one, from
the call's own queries: the prompt's while it is read, the newest query alone while decoding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv.policy import KEEP, Policy, register_policy


def band_statistics(pre: torch.Tensor, rotary: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries before RoPE [..., n, d] -> their mean [..., d] and each band's mean magnitude
    [..., rotary / 2] (the `rotary` first dimensions pair as i, i + rotary / 2)."""
    half = rotary // 2
    magnitude = torch.hypot(pre[..., :half], pre[..., half:rotary]).mean(-2)
    return pre.mean(-2), magnitude


def future_turn(inv_freq: torch.Tensor, newest: torch.Tensor, future: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's angles averaged over positions newest + 1, 2, 4, ..., `future`:
    newest [...] -> [..., bands] each."""
    distances = 2.0 ** torch.arange(future.bit_length(), device=inv_freq.device, dtype=torch.float64)
    angles = (newest.double()[..., None, None] + distances[:, None]) * inv_freq.double()
    return angles.cos().mean(-2).float(), angles.sin().mean(-2).float()


def predicted_logits(keys: torch.Tensor, mean: torch.Tensor, magnitude: torch.Tensor, cos, sin) -> torch.Tensor:
    """The trigonometric score of every held key for each query head: keys [b, hkv, n, d], mean
    [b, hq, d] (before RoPE), magnitude [b, hq, bands], cos/sin [b, 1, bands] -> [b, hkv, group, n]."""
    b, hkv, n, d = keys.shape
    hq, half = mean.shape[1], magnitude.shape[-1]
    real, imag, rest = mean[..., :half], mean[..., half : 2 * half], mean[..., 2 * half :]
    effective = torch.cat([real * cos - imag * sin, real * sin + imag * cos, rest], -1)  # m e^{i w t}, averaged
    spread = (magnitude - torch.hypot(real, imag)).clamp_min(0)
    keys = keys.float()
    key_bands = torch.hypot(keys[..., :half], keys[..., half : 2 * half])
    grouped = effective.view(b, hkv, hq // hkv, d)
    logits = torch.einsum("bknd,bkgd->bkgn", keys, grouped)
    return logits + torch.einsum("bknf,bkgf->bkgn", key_bands, spread.view(b, hkv, hq // hkv, half))


@register_policy
@dataclass
class TriAttentionPolicy(Policy):
    """Sinks + the keys future queries are predicted to attend to (pre-RoPE centres) + the newest (TriAttention)."""

    name = "triattention"
    reads_keys = True

    sinks: int = 4
    """First tokens, never evicted (and left out of a prompt's query statistics)."""
    heavy: int | float = 124
    """Tokens kept by their predicted attention: a count, or a share of the prompt."""
    recent: int | float = 128
    """Newest tokens kept: a count, or a share of the prompt."""
    future: int = 4096
    """The farthest future distance scored (distances 1, 2, 4, ... up to it)."""
    centres: str | None = None
    """JSON of `sparsegen eval calibrate-centres` (the queries' centres per layer and head); None:
    the call's own queries."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.future < 1:
            raise SparsegenError(f"triattention future must be >= 1, got {self.future}")
        self._calibrated = None
        if self.centres is not None:
            path = Path(self.centres)
            if not path.is_file():
                raise SparsegenError(f"triattention centres file {path} not found: make it with calibrate-centres")
            saved = json.loads(path.read_text())
            self._calibrated = (torch.tensor(saved["mean"]), torch.tensor(saved["magnitude"]))

    def statistics(self, step) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries' mean before RoPE [b, hq, d] and band magnitudes [b, hq, bands]: calibrated, or this call's."""
        b, hq, _, d = step.query.shape
        if self._calibrated is not None:
            mean, magnitude = self._calibrated
            if step.layer >= mean.shape[0] or mean.shape[1:] != (hq, d):
                where = f"layer {step.layer}, {hq} heads"
                raise SparsegenError(f"{self.centres} was calibrated for another model ({where})")
            device = step.query.device
            return mean[step.layer].to(device).expand(b, hq, d), magnitude[step.layer].to(device).expand(b, hq, -1)
        return band_statistics(step.queries_before_rope(self.sinks), step.rope.rotary_dim)

    def score(self, step):
        if step.rope is None:
            raise SparsegenError("triattention needs the model's RoPE frequencies: make the cache with make_cache")
        if step.keys is None:
            raise SparsegenError("triattention scores the held keys: they must be read as numbers while decoding")
        mean, magnitude = self.statistics(step)
        newest = torch.as_tensor(step.seen, device=step.query.device).view(-1, 1) - 1
        cos, sin = future_turn(step.rope.inv_freq.to(step.query.device), newest, self.future)
        logits = predicted_logits(step.keys, mean, magnitude, cos, sin) * step.scaling
        kept = step.is_sink() | step.is_recent() if step.sizes is not None else step.positions < 0
        competing = (step.positions >= 0) & ~kept
        logits = logits.masked_fill(~competing[:, :, None], float("-inf"))
        return logits.softmax(-1).nan_to_num(0.0).mean(2)

    def priority(self, step):
        return step.scores.masked_fill(step.is_sink() | step.is_recent(), KEEP)
