"""Expected Attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating
Attention from Future Queries Distribution"): once the prompt is read, keep the keys that the
queries still to come are expected to attend to, without seeing those queries.

The prompt's queries (before RoPE, the sinks left out) are modelled as one Gaussian per query head
(mean mu, covariance S). A query at a future position t is that Gaussian rotated by RoPE's R_t;
averaged over the next `future` positions the rotation is R = mean_t R_t. For a Gaussian query
q ~ N(R mu, R S R^T), E[exp(s q.k)] = exp(s k.R mu + s^2/2 k^T R S R^T k) (s the attention
scaling): normalised over the held keys, that is each key's expected attention. It is averaged
over each KV head's query group and, with `value_norm`, weighted by the value's norm (a key that
moves the output little matters little). The sinks are always kept. Decoding then keeps every new
token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv.policy import KEEP, Policy, register_policy
from sparsegen.kv.rope import rotate_half


def mean_rotation(inv_freq: torch.Tensor, start: int, count: int, head_dim: int) -> torch.Tensor:
    """The average of RoPE's rotation matrices over positions start..start+count-1 [d, d]."""
    angles = torch.arange(start, start + count, dtype=torch.float64)[:, None] * inv_freq.double().cpu()
    cos, sin = angles.cos().mean(0), angles.sin().mean(0)
    rotary = 2 * cos.numel()  # dimensions past the rotary ones are not rotated
    c = torch.cat([cos, cos, torch.ones(head_dim - rotary, dtype=torch.float64)])
    s = torch.cat([sin, sin, torch.zeros(head_dim - rotary, dtype=torch.float64)])
    half_turn = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    half_turn[:rotary, :rotary] = rotate_half(torch.eye(rotary, dtype=torch.float64)).T  # @ x == rotate_half(x)
    return (torch.diag(c) + torch.diag(s) @ half_turn).float()


@register_policy
@dataclass
class ExpectedAttentionPolicy(Policy):
    """Compress the prompt once, keeping the keys future queries are expected to attend to."""

    name = "expected_attention"
    prefill_only = True

    sinks: int = 4
    """First tokens, never evicted (and left out of the query statistics)."""
    heavy: int | float = 252
    """Prompt tokens kept by expected attention: a count, or a share of the prompt."""
    future: int = 512
    """How many positions after the prompt the future queries are averaged over."""
    covariance: bool = True
    """Use the queries' covariance (else their mean only)."""
    value_norm: bool = True
    """Weight each key's expected attention by its value's norm."""
    epsilon: float = 0.0
    """Added to the expected attention before the value-norm weighting."""

    def score(self, step):
        if step.rope is None:
            raise SparsegenError(
                "expected_attention needs the model's RoPE frequencies: make the cache with make_cache"
            )
        b, hq, _, d = step.query.shape
        hkv = step.keys.shape[1]
        queries = step.queries_before_rope(self.sinks)
        rotation = mean_rotation(step.rope.inv_freq, int(step.seen), self.future, d).to(queries.device)
        mean = queries.mean(2) @ rotation.T  # [b, hq, d]
        keys = step.keys.float()
        grouped_mean = mean.view(b, hkv, hq // hkv, d)
        logits = torch.einsum("bknd,bkgd->bkgn", keys, grouped_mean) * step.scaling
        if self.covariance:
            centred = queries - queries.mean(2, keepdim=True)
            spread = rotation @ (centred.transpose(-1, -2) @ centred / centred.shape[2]) @ rotation.T
            spread = spread.view(b, hkv, hq // hkv, d, d)
            quadratic = torch.einsum("bknd,bkgde,bkne->bkgn", keys, spread, keys)
            logits = logits + 0.5 * step.scaling**2 * quadratic
        sinks = step.is_sink() if step.sizes is not None else step.positions < self.sinks  # a pinned prefix alone
        logits = logits.masked_fill(sinks[:, :, None], float("-inf"))
        expected = logits.softmax(-1).nan_to_num(0.0).mean(2)  # nothing but sinks: nothing expected
        if self.value_norm:
            expected = (expected + self.epsilon) * step.values.float().norm(dim=-1)
        return expected

    def priority(self, step):
        return step.scores.masked_fill(step.is_sink(), KEEP)
