"""TorchBackend: every op in torch, the reference (what autograd and any torch device run) and the interface
every backend implements. Each op takes typed weights (model/weights.py) and activations and runs the torch
statement of its math (model/torch_math/); the pieces that contain other ops (`block`, `attention`, `moe`,
`blocks`, `mtp`) pass `self` on, so that a subclass that replaces a small op replaces it inside them too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from leanserve.model.torch_math import attention, blocks, compressor, mhc, moe, ops
from leanserve.model.weights import (
    AttentionWeights,
    BlockWeights,
    CompressorWeights,
    MixWeights,
    MoEWeights,
    MTPWeights,
    StageWeights,
)

if TYPE_CHECKING:
    from leanserve.model.batch import CompressMeta, ForwardBatch
    from leanserve.model.cache import LayerCache


class TorchBackend:
    name = "torch"
    needs = "nothing"  # (what select_backend's error says a backend needs)

    @classmethod
    def why_not(cls, device: str | torch.device, weight_dtype: torch.dtype) -> str | None:
        """Why this backend cannot run a stage on `device` with `weight_dtype` weights; None when it can."""
        return None

    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """The dtype of activations and caches with weights of `weight_dtype`."""
        return weight_dtype

    # --- small ops ------------------------------------------------------------------------------------
    def linears(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """x [..., in] @ w^T for each weight [out, in] (the projections that read the same input)."""
        return ops.linears(x, weights)

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, G, in], weight [G * out, in] -> [T, G, out]."""
        return ops.grouped_linear(x, weight)

    def rms_norm(self, x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
        return ops.rms_norm(x, eps, weight)

    def norm_rope(self, x: torch.Tensor, freqs: torch.Tensor, eps: float, weight=None) -> torch.Tensor:
        """RoPE of the RMSNorm of x [N, ..., D] (per head)."""
        return ops.norm_rope(x, freqs, eps, weight)

    def apply_rope(self, x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return ops.apply_rope(x, freqs, inverse)

    def experts(self, rows, counts, w13, w2, limit: float) -> torch.Tensor:
        """rows [N, hidden] grouped by expert (counts [E]) through their experts' SwiGLU: [N, hidden]."""
        return ops.experts(rows, counts, w13, w2, limit)

    # --- mHC ------------------------------------------------------------------------------------------
    def hc_pre(self, streams: torch.Tensor, w: MixWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return mhc.hc_pre(streams, w)

    def hc_post(self, block_out, streams, post, comb) -> torch.Tensor:
        return mhc.hc_post(block_out, streams, post, comb)

    def hc_head(self, streams: torch.Tensor, w: MixWeights) -> torch.Tensor:
        """The head's input [T, hidden]: hc_head and the norm before the head, over streams [T, hc, hidden]."""
        return mhc.hc_head(streams, w)

    # --- the pieces -----------------------------------------------------------------------------------
    def compress(self, w: CompressorWeights, kv, gate, meta: CompressMeta, kv_ring, gate_ring, rows, row_rope) -> None:
        compressor.compress(self, w, kv, gate, meta, kv_ring, gate_ring, rows, row_rope)

    def attend(self, w: AttentionWeights, q, ring, new_kv, fb: ForwardBatch, cache: LayerCache, iq, rope):
        return attention.attend(self, w, q, ring, new_kv, fb, cache, iq, rope)

    def attention(self, w: AttentionWeights, x, fb: ForwardBatch, cache: LayerCache, ropes: dict, rows=None):
        return attention.attention(self, w, x, fb, cache, ropes, rows)

    def moe(self, w: MoEWeights, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return moe.moe(self, w, x, input_ids)

    def block(self, w: BlockWeights, streams, fb: ForwardBatch, cache: LayerCache, ropes: dict, rows=None):
        return blocks.block(self, w, streams, fb, cache, ropes, rows)

    # --- whole steps ----------------------------------------------------------------------------------
    def run_blocks(
        self, w: StageWeights, fb: ForwardBatch, caches: Sequence[LayerCache], streams: torch.Tensor | None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The stage's blocks over a step (embedding first on the first stage, `streams` None): the output
        streams at `rows` (None: all; the others' last MoE is not run)."""
        return blocks.blocks(self, w, fb, caches, streams, rows)

    def run_mtp(self, w: MTPWeights, streams, fb: ForwardBatch, cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over a step (fb: the t+1 tokens), from the embedding on: (the head's input [T', hidden],
        its output streams [T', hc, hidden]) at the rows fb.logits_index (None: all)."""
        return blocks.mtp(self, w, streams, fb, cache)


TORCH = TorchBackend()  # (the modules' backend until build_model hands them the stage's)
