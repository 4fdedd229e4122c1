"""The trunk's blocks for a decode-sized step on the CPU, as numpy arrays through the compiled kernels.

The torch forward (block.py, attention.py, moe.py) calls the same kernels on decode steps, but it wraps each
in torch tensors: an output tensor, its numpy view, the inputs' views, each about a microsecond, dozens of them
per layer. At batch 1 that orchestration costs more than the arithmetic. Here a step runs on numpy arrays from
the embedding to the last block: weights' and caches' views are made once and kept, the step's metadata is
converted once for all layers, intermediate outputs are plain numpy arrays. The logits tail (hc_head, norm,
head) stays in torch. `eligible` says which steps take this path; tests/test_kernels.py checks it against
the torch path.
"""

from __future__ import annotations

import numpy as np
import torch

from leanserve.model import cpu_kernels as ck
from leanserve.model.attention import NO_NEW_KV
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
        self.ropes = ropes
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
        s = np.ascontiguousarray(np.broadcast_to(x[:, None, :], (x.shape[0], model.cfg.hc_mult, x.shape[1])))
    else:
        s = streams.numpy()
    for key, block in model.layers.items():
        s = _block(block, s, step, caches[key])
    return torch.from_numpy(s)


def run_block(block, streams: torch.Tensor, fb: ForwardBatch, cache: LayerCache, ropes) -> torch.Tensor:
    """One block over `fb` (see `eligible`): the MTP layer's. streams [T, hc, hidden], contiguous float32."""
    return torch.from_numpy(_block(block, streams.numpy(), _Step(fb, ropes), cache))


def _block(b, s: np.ndarray, step: _Step, cache: LayerCache) -> np.ndarray:
    hc = s.shape[1]
    for site, sub in (("attn", _attention), ("ffn", _moe)):
        fn, base, scale = (getattr(b, f"hc_{site}_{p}") for p in ("fn", "base", "scale"))
        norm = b.attn_norm if site == "attn" else b.ffn_norm
        params = ck.numpy_views(norm, fn, scale, base, norm.weight, key="mhc")
        x, weights = hc_pre_arrays(s, *params, b.norm_eps, b.hc_eps, b.sinkhorn_iters)
        out = sub(b.attn if site == "attn" else b.ffn, x, step, cache)
        post, comb = weights[:, hc : 2 * hc], weights[:, 2 * hc :].reshape(-1, hc, hc)
        s = hc_post_arrays(out, s, post, comb)
    return s


def _rope(x: np.ndarray, angles: np.ndarray, eps: float, normalize: bool, weight: np.ndarray) -> np.ndarray:
    """(RMSNorm per head, then) RoPE: x [T, H, D]."""
    out = np.empty_like(x)
    ck.norm_rope(x.shape[0], x, weight, eps, normalize, angles, False, out)
    return out


def _attention(a, x: np.ndarray, step: _Step, cache: LayerCache) -> np.ndarray:
    n, heads, dim = x.shape[0], a.n_heads, a.head_dim
    inputs = ck.numpy_views(a, *(m.weight for m in a._inputs))
    projected = ck.matmuls(x, inputs)
    weights = a.q_norm.weight, a.wq_b.weight, a.norm.weight, a.wo_a.weight, a.wo_b.weight
    q_norm, wq_b, kv_norm, wo_a, wo_b = ck.numpy_views(a, *weights, key="decode")
    q_residual = np.empty_like(projected[0])
    ck.rms_norm(n, projected[0], q_norm, a.q_norm.eps, q_residual)
    angles = step.angles[a.rope_kind]
    q = _rope(ck.matmuls(q_residual, (wq_b,))[0].reshape(n, heads, dim), angles, a.eps, True, ck.EMPTY)
    kv = _rope(projected[1].reshape(n, 1, dim), angles, a.eps, True, kv_norm).reshape(n, dim)
    ring = cache.window_kv.numpy().reshape(-1, dim)
    src, dst = step.window
    ring[dst] = kv[src]
    most, index_queries = 0, None
    if a.compressor is not None:
        kind = a.layer_type
        _compress(a.compressor, projected[2], projected[3], step, kind, cache.comp_kv, cache.comp_gate, cache.comp_rows)
        most = step.max_visible[kind]
        if a.indexer is not None:
            idx = a.indexer
            _compress(
                idx.compressor, projected[4], projected[5], step, kind, cache.idx_kv, cache.idx_gate, cache.idx_rows
            )
            if most > idx.topk:
                iq, head_w = idx.queries(
                    torch.from_numpy(q_residual), torch.from_numpy(projected[6]), step.ropes[a.rope_kind]
                )
                index_queries = iq.numpy(), head_w.numpy()
    visible = step.visible[a.layer_type] if most else step.no_visible
    out = np.empty_like(q)
    a.attend_arrays(q, ring, NO_NEW_KV, step.group, most, visible, cache, index_queries, angles, out)
    grouped = out.reshape(n, a.o_groups, -1)
    w = wo_a.reshape(a.o_groups, -1, grouped.shape[-1])
    low = np.empty((n, a.o_groups, w.shape[1]), dtype=np.float32)
    ck.grouped_linear(n * w.size, grouped, w, low)
    return ck.matmuls(low.reshape(n, -1), (wo_b,))[0]


def _compress(c, kv: np.ndarray, gate: np.ndarray, step: _Step, kind: str, kv_ring, gate_ring, rows) -> None:
    width = kv.shape[1]
    rings = kv_ring.numpy().reshape(-1, width), gate_ring.numpy().reshape(-1, width), rows.numpy().reshape(-1, c.dim)
    c.kernel(kv, gate, step.compress[kind], *rings, step.angles[kind], True)


def _moe(m, x: np.ndarray, step: _Step, cache: LayerCache) -> np.ndarray:
    out = np.empty_like(x)
    m.kernel(x, step.ids, out)
    return out
