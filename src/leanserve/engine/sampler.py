"""Batched token sampling: greedy, temperature, top-k, top-p, per-request reproducible randomness, logprobs.

Randomness is a pure function of (seed, step, vocab index), computed with a counter-based hash in vectorised
int64 ops, so a request's token does not depend on which other rows share the batch or on their order, and
no per-row torch.Generator is needed. Sampling uses the exponential race: argmax(p_i / E_i) with
E_i ~ Exp(1) i.i.d. picks token i with probability exactly p_i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from leanserve.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: dividing logits by them overflows to inf and softmax to NaN.
_MIN_TEMPERATURE = 1e-5


def _i64(c: int) -> int:
    # A 64-bit unsigned constant as the signed int64 with the same bits (torch has no uint64 arithmetic).
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    # Logical right shift on int64: torch's >> is arithmetic, so clear the sign-extended top s bits.
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    # splitmix64 finaliser; int64 multiply/add wrap modulo 2**64 in torch, matching the uint64 original.
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _exponentials(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    # seeds, steps: [R] int64 -> [R, V] float32 i.i.d. Exp(1), a pure function of (seed, step, vocab index).
    key = _mix64(_mix64(seeds + _GOLDEN) + steps * _GOLDEN)  # [R]; the inner mix decorrelates seed from step
    idx = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    bits = _mix64(key[:, None] + idx[None, :] * _GOLDEN)  # [R, V]: splitmix64 stream of that key
    # Top 53 bits -> u = (m + 0.5) / 2**53, exact in float64 and strictly inside (0, 1), so E is finite and > 0.
    u = (_shr(bits, 11).to(torch.float64) + 0.5) * (2.0**-53)
    return (-torch.log(u)).to(torch.float32)


def _drop_mask(scaled: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor | None:
    # scaled: [R, V] temperature-scaled logits -> [R, V] bool, True = filtered out by top-k / top-p, in vocab
    # order; None when no row filters. top_k outside [1, V) and top_p == 1 keep everything, and such rows get
    # an all-False mask row, so their distribution is bit-identical to the no-filter path.
    v = scaled.shape[1]
    dev = scaled.device
    ks = [k if 0 < k < v else v for k in top_ks]
    use_p = [p < 1.0 for p in top_ps]
    if not any(k < v for k in ks) and not any(use_p):
        return None  # the sort is the expensive step, so it only runs when some row filters
    s_logits, s_idx = scaled.sort(dim=-1, descending=True)  # [R, V]
    pos = torch.arange(v, device=dev)
    drop = pos[None, :] >= torch.tensor(ks, dtype=torch.long, device=dev)[:, None]  # sorted order
    if any(use_p):
        # Top-p over the top-k-renormalised distribution: keep sorted position i iff the mass strictly before
        # it is < top_p, i.e. the smallest prefix reaching top_p; position 0 always stays (0 < top_p).
        s_probs = torch.softmax(s_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = s_probs.cumsum(dim=-1) - s_probs
        top_p = torch.tensor(top_ps, dtype=torch.float32, device=dev)
        p_rows = torch.tensor(use_p, dtype=torch.bool, device=dev)
        # Rows with top_p == 1 are excluded explicitly: float32 cumsum can round `before` up to 1.0 in the tail.
        drop |= (before >= top_p[:, None]) & p_rows[:, None]
    return torch.zeros_like(drop).scatter_(1, s_idx, drop)  # back to vocab order


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # [B] float32: logprob of the sampled token under log_softmax of the raw (unmodified) logits;
    # None if no row asked for logprobs.
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None  # [B, K] int64, K = max requested logprobs (None if K == 0 or nobody asked)
    top_logprobs: torch.Tensor | None  # [B, K] float32, sorted descending along K


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeds: torch.Tensor,
        steps: torch.Tensor,
    ) -> SamplerOutput:
        # logits: [B, V]; seeds, steps: [B] int64 (steps = index of the output token being generated).
        if logits.dim() != 2 or len(params) != logits.shape[0]:
            raise ValueError(f"logits must be [B, V] with B == len(params), got {tuple(logits.shape)}.")
        b, v = logits.shape
        if seeds.shape != (b,) or steps.shape != (b,):
            raise ValueError(f"seeds and steps must be [{b}], got {tuple(seeds.shape)}, {tuple(steps.shape)}.")
        dev = logits.device
        logits = logits.float()

        # argmax of raw logits for every row (cheap); sampled rows are overwritten below.
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not (p.is_greedy or p.temperature < _MIN_TEMPERATURE)]
        if rows:
            sub = params if len(rows) == b else [params[i] for i in rows]
            ridx = torch.tensor(rows, dtype=torch.long, device=dev)
            sampled = self._sample(
                logits if len(rows) == b else logits.index_select(0, ridx),
                sub,
                seeds.to(dev, torch.int64).index_select(0, ridx),
                steps.to(dev, torch.int64).index_select(0, ridx),
            )
            tokens = tokens.index_copy(0, ridx, sampled)

        want = [p.logprobs for p in params if p.logprobs is not None]
        if not want:
            return SamplerOutput(tokens, None, None, None)
        logp = torch.log_softmax(logits, dim=-1)  # [B, V] raw model distribution, as in vLLM's default
        tok_lp = logp.gather(1, tokens[:, None]).squeeze(1)
        k = min(max(want), v)
        if k == 0:
            return SamplerOutput(tokens, tok_lp, None, None)
        top_lp, top_ids = logp.topk(k, dim=-1)  # sorted descending
        return SamplerOutput(tokens, tok_lp, top_ids, top_lp)

    @staticmethod
    def _sample(
        logits: torch.Tensor, params: Sequence[SamplingParams], seeds: torch.Tensor, steps: torch.Tensor
    ) -> torch.Tensor:
        # logits: [R, V] float32 of non-greedy rows only -> [R] int64 sampled token ids.
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
        scaled = logits / temp[:, None]

        drop = _drop_mask(scaled, [p.top_k for p in params], [p.top_p for p in params])
        if drop is not None:
            scaled = scaled.masked_fill(drop, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)  # [R, V]; dropped tokens get exactly 0 and can never win
        return (probs / _exponentials(seeds, steps, logits.shape[1])).argmax(dim=-1)
