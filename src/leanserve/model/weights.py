"""The typed weights: what a backend op takes besides activations, one frozen dataclass per piece of the model.

The nn.Modules own the parameters and export these (`weights()`); the backends take them, so that neither side
imports the other. Each holds the module's own parameter objects (no copies): loading fills them in place and
`.data =` swaps their storage, and both show through. A tensor field may instead hold a published checkpoint's
weight as stored (quant.py: Fp8Weight, Fp4Weight, Fp8Experts). The CPU backend reads the same dataclasses with
each tensor replaced by its numpy view (backends/cpu/views.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixWeights:
    """One mHC site: hc_pre's projection fn [(2 + hc) * hc, hc * D], base and scale [3] (pre, post, comb), or
    hc_head's ([hc, hc * D], [hc], [1], with sinkhorn_iters 0); all float32. `norm_weight` [D] is the RMSNorm
    of the collapsed streams (the block's attn_norm / ffn_norm, or the final norm)."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    hc_eps: float
    sinkhorn_iters: int


@dataclass(frozen=True)
class CompressorWeights:
    """A compressor's gate bias and norm. (Its projections wkv and wgate are in AttentionWeights.inputs: the
    attention computes them with its other projections of the same input.)"""

    ape: torch.Tensor  # [ratio, width] float32: per-slot gate bias
    norm_weight: torch.Tensor  # [dim]
    eps: float
    overlap: bool  # CSA (overlapping windows, width 2 * dim) or HCA

    @property
    def ratio(self) -> int:
        return self.ape.shape[0]

    @property
    def dim(self) -> int:
        return self.norm_weight.shape[0]


@dataclass(frozen=True)
class IndexerWeights:
    """The Lightning Indexer's query projection, its shape and its own compressor."""

    wq_b: torch.Tensor  # [heads * head_dim, q_lora_rank]
    heads: int
    head_dim: int
    topk: int
    compressor: CompressorWeights


@dataclass(frozen=True)
class AttentionWeights:
    """An attention layer's tensors and constants."""

    inputs: tuple[torch.Tensor, ...]  # projections of the layer input, see Attention.input_weights
    q_norm: torch.Tensor
    q_eps: float
    wq_b: torch.Tensor
    kv_norm: torch.Tensor
    eps: float  # of the per-head query norm and the kv norm
    wo_a: torch.Tensor  # [groups * o_lora_rank, heads * head_dim / groups]: group g's rows g * o_lora_rank...
    o_groups: int
    wo_b: torch.Tensor
    sink: torch.Tensor  # [heads] float32
    heads: int
    head_dim: int
    layer_type: str
    rope_kind: str  # "main" (sliding layers) or "compress"
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None


@dataclass(frozen=True)
class MoEWeights:
    """A MoE layer's tensors and routing constants."""

    gate: torch.Tensor  # [E, hidden]
    bias: torch.Tensor | None  # a top-k router's correction bias [E]; None on hash layers
    tid2eid: torch.Tensor | None  # a hash layer's token -> experts table [vocab, k]; None on top-k layers
    top_k: int
    scoring: str  # sqrtsoftplus | sigmoid | softmax
    route_scale: float  # routed_scaling_factor
    w13: torch.Tensor  # [E, 2I, hidden]: gate | up
    w2: torch.Tensor  # [E, hidden, I]
    shared_w1: torch.Tensor
    shared_w3: torch.Tensor
    shared_w2: torch.Tensor
    limit: float  # SwiGLU clamp

    @property
    def w13_entries(self) -> int:
        """One expert's gate | up entries (hidden x 2I), however stored."""
        return self.w13.shape[1] * self.w13.shape[2]


@dataclass(frozen=True)
class BlockWeights:
    """A decoder block: mHC around the attention, then mHC around the MoE."""

    attn_mix: MixWeights
    attn: AttentionWeights
    ffn_mix: MixWeights
    moe: MoEWeights


@dataclass(frozen=True)
class RopeTables:
    """The RoPE tables [max_positions, rope_dim / 2] complex: `main` for sliding layers, `compress` (None when the
    stage has no compressed layer) for compressed layers and their compressed rows."""

    main: torch.Tensor
    compress: torch.Tensor | None


@dataclass(frozen=True)
class StageWeights:
    """What a stage's blocks need: the embedding table (first stage; None on others), its blocks, the RoPE
    tables, the number of mHC streams and the activations' dtype (where the embedding's rows are cast to)."""

    embed: torch.Tensor | None
    blocks: tuple[BlockWeights, ...]
    rope: RopeTables
    hc_mult: int
    act_dtype: torch.dtype


@dataclass(frozen=True)
class MTPWeights:
    """The MTP layer: its input norms and projections, its block, its hc_head with the norm before the shared
    head, and what it shares with the trunk (the embedding table, the RoPE tables)."""

    hnorm: torch.Tensor
    enorm: torch.Tensor
    h_proj: torch.Tensor  # (or an Fp8Weight: a published checkpoint's)
    e_proj: torch.Tensor
    eps: float
    block: BlockWeights
    head: MixWeights
    embed: torch.Tensor
    rope: RopeTables
    act_dtype: torch.dtype
