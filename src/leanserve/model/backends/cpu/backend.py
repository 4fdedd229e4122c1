"""The CPU backend: the numba kernels (kernels/) on float32 activations, with float32 or bfloat16 weights widened
as they are read; decode-sized steps run whole as numpy arrays (decode.py). Each op falls back to the torch
statement (TorchBackend) for inputs the kernels do not take (autograd, other dtypes, sizes where torch's blocked
matmuls win). The size thresholds live here and nowhere else; benchmarks/ and docs/ hold their measurements.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
import torch.nn.functional as F

from leanserve.model.backends.cpu import arrays, decode
from leanserve.model.backends.cpu import kernels as ck
from leanserve.model.backends.cpu.views import KeptViews, numpy_views, tensors_of
from leanserve.model.backends.torch import TorchBackend
from leanserve.model.quant import Fp4Weight, Fp8Experts, Fp8Weight, inputs_for
from leanserve.model.torch_math import blocks, ops
from leanserve.model.weights import MixWeights

# Up to this many rows, a linear layer, a grouped linear and the whole MoE run as compiled loops (decode and
# verification steps): at these sizes torch's matmuls cost several times the arithmetic in call and packing
# overhead; above it, torch's blocked matmuls (the MoE's over tokens grouped by expert), unless the inputs are
# narrow (NARROW_INPUT) or the experts small (SMALL_EXPERT).
FEW_ROWS = 64
# Linears with FP8 weights run as compiled loops up to this many rows: torch's matmuls need each weight dequantized
# whole first, which costs more than the kernels' L1-sized dequantized blocks up to about a thousand rows (the
# Flash-shaped published model's prefill: 0.87x the time at 256 tokens, 0.94x at 512; with every linear in the
# kernels 1.01x at 1024 and 1.07x at 2048; 2-core AMD EPYC, 2026-12-07).
FP8_ROWS = 512
# Linears (and grouped linears) of at most this many inputs run as compiled loops at any number of rows: the
# kernels' register tiles beat torch's matmuls up to about this width, bfloat16 weights included, and lose at
# V4's widths (4096 inputs).
NARROW_INPUT = 1024
# Steps of up to this many tokens whose rows go into the rings first (decode, verification, the MTP layer's
# steps) run the blocks as numpy arrays through the kernels, one plan per block (decode.py).
DECODE_TOKENS = 64
# The whole MoE runs as one compiled call at any number of rows when an expert's w13 has at most this many
# entries (hidden x 2 * intermediate): there the kernels' register tiles beat torch's packing at every size; at
# V4-Flash's experts in float32 torch wins from about a thousand rows. Experts stored in bfloat16, FP8 or FP4,
# which torch's path first widens or dequantizes whole, one at a time, take the compiled call at any number of
# rows: one layer of the Flash-shaped published model (FP4 experts), 128 / 512 / 2048 tokens in 0.19x / 0.42x /
# 0.75x the time, bf16 experts 0.28x at 512 and 0.54x at 2048 (2-core AMD EPYC, 2026-12-07).
SMALL_EXPERT = 1 << 20
# Padded experts (two batched matmuls over [E, M, ...]) when padding every expert to the largest count M costs
# at most twice the rows, and M is at most this; else a grouped matmul.
PADDED_MOST = 256

_F32 = torch.float32
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def _activations(*tensors: torch.Tensor | None, strided: tuple[torch.Tensor, ...] = ()) -> bool:
    """Float32 CPU tensors without autograd, contiguous but for those in `strided` (None ones are absent)."""
    for t in tensors:
        if t is not None and (t.dtype is not _F32 or not t.is_cpu or t.requires_grad or not t.is_contiguous()):
            return False
    return not any(t.dtype is not _F32 or not t.is_cpu or t.requires_grad for t in strided)


def _compiled_linear(rows: int, inputs: int, weights: tuple = ()) -> bool:
    """Whether a (grouped) linear of this many rows and inputs runs as compiled loops (FEW_ROWS, NARROW_INPUT; with
    an FP8 weight among `weights`, FP8_ROWS)."""
    fp8 = any(isinstance(w, Fp8Weight) for w in weights)
    return rows <= (FP8_ROWS if fp8 else FEW_ROWS) or inputs <= NARROW_INPUT


def _plain(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cpu and not t.requires_grad and t.is_contiguous()


def _weights(weights: tuple, quantized: tuple[type, ...] = ()) -> bool:
    """Weights the kernels read: plain ones of one dtype (float32 or bfloat16), or quantized ones of the types
    `quantized` (their tensors plain), contiguous CPU tensors without autograd."""
    dtype = getattr(weights[0], "dtype", None)
    return all(
        _plain(w) and w.dtype is dtype and dtype in _WEIGHT_DTYPES
        if isinstance(w, torch.Tensor)
        else isinstance(w, quantized) and all(_plain(t) for t in tensors_of(w))
        for w in weights
    )


def _linear_weights(weights: tuple) -> bool:
    """Weights of a `linears` call the kernels read: FP8 ones, and plain ones of one dtype."""
    return _weights(tuple([w for w in weights if not isinstance(w, Fp8Weight)]) or (weights[0],), (Fp8Weight,))


def keep_freed_memory() -> None:
    """glibc gives a freed block back to the system once the top of its heap passes a trim threshold, and serves
    large requests by mmap, so a prefill's activations (megabytes a layer) are page-faulted in afresh at every
    step (for hc_post's output, more time than its arithmetic). A fixed 32 MiB mmap
    threshold (glibc's largest) and a 1 GiB trim threshold keep freed blocks for reuse; the peak memory stays
    the same. Once per process, and only where the C library is glibc."""
    global _kept_freed
    if _kept_freed:
        return
    _kept_freed = True
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # (another C library: leave it as it is)
        pass


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_kept_freed = False


class CpuBackend(TorchBackend):
    name = "cpu"
    needs = "a CPU, float32 or bfloat16 weights and numba"

    @classmethod
    def why_not(cls, device: str | torch.device, weight_dtype: torch.dtype) -> str | None:
        if ck.numba is None:
            return "numba is not installed"
        if not ck.available() or torch.device(device).type != "cpu" or weight_dtype not in _WEIGHT_DTYPES:
            return f"the device is {device} with {weight_dtype}"
        return None

    def __init__(self) -> None:
        keep_freed_memory()
        # (id(block weights), id(cache)) -> (the weights, kept so that the id is not reused; its decode plan)
        self._plans: dict[tuple[int, int], tuple[object, decode.Plan]] = {}
        self._views = KeptViews()

    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """bfloat16 weights meet float32 activations: the kernels widen each weight row as they read it, so a step
        moves half the weight bytes and computes in float32 (what a CPU without bfloat16 arithmetic does anyway);
        torch's own bfloat16 matmuls on a CPU are several times slower."""
        return torch.float32 if weight_dtype == torch.bfloat16 else weight_dtype

    # --- small ops ------------------------------------------------------------------------------------
    def linears(self, x, weights):
        rows = x.numel() // x.shape[-1]
        if _compiled_linear(rows, x.shape[-1], weights) and _activations(x) and _linear_weights(weights):
            flat = x.view(rows, x.shape[-1]).numpy()
            if len(weights) == 1 and isinstance(weights[0], torch.nn.Parameter):  # (a module's plain weight, e.g.
                # the head's: its views and kernel calls kept with it, as long as it lives)
                outs = self._views.get(weights[0], "matmuls", lambda w: ck.Matmuls((numpy_views(w),)))(flat)
            else:  # (FP8 and plain weights: one kernel call each)
                outs = ck.matmuls(flat, tuple([numpy_views(w) for w in weights]))
            return tuple([torch.from_numpy(o).view(*x.shape[:-1], o.shape[1]) for o in outs])
        if _activations(x) and _linear_weights(weights) and any(isinstance(w, Fp8Weight) for w in weights):
            # (a prefill: torch matmuls, each FP8 weight dequantized alone by the kernels just before its own)
            return tuple([F.linear(inputs_for(w, x), _dense(w)) if isinstance(w, Fp8Weight) else ops.linears(x, (w,))[0]
                          for w in weights])  # fmt: skip
        return super().linears(x, weights)

    def grouped_linear(self, x, weight):
        if (
            _compiled_linear(x.shape[0], x.shape[-1], (weight,))
            and _activations(x)
            and _weights((weight,), (Fp8Weight,))
        ):
            w = numpy_views(weight)
            w = w if isinstance(w, Fp8Weight) else w.reshape(x.shape[1], -1, x.shape[2])
            return torch.from_numpy(arrays.grouped_linear_arrays(x.numpy(), w))
        if isinstance(weight, Fp8Weight) and _activations(x) and _weights((weight,), (Fp8Weight,)):
            # (a prefill: dequantized by the kernels for the call)
            return ops.grouped_linear(inputs_for(weight, x), _dense(weight))
        return super().grouped_linear(x, weight)

    def rms_norm(self, x, eps, weight=None):
        if _activations(x, weight):
            flat = x.view(x.numel() // x.shape[-1], x.shape[-1])
            return torch.from_numpy(arrays.rms_norm_arrays(flat.numpy(), ck.np_(weight), eps)).view(x.shape)
        return super().rms_norm(x, eps, weight)

    def norm_rope(self, x, freqs, eps, weight=None):
        if _activations(x, weight):
            return self._rope(x, freqs, False, True, eps, weight)
        return super().norm_rope(x, freqs, eps, weight)

    def apply_rope(self, x, freqs, inverse=False):
        if _activations(x):
            return self._rope(x, freqs, inverse, False, 0.0, None)
        return super().apply_rope(x, freqs, inverse)

    @staticmethod
    def _rope(x, freqs, inverse: bool, normalize: bool, eps: float, weight) -> torch.Tensor:
        flat = x.view(x.shape[0], x.numel() // (x.shape[0] * x.shape[-1]), x.shape[-1])  # [N, heads, D]
        angles = torch.view_as_real(freqs.contiguous()).numpy()  # [N, rope_dim/2, 2]
        out = arrays.rope_arrays(flat.numpy(), angles, eps, normalize, ck.np_(weight), inverse)
        return torch.from_numpy(out).view(x.shape)

    def experts(self, rows, counts, w13, w2, limit):
        if _activations(rows) and _weights((w13, w2), (Fp4Weight, Fp8Experts)) and not _weights((w13, w2)):
            # (quantized experts, a prefill: one expert at a time dequantized by the kernels, then torch matmuls)
            return ops.experts(rows, counts, w13, w2, limit, matrix=_expert_dense)
        if not _weights((w13, w2)):
            return super().experts(rows, counts, w13, w2, limit)
        w13, w2 = w13.to(rows.dtype), w2.to(rows.dtype)  # (bfloat16 weights: widened once, for either way)
        padded = padded_experts(rows, counts, w13, w2, limit)
        if padded is not None:
            return padded
        grouped = _grouped_mm if hasattr(torch, "_grouped_mm") else None
        return ops.experts(rows, counts, w13, w2, limit, grouped)

    # --- mHC ------------------------------------------------------------------------------------------
    def hc_pre(self, streams, w: MixWeights):
        if not _activations(streams, w.fn, w.norm_weight):
            return super().hc_pre(streams, w)
        # One call: the projection, the mHC weights, the collapse of the streams and the block input's RMSNorm (the
        # kernel's own projection, a few dozen outputs a row, beats a torch matmul at every size).
        x, weights = arrays.hc_pre_arrays(streams.numpy(), numpy_views(w))
        x, weights, hc = torch.from_numpy(x), torch.from_numpy(weights), streams.shape[1]
        return x, weights[:, hc : 2 * hc], weights[:, 2 * hc :].unflatten(-1, (hc, hc))

    def hc_post(self, block_out, streams, post, comb):
        if _activations(block_out, streams, strided=(post, comb)):
            out = arrays.hc_post_arrays(block_out.numpy(), streams.numpy(), post.numpy(), comb.flatten(1).numpy())
            return torch.from_numpy(out)
        return super().hc_post(block_out, streams, post, comb)

    def hc_head(self, streams, w: MixWeights):
        if _activations(streams, w.fn, w.norm_weight):  # hc_pre's kernel: the pre weights are all it computes
            return torch.from_numpy(arrays.hc_pre_arrays(streams.numpy(), self._views.get(w))[0])
        return super().hc_head(streams, w)

    # --- the pieces -----------------------------------------------------------------------------------
    def compress(self, w, kv, gate, meta, kv_ring, gate_ring, rows, row_rope):
        if not _activations(kv, gate, kv_ring, gate_ring, rows):
            return super().compress(w, kv, gate, meta, kv_ring, gate_ring, rows, row_rope)
        angles = torch.view_as_real(row_rope.contiguous()).numpy()  # [NW, R/2, 2]
        r = decode.Rings.of(kv_ring, gate_ring, rows)
        arrays.compress_arrays(
            kv.numpy(), gate.numpy(), meta.arrays(), r.kv, r.gate, r.rows, angles, meta.write_first, self._views.get(w)
        )

    def attend(self, w, q, ring, new_kv, fb, cache, iq, rope):
        # Every CPU step in float32 attends through the kernel (threaded over query blocks: no [blocks, heads,
        # queries, keys] score tensors).
        if not _activations(q, ring, new_kv):
            return super().attend(w, q, ring, new_kv, fb, cache, iq, rope)
        out = torch.empty_like(q)
        args = q.numpy(), ring.numpy(), arrays.NO_NEW_KV if new_kv is None else new_kv.numpy()
        angles = torch.view_as_real(rope.contiguous()).numpy()
        iq = None if iq is None else (iq[0].numpy(), iq[1].numpy())
        views, rows, table = self._views.get(w), arrays.cache_rows(cache), fb.block_table.numpy()
        for g in fb.groups:
            most = g.max_visible[w.layer_type] if w.compressor is not None else 0
            visible = g.visible[w.layer_type].numpy() if most else np.zeros(g.q_rows.shape, dtype=np.int64)
            arrays.attend_arrays(views, *args, g.arrays(), table, most, visible, *rows, iq, angles, out.numpy())
        return out

    def moe(self, w, x, input_ids):
        plain_f32 = isinstance(w.w13, torch.Tensor) and w.w13.dtype == _F32  # (torch's path reads them as they are)
        if (x.shape[0] <= FEW_ROWS or w.w13_entries <= SMALL_EXPERT or not plain_f32) and _activations(x):
            quant = (Fp8Weight, Fp8Experts, Fp4Weight)
            if (
                _weights((w.gate,))
                and _weights((w.w13, w.w2), quant)
                and _weights((w.shared_w1, w.shared_w3, w.shared_w2), (Fp8Weight,))
            ):
                args = self._views.get(w, "moe_args", lambda w: arrays.moe_args(numpy_views(w)))
                return torch.from_numpy(arrays.moe_arrays(x.numpy(), input_ids.numpy(), args))
        return super().moe(w, x, input_ids)

    # --- decode-sized steps, whole ----------------------------------------------------------------------
    @staticmethod
    def decode_step(fb, act_dtype: torch.dtype) -> bool:
        """Whether a step runs whole as numpy arrays: short chunks whose rows go into the rings first (one
        attention group), float32 activations on the CPU (weights plain, or FP8 / FP4 as published)."""
        return (
            act_dtype == _F32
            and fb.num_tokens <= DECODE_TOKENS
            and len(fb.groups) == 1
            and fb.window_write_first
            and all(m.write_first for m in fb.compress.values())
            and fb.input_ids.is_cpu
        )

    def _angles(self, table: torch.Tensor, positions: torch.Tensor) -> np.ndarray:
        """A RoPE table at `positions` as the kernels take it, real pairs [N, R/2, 2], indexed from the table's
        kept numpy view (no torch op)."""
        return self._views.get(table, "pairs", lambda t: torch.view_as_real(t).numpy())[positions.numpy()]

    def plan(self, w, cache) -> decode.Plan:
        """The decode plan of a block's weights with this cache, made again when a weight's storage changed."""
        key = (id(w), id(cache))
        kept = self._plans.get(key)
        if kept is None or not kept[1].current():
            kept = self._plans[key] = (w, decode.Plan(numpy_views(w), tensors_of(w), cache))
        return kept[1]

    def run_blocks(self, w, fb, caches, streams, rows=None):
        if not self.decode_step(fb, w.act_dtype):
            return super().run_blocks(w, fb, caches, streams, rows)
        plans = [self.plan(bw, cache) for bw, cache in zip(w.blocks, caches, strict=True)]
        embed = self._views.get(w.embed) if streams is None else None
        s = None if streams is None else streams.numpy()
        step = decode.Step(fb, blocks.ropes(w.rope, fb, self._angles))
        kept = None if rows is None else rows.numpy()
        return torch.from_numpy(decode.blocks(embed, plans, w.hc_mult, step, s, kept))

    def run_mtp(self, w, streams, fb, cache):
        if not (self.decode_step(fb, streams.dtype) and _activations(streams)):
            return super().run_mtp(w, streams, fb, cache)
        # The whole layer as numpy arrays: the embedding's rows and the RoPE angles indexed from their tables.
        views = self._views.get(w)
        kept = self._plans.get((id(w), id(cache)))
        if kept is None or kept[1].w is not views.block:  # (the block's views are the MTP layer's, kept with them)
            kept = self._plans[(id(w), id(cache))] = (w, decode.Plan(views.block, [], cache))
        plan = kept[1]
        angles = blocks.ropes(w.rope, fb, self._angles)  # (sliding attention only: "main")
        rows = None if fb.logits_index is None else fb.logits_index.numpy()
        hidden, out = decode.mtp(views, plan, streams.numpy(), decode.Step(fb, angles), rows)
        return torch.from_numpy(hidden), torch.from_numpy(out)


def _dense(w: Fp8Weight | Fp4Weight) -> torch.Tensor:
    """One quantized matrix dequantized by the kernels: a new float32 tensor (the caller's scratch)."""
    return torch.from_numpy(ck.dequantized(numpy_views(w)))


def _expert_dense(w: Fp4Weight | Fp8Experts, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Expert e of stacked quantized experts, dequantized alone by the kernels (quant.expert_matrix's values;
    float32, the CPU backend's activations)."""
    if isinstance(w, Fp4Weight):
        return _dense(Fp4Weight(w.packed[e], w.scale[e]))
    halves = w.scale.shape[1]
    out = torch.empty(w.q.shape[1], w.q.shape[2])
    for h, (q, part) in enumerate(zip(w.q[e].chunk(halves), out.chunk(halves), strict=True)):
        ck.dequantized(numpy_views(Fp8Weight(q, w.scale[e, h])), part.numpy())
    return out


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w.transpose(1, 2), offs=ends.to(torch.int32))


def padded_experts(
    rows: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, limit: float
) -> torch.Tensor | None:
    """The experts as two batched matmuls over [E, M, ...], every expert's rows padded to the largest count M:
    rows [N, hidden] grouped by expert, counts [E] -> [N, hidden]. On the CPU this beats a grouped matmul once
    the padding is at most half the work (decode batches); None when it would not (tiny or skewed batches, long
    prefills)."""
    num_experts, n = counts.shape[0], rows.shape[0]
    if n < num_experts:
        return None
    most = int(counts.max())
    if num_experts * most > 2 * n or most > PADDED_MOST:
        return None
    starts = torch.cumsum(counts, 0) - counts
    expert_of = torch.repeat_interleave(torch.arange(num_experts), counts)
    slot = expert_of * most + torch.arange(n) - starts[expert_of]  # row i -> its place in [E * M]
    padded = rows.new_zeros(num_experts * most, rows.shape[1])
    padded[slot] = rows
    gate, up = torch.bmm(padded.view(num_experts, most, -1), w13.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(ops.swiglu(gate, up, limit), w2.transpose(1, 2))  # [E, M, hidden]
    return out.view(num_experts * most, -1)[slot]
