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


# Independent random streams per (seed, output index). Stream 0 samples the target's token (the only one
# used without speculation); the others serve speculative decoding.
STREAM_TARGET, STREAM_RESIDUAL, STREAM_ACCEPT, STREAM_DRAFT = 0, 1, 2, 3
_STREAM_SHIFT = 1 << 40  # output indices stay far below this


def _key(seeds: torch.Tensor, steps: torch.Tensor, stream: int) -> torch.Tensor:
    # [R] int64 key of (seed, step, stream); the inner mix decorrelates seed from step.
    return _mix64(_mix64(seeds + _GOLDEN) + (steps + stream * _STREAM_SHIFT) * _GOLDEN)


def _unit(bits: torch.Tensor) -> torch.Tensor:
    # Top 53 bits -> u = (m + 0.5) / 2**53, exact in float64 and strictly inside (0, 1).
    return (_shr(bits, 11).to(torch.float64) + 0.5) * (2.0**-53)


def _exponentials(seeds: torch.Tensor, steps: torch.Tensor, vocab: int, stream: int = STREAM_TARGET) -> torch.Tensor:
    # seeds, steps: [R] int64 -> [R, V] float32 i.i.d. Exp(1), a pure function of (seed, step, stream, index).
    key = _key(seeds, steps, stream)
    idx = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    bits = _mix64(key[:, None] + idx[None, :] * _GOLDEN)  # [R, V]: splitmix64 stream of that key
    return (-torch.log(_unit(bits))).to(torch.float32)  # u in (0, 1), so E is finite and > 0


def _uniforms(seeds: torch.Tensor, steps: torch.Tensor, stream: int) -> torch.Tensor:
    # [R] float64 uniform in (0, 1), a pure function of (seed, step, stream).
    return _unit(_mix64(_key(seeds, steps, stream) + _GOLDEN))


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


def _is_greedy(p: SamplingParams) -> bool:
    return p.is_greedy or p.temperature < _MIN_TEMPERATURE


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[R, V] float32 logits -> the distribution each row samples from: temperature, top-k and top-p applied;
    a greedy row is one-hot on its argmax (so speculative rejection sampling treats both alike)."""
    probs = torch.zeros_like(logits)
    greedy = [i for i, p in enumerate(params) if _is_greedy(p)]
    sampled = [i for i, p in enumerate(params) if not _is_greedy(p)]
    if greedy:
        g = torch.tensor(greedy, dtype=torch.long, device=logits.device)
        probs[g, logits[g].argmax(dim=-1)] = 1.0
    if sampled:
        r = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        sub = [params[i] for i in sampled]
        temp = torch.tensor([p.temperature for p in sub], dtype=torch.float32, device=logits.device)
        scaled = logits[r] / temp[:, None]
        drop = _drop_mask(scaled, [p.top_k for p in sub], [p.top_p for p in sub])
        if drop is not None:
            scaled = scaled.masked_fill(drop, float("-inf"))
        probs[r] = torch.softmax(scaled, dim=-1)  # dropped tokens get exactly 0 and can never win
    return probs


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
        b = logits.shape[0]
        if seeds.shape != (b,) or steps.shape != (b,):
            raise ValueError(f"seeds and steps must be [{b}], got {tuple(seeds.shape)}, {tuple(steps.shape)}.")
        logits = logits.float()
        tokens, _ = self.sample(logits, params, seeds, steps)
        return self.with_logprobs(logits, tokens, params)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeds: torch.Tensor,
        steps: torch.Tensor,
        stream: int = STREAM_TARGET,
        want_probs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, V] float32 -> ([B] token ids, the [B, V] distributions sampled from if want_probs). Greedy rows
        take the argmax; the others race exponentials of their (seed, step, stream)."""
        dev = logits.device
        tokens = logits.argmax(dim=-1)  # every row (cheap); sampled rows are overwritten below
        rows = [i for i, p in enumerate(params) if not _is_greedy(p)]
        probs = processed_probs(logits, params) if want_probs else None
        if rows:
            ridx = torch.tensor(rows, dtype=torch.long, device=dev)
            sub_probs = probs[ridx] if probs is not None else processed_probs(logits[ridx], [params[i] for i in rows])
            race = sub_probs / _exponentials(
                seeds.to(dev, torch.int64)[ridx], steps.to(dev, torch.int64)[ridx], logits.shape[1], stream
            )
            tokens = tokens.index_copy(0, ridx, race.argmax(dim=-1))
        return tokens, probs

    def verify(
        self,
        logits: torch.Tensor,  # [R, V] float32: the target's logits at every verified row
        params: Sequence[SamplingParams],  # per row
        seeds: torch.Tensor,  # [R]
        steps: torch.Tensor,  # [R]: output index each row predicts
        drafts: torch.Tensor,  # [R] int64: the draft token proposed for the row's index, -1 for a bonus row
        draft_probs: torch.Tensor | None,  # [R, V]: the distribution each draft was sampled from; None = point mass
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative verification, row by row: ([R] bool accepted, [R] int64 token to emit if the row is the
        first not accepted). A draft d is accepted with probability min(1, p(d) / q(d)); a rejected row emits
        a sample of normalised max(p - q, 0), a bonus row a sample of p. With greedy requests p is one-hot, so
        this is 'accept iff d is the argmax'. The caller emits, per sequence, its leading accepted drafts and
        then the emit token of the first row not accepted; the output is distributed exactly as the target."""
        dev = logits.device
        if all(_is_greedy(p) for p in params):  # accept iff the draft is the argmax, else emit the argmax
            target = logits.argmax(dim=-1)
            return (drafts >= 0) & (drafts == target), target
        seeds, steps = seeds.to(dev, torch.int64), steps.to(dev, torch.int64)
        p = processed_probs(logits, params)
        has_draft = drafts >= 0
        d = drafts.clamp(min=0)
        rows = torch.arange(logits.shape[0], device=dev)
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[rows, d] = has_draft.to(p.dtype)
        else:
            q = draft_probs.float() * has_draft[:, None]
        p_d, q_d = p[rows, d], q[rows, d]
        u = _uniforms(seeds, steps, STREAM_ACCEPT)
        accepted = has_draft & (u * q_d.double() < p_d.double())  # u < p/q without dividing by q = 0
        residual = (p - q).clamp(min=0)
        empty = residual.sum(dim=-1) <= 0  # p == q exactly: any rejection is impossible, keep a valid row
        residual = torch.where((empty | ~has_draft)[:, None], p, residual)
        # A bonus row races the target stream, exactly as without speculation; a rejected row its own stream.
        # (Greedy rows come out as the argmax either way: a one-hot p's residual is p itself.)
        vocab = logits.shape[1]
        e_target = _exponentials(seeds, steps, vocab, STREAM_TARGET)
        e_residual = _exponentials(seeds, steps, vocab, STREAM_RESIDUAL)
        emit = (residual / torch.where(has_draft[:, None], e_residual, e_target)).argmax(dim=-1)
        return accepted, emit

    @staticmethod
    def with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]) -> SamplerOutput:
        """Logprobs of `tokens` (and the top-k) under log_softmax of the raw logits, as vLLM reports them."""
        want = [p.logprobs for p in params if p.logprobs is not None]
        if not want:
            return SamplerOutput(tokens, None, None, None)
        logp = torch.log_softmax(logits, dim=-1)
        tok_lp = logp.gather(1, tokens[:, None]).squeeze(1)
        k = min(max(want), logits.shape[1])
        if k == 0:
            return SamplerOutput(tokens, tok_lp, None, None)
        top_lp, top_ids = logp.topk(k, dim=-1)  # sorted descending
        return SamplerOutput(tokens, tok_lp, top_ids, top_lp)
