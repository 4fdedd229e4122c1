"""The whole MoE of a step's tokens in three steps: routing (scores, top-k or hash); each expert's tokens through
its SwiGLU (its weights read once, as stored) and the shared expert's halves, spread over the cores; their sum."""

from __future__ import annotations

import math

import numpy as np

from leanserve.model.backends.cpu.kernels.base import (
    Threaded,
    _claim,
    _empty64_f32,
    _exp_jit,
    _inlined,
    _jit,
    _share_jit,
)
from leanserve.model.backends.cpu.kernels.linear import _linear_rows_jit
from leanserve.model.backends.cpu.kernels.quantized import _expert_rows, _matrix_rows
from leanserve.model.quant import FP8_BLOCK


# --- MoE for a few tokens --------------------------------------------------------------------------------
def _silu_glu(g, u, limit):  # pragma: no cover - compiled
    g = min(g, limit)
    u = min(max(u, -limit), limit)
    return g / (np.float32(1.0) + _exp_jit(-g)) * u


_silu_glu_jit = _jit(_silu_glu)


def moe_tokens(work, x, ids, gate_w, bias, tid2eid, top_k, scoring, route_scale, w13, w13_s, w2, w2_s, sw1, sw1_s,
               sw3, sw3_s, sw2, sw2_s, limit, inputs, shared_bf16, out):  # fmt: skip
    """The whole MoE for a step's tokens: per token, router scores (0 = sqrt(softplus), 1 = sigmoid, 2 =
    softmax) and top-k by score + bias (or the hash table when tid2eid is not empty), weights normalised and times
    route_scale (moe_route); then per expert, its tokens through its SwiGLU (each expert's weights read once), and
    the shared expert over all tokens, spread over the cores (moe_experts); their outputs added (moe_combine).
    x, out [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; sw1/sw3 [I', H]; sw2 [H, I'], each with its scale (stored():
    EMPTY for plain weights; the experts FP4 or FP8, the shared expert FP8, see _expert_rows / _matrix_rows);
    `inputs`: how the routed experts round their inputs (quant.input_code); `shared_bf16`: whether the shared
    expert rounds them to bfloat16 (quant.bf16_inputs).
    `work`: moe_work's multiply-adds."""
    n, hidden = x.shape
    num_experts, pairs = w13.shape[0], x.shape[0] * top_k
    token_of = np.empty(pairs, dtype=np.int64)
    weight_of = np.empty(pairs, dtype=np.float32)
    counts = np.zeros(num_experts + 1, dtype=np.int64)
    tasks = np.empty(num_experts + 2, dtype=np.int64)
    chunks = _shared_parts(sw1, sw2_s)[1]
    num_tasks = moe_route(
        x, ids, gate_w, bias, tid2eid, top_k, scoring, route_scale, chunks, token_of, weight_of, counts, tasks
    )
    ys = np.empty((pairs, hidden), dtype=np.float32)
    shared = np.empty((chunks, n, hidden), dtype=np.float32)
    claimed = np.zeros(1, dtype=np.int64)  # (the tasks taken so far: base._claim)
    moe_experts(work, x, counts, tasks[:num_tasks], claimed, token_of, weight_of, w13, w13_s, w2, w2_s, sw1, sw1_s,
                sw3, sw3_s, sw2, sw2_s, limit, inputs, shared_bf16, ys, shared)  # fmt: skip
    moe_combine(token_of, ys, shared, out)


def _shared_parts(sw1, sw2_s):
    # The shared expert's intermediate rows cut in two (each part reads its own half of the weights, for every
    # token; an FP8 weight's columns are cut at its scale blocks): (the cut, the number of parts). (Also compiled.)
    shared = sw1.shape[0]
    align = FP8_BLOCK if sw2_s.ndim == 2 else 1
    cut = shared // 2 // align * align
    return cut, 2 if cut > 0 else 1


_shared_parts_jit = _inlined(_shared_parts)


def _in_shares(n):  # pragma: no cover - compiled: whether n tokens' tasks go in equal shares, not taken in turn
    return n == 1  # (one token: every task is one token's, and the shares are ordered for equal bytes)


_in_shares_jit = _inlined(_in_shares)


def _moe_route(x, ids, gate_w, bias, tid2eid, top_k, scoring, route_scale, chunks, token_of, weight_of, counts,
               tasks):  # fmt: skip
    # (compiled) moe_tokens' routing: the (token, k) pairs bucketed by expert (expert e's are [counts[e],
    # counts[e + 1]) of token_of and their weights weight_of); returns the number of tasks written to `tasks`:
    # each expert that has tokens (e), and the shared expert's `chunks` parts (num_experts + c), which take every
    # token. For one token, the tasks that moe_experts shares out equally: each part ahead of an equal share of the
    # experts (on two cores: a part and three of the six experts each; with the second part last instead, so that
    # one core read its FP8 part beside the other's FP4 experts, 1.01-1.03x the time). For more, most tokens first
    # (the shared parts after the experts of as many), so that the cores, each taking the next task when free, end
    # together: the last tasks taken are the shortest.
    n = x.shape[0]
    num_experts = gate_w.shape[0]
    chosen = np.empty((n, top_k), dtype=np.int64)
    weight = np.empty((n, top_k), dtype=np.float32)
    scores = np.empty((n, num_experts), dtype=np.float32)  # the router's logits, then its scores
    keyed = np.empty((n, num_experts) if tid2eid.shape[0] == 0 else (0, 0), dtype=np.float32)  # scores + bias
    _linear_rows_jit(x, gate_w, scores, n)
    for t in range(n):
        for e in range(num_experts):
            z = scores[t, e]
            if scoring == 0:
                sp = z + np.float32(math.log1p(math.exp(-z))) if z > 0 else np.float32(math.log1p(math.exp(z)))
                scores[t, e] = np.float32(math.sqrt(sp))
            elif scoring == 1:
                scores[t, e] = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-z)))
        if scoring == 2:
            top = scores[t].max()
            total = np.float32(0.0)
            for e in range(num_experts):
                scores[t, e] = np.float32(math.exp(scores[t, e] - top))
                total += scores[t, e]
            for e in range(num_experts):
                scores[t, e] /= total
        if tid2eid.shape[0] > 0:
            for j in range(top_k):
                chosen[t, j] = tid2eid[ids[t], j]
        else:
            for e in range(num_experts):
                keyed[t, e] = scores[t, e] + bias[e]
            for j in range(top_k):  # the largest remaining, lowest index first on ties
                best = 0
                for e in range(1, num_experts):
                    if keyed[t, e] > keyed[t, best]:
                        best = e
                chosen[t, j] = best
                keyed[t, best] = -np.inf
        total = np.float32(0.0)
        for j in range(top_k):
            total += scores[t, chosen[t, j]]
        for j in range(top_k):
            weight[t, j] = scores[t, chosen[t, j]] / (total + np.float32(1e-20)) * np.float32(route_scale)
    for t in range(n):
        for j in range(top_k):
            counts[chosen[t, j] + 1] += 1
    for e in range(num_experts):
        counts[e + 1] += counts[e]
    fill = counts[:num_experts].copy()
    for t in range(n):
        for j in range(top_k):
            e = chosen[t, j]
            token_of[fill[e]] = t
            weight_of[fill[e]] = weight[t, j]
            fill[e] += 1
    num_tasks = 0
    if _in_shares_jit(n):
        active, half = counts[num_experts], 0  # (the experts chosen: one pair each)
        for e in range(num_experts):
            if counts[e + 1] > counts[e]:
                if half < chunks and counts[e] >= half * active // chunks:
                    tasks[num_tasks] = num_experts + half
                    num_tasks += 1
                    half += 1
                tasks[num_tasks] = e
                num_tasks += 1
        for c in range(half, chunks):
            tasks[num_tasks] = num_experts + c
            num_tasks += 1
        return num_tasks
    for c in range(n, 0, -1):  # (an expert has at most n tokens: each token chooses it once at most)
        for e in range(num_experts):
            if counts[e + 1] - counts[e] == c:
                tasks[num_tasks] = e
                num_tasks += 1
        if c == n:
            for p in range(chunks):
                tasks[num_tasks] = num_experts + p
                num_tasks += 1
    return num_tasks


moe_route = _jit(_moe_route)


def _moe_task(e, x, counts, token_of, weight_of, w13, w13_s, w2, w2_s, sw1, sw1_s, sw3, sw3_s, sw2, sw2_s, limit,
              inputs, shared_bf16, ys, shared_out, rows, both, act):  # fmt: skip
    # (compiled) one of moe_tokens' tasks, writing only its own rows: expert e's tokens (the routed experts'
    # outputs to ys, one row per (token, k) pair), or for e >= the number of experts a part of the shared expert's
    # intermediate rows for every token (to shared_out[part]); rows, both, act: the part's scratch, from row 0
    n, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if e >= num_experts:
        cut, chunks = _shared_parts_jit(sw1, sw2_s)
        c = e - num_experts
        i0 = 0 if c == 0 else cut
        i1 = sw1.shape[0] if c == chunks - 1 else cut
        gates, ups = np.empty((n, i1 - i0), dtype=np.float32), np.empty((n, i1 - i0), dtype=np.float32)
        _matrix_rows(x, sw1, sw1_s, gates, n, i0, 0, shared_bf16)
        _matrix_rows(x, sw3, sw3_s, ups, n, i0, 0, shared_bf16)
        for t in range(n):
            for i in range(i1 - i0):
                gates[t, i] = _silu_glu_jit(gates[t, i], ups[t, i], limit)
        _matrix_rows(gates, sw2, sw2_s, shared_out[c], n, 0, i0, shared_bf16)
        return
    first, last = counts[e], counts[e + 1]
    count = last - first
    for r in range(count):
        for k in range(hidden):
            rows[r, k] = x[token_of[first + r], k]
    _expert_rows(rows[:count], w13, w13_s, e, both[:count], count, inputs)
    for r in range(count):
        for i in range(inter):
            act[r, i] = _silu_glu_jit(both[r, i], both[r, inter + i], limit) * weight_of[first + r]
    _expert_rows(act[:count], w2, w2_s, e, ys[first:last], count, inputs)


_moe_task_jit = _inlined(_moe_task)


def _moe_experts(x, counts, tasks, claimed, token_of, weight_of, w13, w13_s, w2, w2_s, sw1, sw1_s, sw3, sw3_s, sw2,
                 sw2_s, limit, inputs, shared_bf16, ys, shared_out, part, parts):  # fmt: skip
    # (compiled) moe_tokens' tasks (_moe_task), in `tasks`' order (moe_route): for one token, this part's equal
    # share of them; for more, each part takes the next task not yet taken (base._claim on `claimed`, zero before
    # the call) until none is left
    hidden, inter = x.shape[1], w13.shape[1] // 2
    most = 0  # (the most tokens an expert has: this part's scratch holds one task's rows at a time)
    for e in range(w13.shape[0]):
        most = max(most, counts[e + 1] - counts[e])
    rows = _empty64_f32(most, hidden)  # (the experts' inputs, on 64 bytes: base._empty64_f32)
    both = np.empty((most, 2 * inter), dtype=np.float32)
    act = _empty64_f32(most, inter)
    shares = parts == 1 or _in_shares_jit(x.shape[0])
    job, end = _share_jit(tasks.shape[0], part, parts) if shares else (_claim(claimed), tasks.shape[0])
    while job < end:
        _moe_task_jit(tasks[job], x, counts, token_of, weight_of, w13, w13_s, w2, w2_s, sw1, sw1_s, sw3, sw3_s, sw2,
                      sw2_s, limit, inputs, shared_bf16, ys, shared_out, rows, both, act)  # fmt: skip
        job = job + 1 if shares else _claim(claimed)


# work = multiply-adds (moe_work): on 2 cores the shipped model's experts pay for threads from about 16 tokens, and
# DeepSeek-V4's at any count (its tasks, the active experts, read megabytes each)
moe_experts = Threaded(_moe_experts, min_work=1 << 20)


def _moe_combine(token_of, ys, shared, out):  # pragma: no cover - compiled
    # out = the shared expert's parts added, then the routed experts' outputs in expert order (the same order for
    # any number of tokens and threads)
    n, hidden = out.shape
    for t in range(n):
        for k in range(hidden):
            out[t, k] = shared[0, t, k] + shared[1, t, k] if shared.shape[0] == 2 else shared[0, t, k]
    for r in range(token_of.shape[0]):
        t = token_of[r]
        for k in range(hidden):
            out[t, k] += ys[r, k]


moe_combine = _jit(_moe_combine)


def moe_work(n: int, weights: tuple) -> int:
    """The experts' multiply-adds for n tokens: each through its top_k experts and the shared one (three matrices
    of hidden x intermediate each). `weights`: moe_tokens' arguments from gate_w to limit, in its order (w13
    [E, 2I, ...] and sw1 [I', ...] as stored: their rows count)."""
    gate, _, _, top_k, _, _, w13, _, _, _, sw1 = weights[:11]
    return n * 3 * gate.shape[1] * (top_k * (w13.shape[1] // 2) + sw1.shape[0])
