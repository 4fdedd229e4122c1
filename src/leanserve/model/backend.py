"""The backend seam: which statement of the model's math a stage runs, chosen once when the stage is built.

The model modules own the parameters and say what is computed, op by op, through `self.ops`, the stage's
backend; they hold no backend or device branches. A backend is an object with the methods of `TorchBackend`:

- `TorchBackend` runs the torch statement of every op (torch_ops.py, hyper.py and the modules' `*_torch`
  methods): the reference, what autograd and any torch device run;
- `CpuBackend` (cpu_backend.py) runs the numba kernels (cpu_kernels/) where they apply, decode-sized steps as
  numpy arrays through them (decode.py), and falls back to the torch statement for the rest.

`select_backend` is the one place that decides, from the device, the weight dtype and whether the kernels are
available; `build_model` hands the choice to every module (`set_backend`). A new device (CUDA) is a new
backend class; a new weight format is a weight type the backends' `linears` / `experts` / `moe` take.
"""

from __future__ import annotations

import torch

from leanserve.config import BACKENDS
from leanserve.model import hyper, torch_ops
from leanserve.model.hyper import MixWeights


class TorchBackend:
    """Every op in torch. Methods taking a module call back its torch statement (`module.*_torch`), so that the
    math of attention, the compressor and the MoE stays beside their parameters."""

    name = "torch"

    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """The dtype of activations and caches with weights of `weight_dtype`."""
        return weight_dtype

    # --- small ops ------------------------------------------------------------------------------------
    def linears(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """x [..., in] @ w^T for each weight [out, in] (the projections that read the same input)."""
        return torch_ops.linears(x, weights)

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, G, in], weight [G, out, in] -> [T, G, out]."""
        return torch_ops.grouped_linear(x, weight)

    def rms_norm(self, x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
        return torch_ops.rms_norm(x, eps, weight)

    def norm_rope(self, x: torch.Tensor, freqs: torch.Tensor, eps: float, weight=None) -> torch.Tensor:
        """RoPE of the RMSNorm of x [N, ..., D] (per head)."""
        return torch_ops.norm_rope(x, freqs, eps, weight)

    def apply_rope(self, x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return torch_ops.apply_rope(x, freqs, inverse)

    # --- mHC ------------------------------------------------------------------------------------------
    def hc_pre(self, streams: torch.Tensor, w: MixWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hyper.hc_pre(streams, w)

    def hc_post(self, block_out, streams, post, comb) -> torch.Tensor:
        return hyper.hc_post(block_out, streams, post, comb)

    def hc_head(self, streams: torch.Tensor, w: MixWeights) -> torch.Tensor:
        return hyper.hc_head(streams, w)

    def head_hidden(self, owner, streams: torch.Tensor) -> torch.Tensor:
        """hc_head of a module with a head (the last stage, the MTP layer): its `head_mix()` over `streams`."""
        return self.hc_head(streams, owner.head_mix())

    # --- whole pieces (their torch statement lives on the module) --------------------------------------
    def compress(self, comp, kv, gate, meta, kv_ring, gate_ring, rows, row_rope) -> None:
        comp.step_torch(kv, gate, meta, kv_ring, gate_ring, rows, row_rope)

    def attend(self, attn, q, ring, new_kv, fb, cache, index_queries, rope) -> torch.Tensor:
        return attn.attend_torch(q, ring, new_kv, fb, cache, index_queries, rope)

    def experts(self, rows, counts, w13, w2, limit: float) -> torch.Tensor:
        """rows [N, hidden] grouped by expert (counts [E]) through their experts' SwiGLU: [N, hidden]."""
        return torch_ops.experts(rows, counts, w13, w2, limit)

    def moe(self, moe, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return moe.forward_torch(x, input_ids)

    def run_blocks(self, model, fb, caches, streams: torch.Tensor | None) -> torch.Tensor:
        """The stage's blocks over a step (embedding first on the first stage): the output streams."""
        return model.blocks_torch(fb, caches, model.ropes(fb), streams)

    def run_mtp(self, model, streams, fb, caches) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over a step (fb: the t+1 tokens), from the embedding on: (the head's input at the rows
        fb.logits_index [T', hidden], its output streams [T, hc, hidden])."""
        return model.mtp_torch(streams, fb, caches)


TORCH = TorchBackend()


class UsesBackend:
    """Mixin of the model's modules: `self.ops` is the stage's backend (torch until `set_backend`)."""

    ops: TorchBackend = TORCH


def set_backend(model: torch.nn.Module, backend: TorchBackend) -> None:
    """Hands `backend` to every module of `model` (build_model does this once, when the stage is built)."""
    for m in model.modules():
        if isinstance(m, UsesBackend):
            m.ops = backend


def select_backend(device: str | torch.device, weight_dtype: torch.dtype, name: str = "auto") -> TorchBackend:
    """The backend a stage runs: "auto" takes the CPU kernels on a CPU for float32 or bfloat16 weights when
    numba is installed, else torch; "torch" or "cpu" ask for one (a ValueError says why "cpu" cannot run)."""
    from leanserve.model import cpu_kernels

    if name not in BACKENDS:
        raise ValueError(f"Unknown backend {name!r}; choose one of {', '.join(BACKENDS)}.")
    if name == "torch":
        return TorchBackend()
    on_cpu = torch.device(device).type == "cpu"
    kernels_take = on_cpu and weight_dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()
    if name == "cpu" and not kernels_take:
        why = "numba is not installed" if cpu_kernels.numba is None else f"the device is {device} with {weight_dtype}"
        raise ValueError(f"The cpu backend needs a CPU, float32 or bfloat16 weights and numba, but {why}.")
    if not kernels_take:
        return TorchBackend()
    from leanserve.model.cpu_backend import CpuBackend

    return CpuBackend()
