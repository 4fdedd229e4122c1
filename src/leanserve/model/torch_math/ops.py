"""The torch statement of the model's small ops: linears, the experts' SwiGLU, RMSNorm, partial interleaved
RoPE. TorchBackend runs these; the CPU backend runs its kernels where they apply and these elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leanserve.model.quant import dense, expert_matrix, inputs_for


def linears(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """x [..., in] @ w[out, in]^T for each of `weights`, in x's dtype (a bfloat16 weight meets float32
    activations on the CPU, see TorchBackend.activation_dtype; a quantized one is dequantized for the call)."""
    return tuple([F.linear(inputs_for(w, x), dense(w, x.dtype)) for w in weights])


def grouped_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """x [T, G, in], weight [G * out, in] (or quantized) -> [T, G, out]: group g of every row times its rows
    [g * out, (g + 1) * out) of the weight, transposed (x as the weight takes it, quant.inputs_for)."""
    w = dense(weight, x.dtype).view(x.shape[1], -1, x.shape[2])
    return torch.einsum("tgi,goi->tgo", inputs_for(weight, x), w)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(gate) * up with both pre-activations clamped (gate from above, up both ways) at `limit`."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def experts(rows, counts, w13, w2, limit: float, grouped_mm=None, matrix=expert_matrix) -> torch.Tensor:
    """The routed experts' SwiGLU over rows [N, hidden] grouped by expert (counts [E] rows each), w13 [E, 2I,
    hidden] (gate | up), w2 [E, hidden, I] (or quantized) -> [N, hidden]. `grouped_mm` (x, w, ends), if given,
    computes x's rows times their expert's w^T for plain weights; by default each expert in turn, its matrices
    from `matrix(w, e, dtype)` (a quantized expert dequantized alone) meeting its inputs as the weight takes them
    (quant.inputs_for): its weights are read once, only its own rows are computed, and autograd takes it
    (training runs this too)."""
    ends = torch.cumsum(counts, 0)
    if grouped_mm is not None:
        gate, up = grouped_mm(rows, w13.to(rows.dtype), ends).chunk(2, dim=-1)  # [N, I] each
        return grouped_mm(swiglu(gate, up, limit), w2.to(rows.dtype), ends)  # [N, hidden]
    outs, start = [], 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            gate, up = F.linear(inputs_for(w13, rows[start:end]), matrix(w13, e, rows.dtype)).chunk(2, dim=-1)
            outs.append(F.linear(inputs_for(w2, swiglu(gate, up, limit)), matrix(w2, e, rows.dtype)))
        start = end
    return torch.cat(outs) if outs else rows.new_zeros(0, w2.shape[1])


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim (times `weight` if given), computed in float32, returned in x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


def norm_rope(x: torch.Tensor, freqs: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """apply_rope(rms_norm(x, eps, weight), freqs)."""
    return apply_rope(rms_norm(x, eps, weight), freqs)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x: [N, ..., D]; freqs from Rotary.table, [N, rope_dim/2], broadcast over the middle dims. Rotates the
    trailing rope_dim channels in interleaved pairs (as complex numbers); `inverse` rotates by -angle."""
    rope_dim = 2 * freqs.shape[-1]
    freqs = freqs.view((freqs.shape[0],) + (1,) * (x.dim() - 2) + (-1,))
    if inverse:
        freqs = freqs.conj()
    out = x.clone()
    rope = out[..., -rope_dim:]
    if x.dtype == torch.float32:
        torch.view_as_complex(rope.unflatten(-1, (-1, 2))).mul_(freqs)
    else:  # rotate in float32, store back in x's dtype
        rotated = torch.view_as_complex(rope.float().unflatten(-1, (-1, 2))) * freqs
        rope.copy_(torch.view_as_real(rotated).flatten(-2))
    return out
