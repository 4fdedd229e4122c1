"""The trunk's blocks for a decode-sized step on the CPU, as numpy arrays through the compiled kernels.

The torch forward (block.py, attention.py, moe.py) calls the same kernels on decode steps, but it wraps each
in torch tensors: an output tensor, its numpy view, the inputs' views, each about a microsecond, dozens of them
per layer. At batch 1 that orchestration costs more than the arithmetic. Here a step runs on numpy arrays from
the embedding to the last block: each block's weights' and caches' views are made once and kept (`_Plan`), the
step's metadata is converted once for all layers, intermediate outputs are plain numpy arrays. The MTP layer's
step runs the same way (its input projections, its block, its hc_head and norm); the head stays a torch call.
`eligible` says which steps take this path; tests/test_kernels.py checks it against the torch path.
"""

from __future__ import annotations

import numpy as np
import torch

from leanserve.model import cpu_kernels as ck
from leanserve.model.attention import NO_NEW_KV, attend_arrays, cache_rows
from leanserve.model.batch import ForwardBatch
from leanserve.model.cache import LayerCache
from leanserve.model.hyper import hc_post_arrays, hc_pre_arrays

MOST_TOKENS = 64  # steps up to this many tokens (decode, speculative verification)


def eligible(fb: ForwardBatch, act_dtype: torch.dtype) -> bool:
    """A step of short chunks whose rows go into the rings first (one attention group), on the CPU in float32
    with the kernels available."""
    return (
        ck.available()
        and act_dtype == torch.float32
        and fb.num_tokens <= MOST_TOKENS
        and len(fb.groups) == 1
        and fb.window_write_first
        and all(m.write_first for m in fb.compress.values())
        and fb.input_ids.is_cpu
    )


class _Step:
    """The step's metadata as numpy arrays, converted once for all layers."""

    def __init__(self, fb: ForwardBatch, ropes: dict[str, torch.Tensor]) -> None:
        g = fb.groups[0]
        self.ids = fb.input_ids.numpy()
        self.angles = {k: torch.view_as_real(r.contiguous()).numpy() for k, r in ropes.items()}
        self.window = fb.window_write.src.numpy(), fb.window_write.dst.numpy()
        self.group = g.arrays()
        self.max_visible = g.max_visible
        self.visible = {k: v.numpy() for k, v in g.visible.items()}
        self.no_visible = np.zeros(g.q_rows.shape, dtype=np.int64)
        self.compress = {kind: m.arrays() for kind, m in fb.compress.items()}


def run_blocks(model, fb: ForwardBatch, caches: dict[str, LayerCache], ropes, streams: torch.Tensor | None):
    """The stage's blocks over `fb` (see `eligible`): embeds on a first stage, else starts from `streams`;
    returns the output streams [T, hc, hidden] as a torch tensor (sharing the numpy array's memory)."""
    step = _Step(fb, ropes)
    if streams is None:
        table = ck.numpy_views(model.embed, model.embed.weight)[0]
        rows = table[step.ids]
        x = rows if rows.dtype == np.float32 else (rows.astype(np.uint32) << 16).view(np.float32)
        s = np.empty((x.shape[0], model.cfg.hc_mult, x.shape[1]), dtype=np.float32)
        s[:] = x[:, None, :]
    else:
        s = streams.numpy()
    for key, block in model.layers.items():
        s = _block(_plan(block, caches[key]), s, step)
    return torch.from_numpy(s)


def run_mtp(mtp, streams: torch.Tensor, embedded: torch.Tensor, fb: ForwardBatch, cache: LayerCache, ropes):
    """The MTP layer over `fb` (see `eligible`), from the trunk's streams [T, hc, hidden] and the next tokens'
    embeddings [T, hidden] (contiguous float32): (the head's input [T, hidden], the block's output streams)."""
    p = _plan(mtp, cache)
    hnorm, enorm, h_proj, e_proj, eps = p.mtp_inputs
    s = streams.numpy()
    n, hc, dim = s.shape
    h = np.empty((n * hc, dim), dtype=np.float32)
    ck.rms_norm(n * hc, s.reshape(n * hc, dim), hnorm, eps, h)
    e = np.empty((n, dim), dtype=np.float32)
    ck.rms_norm(n, embedded.numpy(), enorm, eps, e)
    x = ck.matmuls(h, (h_proj,))[0].reshape(n, hc, dim) + ck.matmuls(e, (e_proj,))[0][:, None, :]
    out = _block(p, x, _Step(fb, ropes))
    return torch.from_numpy(hc_pre_arrays(out, *p.mtp_head)[0]), torch.from_numpy(out)


class _Plan:
    """A block's weights and caches as numpy views, with its constants: made once per (block, cache) and kept
    on the block, made again only when a weight's storage changes (loading, `.data` assignment)."""

    def __init__(self, b, cache: LayerCache) -> None:
        self.cache = cache  # (kept: the plans are looked up by the cache's id)
        self.tensors = [*b.parameters(), *b.buffers()]
        self.ptrs = [t.data_ptr() for t in self.tensors]
        self.hc = b.hc_attn_fn.shape[1] // b.attn_norm.weight.shape[0]  # streams: fn is [M, hc * hidden]
        self.mhc = tuple(
            (*ck.numpy_views(norm, fn, scale, base, norm.weight, key="mhc"), b.norm_eps, b.hc_eps, b.sinkhorn_iters)
            for norm, fn, scale, base in (
                (b.attn_norm, b.hc_attn_fn, b.hc_attn_scale, b.hc_attn_base),
                (b.ffn_norm, b.hc_ffn_fn, b.hc_ffn_scale, b.hc_ffn_base),
            )
        )
        a = b.attn
        self.heads, self.dim, self.eps = a.n_heads, a.head_dim, a.eps
        self.rope_kind, self.kind = a.rope_kind, a.layer_type
        self.inputs = ck.numpy_views(a, *(m.weight for m in a._inputs))
        weights = a.q_norm.weight, a.wq_b.weight, a.norm.weight, a.wo_a.weight, a.wo_b.weight
        self.q_norm, self.wq_b, self.kv_norm, wo_a, self.wo_b = ck.numpy_views(a, *weights, key="decode")
        self.q_eps = a.q_norm.eps
        self.wo_a = wo_a.reshape(a.o_groups, -1, a.n_heads * a.head_dim // a.o_groups)
        self.attend = a.attend_params()
        self.ring = cache.window_kv.numpy().reshape(-1, a.head_dim)
        self.rows = cache_rows(cache)
        self.compressor = self.indexer = None
        if a.compressor is not None:
            c = a.compressor
            self.compressor = c, c.kernel_params(), _rings(cache.comp_kv, cache.comp_gate, cache.comp_rows)
        if a.indexer is not None:
            idx = a.indexer
            rings = _rings(cache.idx_kv, cache.idx_gate, cache.idx_rows)
            (wq_b,) = ck.numpy_views(idx, idx.wq_b.weight, key="decode")
            c = idx.compressor
            self.indexer = c, c.kernel_params(), rings, wq_b, idx.n_heads, idx.head_dim, idx.topk
        self.moe = b.ffn.kernel_params()
        self.ffn = b.ffn
        if hasattr(b, "e_proj"):  # the MTP layer: its input projections, and hc_head + norm before the head
            inputs = b.hnorm.weight, b.enorm.weight, b.h_proj.weight, b.e_proj.weight
            self.mtp_inputs = (*ck.numpy_views(b, *inputs, key="mtp"), b.hnorm.eps)
            head = b.hc_head_fn, b.hc_head_scale, b.hc_head_base, b.norm.weight
            self.mtp_head = (*ck.numpy_views(b, *head, key="mtp_head"), b.norm_eps, b.hc_eps, 0)

    def current(self) -> bool:
        return [t.data_ptr() for t in self.tensors] == self.ptrs


def _rings(kv: torch.Tensor, gate: torch.Tensor, rows: torch.Tensor) -> tuple[np.ndarray, ...]:
    width = kv.shape[-1]
    return kv.numpy().reshape(-1, width), gate.numpy().reshape(-1, width), rows.numpy().reshape(-1, rows.shape[-1])


def _plan(block, cache: LayerCache) -> _Plan:
    plans = block.__dict__.setdefault("_decode_plans", {})
    plan = plans.get(id(cache))
    if plan is None or not plan.current():
        plan = plans[id(cache)] = _Plan(block, cache)
    return plan


def _block(p: _Plan, s: np.ndarray, step: _Step) -> np.ndarray:
    hc = p.hc
    for mhc, sub in zip(p.mhc, (_attention, _moe), strict=True):
        x, weights = hc_pre_arrays(s, *mhc)
        out = sub(p, x, step)
        s = hc_post_arrays(out, s, weights[:, hc : 2 * hc], weights[:, 2 * hc :].reshape(-1, hc, hc))
    return s


def _rope(x: np.ndarray, angles: np.ndarray, eps: float, normalize: bool, weight: np.ndarray) -> np.ndarray:
    """(RMSNorm per head, then) RoPE: x [T, H, D]."""
    out = np.empty_like(x)
    ck.norm_rope(x.shape[0], x, weight, eps, normalize, angles, False, out)
    return out


def _attention(p: _Plan, x: np.ndarray, step: _Step) -> np.ndarray:
    n, dim = x.shape[0], p.dim
    projected = ck.matmuls(x, p.inputs)
    q_residual = np.empty_like(projected[0])
    ck.rms_norm(n, projected[0], p.q_norm, p.q_eps, q_residual)
    angles = step.angles[p.rope_kind]
    q = _rope(ck.matmuls(q_residual, (p.wq_b,))[0].reshape(n, p.heads, dim), angles, p.eps, True, ck.EMPTY)
    kv = _rope(projected[1].reshape(n, 1, dim), angles, p.eps, True, p.kv_norm).reshape(n, dim)
    src, dst = step.window
    p.ring[dst] = kv[src]
    most, index_queries = 0, None
    if p.compressor is not None:
        meta, row_angles = step.compress[p.kind], step.angles[p.kind]
        c, params, rings = p.compressor
        c.kernel(projected[2], projected[3], meta, *rings, row_angles, True, params)
        most = step.max_visible[p.kind]
        if p.indexer is not None:
            c, params, rings, wq_b, heads, head_dim, topk = p.indexer
            c.kernel(projected[4], projected[5], meta, *rings, row_angles, True, params)
            if most > topk:  # the indexer's queries (RoPE'd, no norm) and head weights
                iq = _rope(ck.matmuls(q_residual, (wq_b,))[0].reshape(n, heads, head_dim), angles, 0.0, False, ck.EMPTY)
                index_queries = iq, projected[6] * np.float32(heads**-0.5)
    visible = step.visible[p.kind] if most else step.no_visible
    out = np.empty((n, p.heads, dim), dtype=np.float32)
    attend_arrays(p.attend, q, p.ring, NO_NEW_KV, step.group, most, visible, *p.rows, index_queries, angles, out)
    low = np.empty((n, p.wo_a.shape[0], p.wo_a.shape[1]), dtype=np.float32)
    ck.grouped_linear(n * p.wo_a.size, out.reshape(n, p.wo_a.shape[0], -1), p.wo_a, low)
    return ck.matmuls(low.reshape(n, -1), (p.wo_b,))[0]


def _moe(p: _Plan, x: np.ndarray, step: _Step) -> np.ndarray:
    out = np.empty_like(x)
    p.ffn.kernel(x, step.ids, out, p.moe)
    return out
