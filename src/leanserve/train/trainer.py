"""Training a small DeepSeek-V4-architecture model and its MTP layer, jointly, DeepSeek-style:

    loss = CE(trunk logits at t, token t+1) + w_mtp * CE(MTP logits at t, token t+2)
           (+ the Lightning Indexer's own KL loss, which only reaches the indexer's parameters)

The MTP layer at position t sees the trunk's pre-hc_head streams at t and the embedding of token t+1.

The model's own forward is written for inference (cache rings written in place, per-token gathers). Training
uses a batched formulation of the same math over whole sequences that start at position 0: sliding-window
attention in blocks of queries, compressed entries computed for every window at once, the indexer's top-k
as a mask. It reads the model's own parameters and reuses its pure functions (hc_pre / hc_post / hc_head,
RoPE, norms); `check_parity` compares it with the model's inference forward before training starts, so the
two cannot drift apart silently.

Two parts of DeepSeek-V4 get no gradient from the language-model loss, and are trained as DeepSeek does:
  * the Lightning Indexer (its top-k is a selection): a KL loss pulls its distribution over compressed
    entries towards the main attention's (heads averaged, detached); its inputs are detached;
  * the top-k router's correction bias (selection only): auxiliary-loss-free balancing, after every step
    bias_e += gamma * sign(mean load - load_e).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from leanserve.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ConfigError, ModelConfig, RopeConfig
from leanserve.model.attention import Attention
from leanserve.model.block import Block
from leanserve.model.compressor import Compressor, Indexer
from leanserve.model.deepseek_v4 import DeepseekV4, build_model
from leanserve.model.hyper import hc_head
from leanserve.model.layers import RMSNorm, apply_rope, rms_norm
from leanserve.model.moe import MoE, score, swiglu
from leanserve.train import data as data_mod

# --- the model -----------------------------------------------------------------------------------------
# The default shipped model: every attention kind and both MoE kinds, windows and compression rates small
# enough that a 512-token context crosses many boundaries, and an indexer that keeps 16 of the 128 CSA rows.
DEFAULT_MODEL: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=32,
    q_lora_rank=128,
    o_groups=2,
    o_lora_rank=128,
    n_routed_experts=8,
    num_experts_per_tok=2,
    hc_mult=4,
    sliding_window=64,
    compress_rate_csa=4,
    compress_rate_hca=16,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=16,
    max_position_embeddings=4096,
    num_nextn_predict_layers=1,
)


def layer_pattern(num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Attention kinds: sliding first, then CSA / HCA alternating; MoE: a hash layer first, then top-k."""
    if num_layers < 3:
        raise ConfigError(
            f"num_hidden_layers must be >= 3 so that every attention kind (sliding, CSA, HCA) is trained, got {num_layers}."
        )
    attn = tuple([SLIDING] + [CSA if i % 2 == 0 else HCA for i in range(num_layers - 1)])
    mlp = tuple([HASH_MOE] + [MOE] * (num_layers - 1))
    return attn, mlp


def model_config(**overrides: Any) -> ModelConfig:
    """DEFAULT_MODEL with `overrides`; ModelConfig's own validation names any field that does not fit."""
    fields_ = {**DEFAULT_MODEL, **overrides}
    n = fields_["num_hidden_layers"]
    if isinstance(n, bool) or not isinstance(n, int):
        raise ConfigError(f"num_hidden_layers must be an integer, got {n!r}.")
    attn, mlp = layer_pattern(n)
    fields_.setdefault("layer_types", attn)
    fields_.setdefault("mlp_layer_types", mlp)
    fields_.setdefault("compress_rope", RopeConfig(theta=160000.0))
    fields_.update(
        bos_token_id=data_mod.BOS_ID,
        eos_token_ids=(data_mod.EOS_ID,),
        pad_token_id=data_mod.PAD_ID,
        torch_dtype="bfloat16",
    )
    try:
        return ModelConfig(**fields_)
    except TypeError as e:
        raise ConfigError(f"Bad model field: {e}.") from None


def check_trainable(cfg: ModelConfig, seq_len: int) -> None:
    """What the batched training forward needs beyond ModelConfig's own validation."""
    if cfg.num_nextn_predict_layers != 1:
        raise ConfigError(
            f"Training supports exactly one MTP layer, got num_nextn_predict_layers={cfg.num_nextn_predict_layers}."
        )
    if seq_len < 8:
        raise ConfigError(f"seq_len must be at least 8, got {seq_len}.")
    if seq_len > cfg.max_position_embeddings:
        raise ConfigError(f"seq_len ({seq_len}) exceeds max_position_embeddings ({cfg.max_position_embeddings}).")
    if seq_len < cfg.compress_rate_hca:
        raise ConfigError(
            f"seq_len ({seq_len}) is shorter than one HCA window ({cfg.compress_rate_hca}); HCA would never be trained."
        )


def parameter_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = DeepseekV4(cfg, max_positions=1, with_mtp=cfg.has_mtp)
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def init_weights_(model: DeepseekV4, seed: int) -> DeepseekV4:
    """A trainable init (GPT-2-like): projections N(0, 0.02), the projections writing into the residual
    scaled by 1/sqrt(2 * blocks), norms 1, mHC as transformers initialises it (fn N(0, 0.02), base 0,
    scale 1), sinks / ape / router biases 0, hash routing: distinct random experts per token id."""
    gen = torch.Generator().manual_seed(seed)
    std = model.cfg.initializer_range
    blocks = model.cfg.num_hidden_layers + model.cfg.num_nextn_predict_layers
    residual_std = std / math.sqrt(2 * blocks)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if id(p) in norms or leaf.endswith("_scale"):
            p.fill_(1.0)
        elif leaf.endswith("_base") or leaf in ("attn_sink", "ape") or name.endswith("gate.bias"):
            p.zero_()
        else:
            out_proj = name.endswith(("attn.wo_b.weight", "shared_experts.w2.weight", "experts.w2"))
            p.copy_(torch.randn(p.shape, generator=gen) * (residual_std if out_proj else std))
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            experts = model.cfg.n_routed_experts
            buf.copy_(torch.rand(buf.shape[0], experts, generator=gen).argsort(dim=-1)[:, : buf.shape[1]])
    return model


def new_model(cfg: ModelConfig, seq_len: int, seed: int) -> DeepseekV4:
    model = build_model(cfg, max_positions=seq_len, dtype=torch.float32, with_mtp=True)
    init_weights_(model, seed)
    for name, p in model.named_parameters():
        # the router's correction bias is set by the balancing rule, not by gradients
        p.requires_grad_(not name.endswith("gate.bias"))
    return model


# --- the batched training forward ----------------------------------------------------------------------
@dataclass
class Ctx:
    """Per-(batch size, seq len) constants: RoPE tables and masks, all for positions 0..L-1."""

    batch: int
    length: int
    block: int  # queries per attention block (= the sliding window)
    padded: int  # length rounded up to a multiple of `block`
    main_rope: tuple[torch.Tensor, torch.Tensor]  # [B*L, rope] each
    compress_rope: tuple[torch.Tensor, torch.Tensor] | None
    row_rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # per kind: [B*rows, rope]
    window_mask: torch.Tensor  # [nb, block, block + window] bool
    visible: dict[str, torch.Tensor]  # per kind: [L, rows] bool
    stats: dict[str, Any] = field(default_factory=dict)  # filled by the forward: router loads, indexer loss


def make_ctx(model: DeepseekV4, batch: int, length: int) -> Ctx:
    cfg = model.cfg
    window = cfg.sliding_window
    block = window
    padded = -(-length // block) * block
    pos = torch.arange(length).repeat(batch)
    main = model.rotary_main.table(pos)
    compress, row_rope, visible = None, {}, {}
    if model.rotary_compress is not None:
        compress = model.rotary_compress.table(pos)
        for kind in (CSA, HCA):
            r = cfg.compress_rate(kind)
            rows = length // r
            row_rope[kind] = model.rotary_compress.table((torch.arange(rows) * r).repeat(batch))
            visible[kind] = torch.arange(rows)[None, :] < ((torch.arange(length) + 1) // r)[:, None]
    # Block b holds queries [b*Q, (b+1)*Q) and keys [b*Q - W, (b+1)*Q): query p sees keys (p - W, p].
    q_pos = torch.arange(padded).view(-1, block)  # [nb, Q]
    k_pos = q_pos[:, :1] - window + torch.arange(block + window)  # [nb, Q + W]
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    mask = (diff >= 0) & (diff < window) & (k_pos[:, None, :] >= 0)
    return Ctx(batch, length, block, padded, main, compress, row_rope, mask, visible)


def _compress(comp: Compressor, x: torch.Tensor, ctx: Ctx, kind: str) -> torch.Tensor:
    """Every window's compressed entry at once: x [B, L, hidden] -> [B, L // r, dim] (RoPE'd)."""
    r, d = comp.ratio, comp.dim
    batch, rows = x.shape[0], x.shape[1] // r
    x = x[:, : rows * r]
    width = 2 * d if comp.overlap else d
    kv = comp.wkv(x).view(batch, rows, r, width)
    gate = comp.wgate(x).view(batch, rows, r, width) + comp.ape
    if comp.overlap:
        # Ca (first half) of window w-1 and Cb (second half) of window w pool into entry w.
        prev_kv = F.pad(kv[:, :-1, :, :d], (0, 0, 0, 0, 1, 0))
        prev_gate = F.pad(gate[:, :-1, :, :d], (0, 0, 0, 0, 1, 0), value=float("-inf"))
        kv = torch.cat([prev_kv, kv[..., d:]], dim=2)
        gate = torch.cat([prev_gate, gate[..., d:]], dim=2)
    weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
    entries = comp.norm((kv * weights).sum(dim=2))  # [B, rows, d]
    return apply_rope(entries.reshape(batch * rows, d), *ctx.row_rope[kind]).view(batch, rows, d)


def _indexer_scores(idx: Indexer, x: torch.Tensor, q_residual: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """The Lightning Indexer's score of every compressed entry for every token: [B, L, rows], -inf where the
    entry is not visible yet. x: [B, L, hidden], q_residual: [B*L, q_lora]."""
    batch, length = x.shape[:2]
    rows = _compress(idx.compressor, x, ctx, CSA)  # [B, n, dh]
    q = idx.wq_b(q_residual).view(batch * length, idx.n_heads, idx.head_dim)
    q = apply_rope(q, *ctx.compress_rope).view(batch, length * idx.n_heads, idx.head_dim)
    scores = F.relu(torch.bmm(q, rows.transpose(1, 2))) * idx.head_dim**-0.5  # [B, L*H, n]
    head_w = idx.weights_proj(x).float() * idx.n_heads**-0.5  # [B, L, H]
    scores = torch.matmul(head_w.unsqueeze(2), scores.view(batch, length, idx.n_heads, -1)).squeeze(2)
    return scores.masked_fill(~ctx.visible[CSA], float("-inf"))


def _attention(attn: Attention, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """x: [B*L, hidden] (normed) -> [B*L, hidden]."""
    batch, length, block, padded = ctx.batch, ctx.length, ctx.block, ctx.padded
    heads, dim = attn.n_heads, attn.head_dim
    rope = ctx.main_rope if attn.rope_kind == "main" else ctx.compress_rope
    q_residual = attn.q_norm(attn.wq_a(x))
    q = apply_rope(rms_norm(attn.wq_b(q_residual).view(-1, heads, dim), attn.eps), *rope)
    kv = apply_rope(attn.norm(attn.wkv(x)), *rope)  # [B*L, D]

    nb, window = padded // block, ctx.window_mask.shape[-1] - block
    pad = padded - length
    q_blocks = F.pad(q.view(batch, length, heads, dim), (0, 0, 0, 0, 0, pad)).view(batch, nb, block * heads, dim)
    kv_pad = F.pad(kv.view(batch, length, dim), (0, 0, window, pad))  # [B, W + Lp, D]
    keys = kv_pad.unfold(1, block + window, block).transpose(2, 3)  # [B, nb, Q + W, D]
    mask = ctx.window_mask.view(1, nb, block, 1, -1).expand(batch, -1, -1, -1, -1)
    selected = None
    if attn.compressor is not None:
        kind = attn.layer_type
        x3 = x.view(batch, length, -1)
        comp = _compress(attn.compressor, x3, ctx, kind)  # [B, n, D]
        n = comp.shape[1]
        visible = ctx.visible[kind]  # [L, n]
        if attn.indexer is not None:
            idx_scores = _indexer_scores(attn.indexer, x3.detach(), q_residual.detach(), ctx)  # [B, L, n]
            if n <= attn.indexer.topk:
                selected = visible.expand(batch, -1, -1)
            else:
                picked = (
                    idx_scores.detach().sort(dim=-1, descending=True, stable=True).indices[..., : attn.indexer.topk]
                )
                selected = torch.zeros_like(idx_scores, dtype=torch.bool).scatter_(-1, picked, True) & visible
        else:
            selected = visible.expand(batch, -1, -1)
        selected = F.pad(selected, (0, 0, 0, pad)).view(batch, nb, block, 1, n)
        keys = torch.cat([keys, comp.unsqueeze(1).expand(-1, nb, -1, -1)], dim=2)
        mask = torch.cat([mask, selected], dim=-1)
    scores = torch.matmul(q_blocks, keys.transpose(-1, -2)) * dim**-0.5  # [B, nb, Q*H, K]
    scores = scores.view(batch, nb, block, heads, -1)
    if attn.indexer is not None and torch.is_grad_enabled():
        # Target of the indexer: the main attention's distribution over the visible compressed entries.
        with torch.no_grad():
            main = scores[..., -n:].detach().reshape(batch, padded, heads, n)[:, :length]
            main = main.masked_fill(~visible[None, :, None, :], float("-inf"))
            has_rows = visible.any(dim=-1)  # tokens that see at least one entry
            target = main[:, has_rows].float().softmax(dim=-1).mean(dim=2)  # [B, L', n]
        log_q = idx_scores[:, has_rows].float().log_softmax(dim=-1)
        kl = (target * (target.clamp_min(1e-30).log() - log_q.clamp_min(-1e4))).sum(-1).mean()
        ctx.stats.setdefault("indexer_kl", []).append(kl)
    scores = scores.masked_fill(~mask, float("-inf"))
    sinks = attn.attn_sink.to(scores.dtype).view(1, 1, 1, heads, 1).expand(batch, nb, block, -1, 1)
    probs = torch.cat([scores, sinks], dim=-1).float().softmax(dim=-1)[..., :-1].to(keys.dtype)
    out = torch.matmul(probs.view(batch, nb, block * heads, -1), keys)  # [B, nb, Q*H, D]
    out = out.view(batch, padded, heads, dim)[:, :length].reshape(batch * length, heads, dim)
    out = apply_rope(out, *rope, inverse=True)
    grouped = out.reshape(batch * length, attn.o_groups, -1)
    w = attn.wo_a.weight.view(attn.o_groups, -1, grouped.shape[-1])
    projected = torch.einsum("tgi,goi->tgo", grouped, w).flatten(1)
    return attn.wo_b(projected)


def _moe(moe: MoE, x: torch.Tensor, input_ids: torch.Tensor, ctx: Ctx, stats_key: str) -> torch.Tensor:
    gate, experts_mod = moe.gate, moe.experts
    scores = score(F.linear(x, gate.weight).float(), gate.scoring_func)  # [T, E]
    if gate.is_hash:
        experts = gate.tid2eid[input_ids]
    else:
        experts = torch.topk(scores + gate.bias, gate.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * gate.scale

    top_k, num_experts = experts.shape[1], experts_mod.w13.shape[0]
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=num_experts)
    if not gate.is_hash:
        ctx.stats.setdefault("loads", {})[stats_key] = counts
    xs = x[token_of]
    outs, start = [], 0
    for e, count in enumerate(counts.tolist()):
        if count:
            gate_up = F.linear(xs[start : start + count], experts_mod.w13[e])
            g, u = gate_up.chunk(2, dim=-1)
            outs.append(F.linear(swiglu(g, u, experts_mod.limit), experts_mod.w2[e]))
            start += count
    ys = torch.cat(outs) * weights.flatten()[order, None].to(x.dtype)
    routed = torch.zeros_like(x).index_add(0, token_of, ys)
    return routed + moe.shared_experts(x)


def _hc_pre(streams: torch.Tensor, block: Block, site: str):
    """leanserve.model.hyper.hc_pre for float32 training, with fewer passes over the [T, hc, D] streams:
    the RMS normalisation is applied to the (few) mixes instead of the streams, and the collapse is a bmm."""
    fn, base, scale = (getattr(block, f"hc_{site}_{p}") for p in ("fn", "base", "scale"))
    hc, eps = streams.shape[1], block.hc_eps
    flat = streams.flatten(1)
    inv_rms = torch.rsqrt(
        torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square() / flat.shape[1] + block.norm_eps
    )
    mixes = F.linear(flat, fn) * inv_rms  # [T, (2 + hc) * hc]
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(block.sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return torch.bmm(pre.unsqueeze(1), streams).squeeze(1), post, comb


def _hc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """leanserve.model.hyper.hc_post as one bmm: out[j] = post[j] * f(x) + sum_i comb[i, j] * x[i]."""
    mix = torch.cat([post.unsqueeze(-1), comb.transpose(-1, -2)], dim=-1)  # [T, hc, 1 + hc]
    return torch.bmm(mix, torch.cat([block_out.unsqueeze(1), streams], dim=1))


def _block(block: Block, streams: torch.Tensor, input_ids: torch.Tensor, ctx: Ctx, key: str) -> torch.Tensor:
    def pre(site: str):
        return _hc_pre(streams, block, site)

    x, post, comb = pre("attn")
    streams = _hc_post(_attention(block.attn, block.attn_norm(x), ctx), streams, post, comb)
    x, post, comb = pre("ffn")
    return _hc_post(_moe(block.ffn, block.ffn_norm(x), input_ids, ctx, key), streams, post, comb)


def forward_train(model: DeepseekV4, ids: torch.Tensor, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: [B, L + 2]. Returns (trunk logits [B*L, V] for tokens 1..L, MTP logits [B*L, V] for tokens 2..L+1)."""
    cfg, length = model.cfg, ctx.length
    ctx.stats = {}
    trunk_in = ids[:, :length].reshape(-1)
    x = model.embed(trunk_in)
    streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1)
    for key, block in model.layers.items():
        streams = _block(block, streams, trunk_in, ctx, key)
    logits = model.logits(model.head_hidden(streams))

    mtp = model.mtp["0"]
    mtp_in = ids[:, 1 : length + 1].reshape(-1)  # the MTP layer at t embeds token t+1
    h = mtp.h_proj(mtp.hnorm(streams)) + mtp.e_proj(mtp.enorm(model.embed(mtp_in))).unsqueeze(1)
    out = _block(mtp, h, mtp_in, ctx, "mtp.0")
    hidden = mtp.norm(hc_head(out, mtp.hc_head_fn, mtp.hc_head_base, mtp.hc_head_scale, mtp.norm_eps, mtp.hc_eps))
    return logits, model.logits(hidden)


@dataclass(frozen=True)
class Losses:
    total: torch.Tensor
    lm: float
    mtp: float
    indexer: float


def compute_losses(model: DeepseekV4, ids: torch.Tensor, ctx: Ctx, w_mtp: float, w_indexer: float) -> Losses:
    length = ctx.length
    logits, mtp_logits = forward_train(model, ids, ctx)
    lm = F.cross_entropy(logits, ids[:, 1 : length + 1].reshape(-1))
    mtp = F.cross_entropy(mtp_logits, ids[:, 2 : length + 2].reshape(-1))
    kls = ctx.stats.get("indexer_kl", [])
    indexer = torch.stack(kls).mean() if kls else torch.zeros(())
    total = lm + w_mtp * mtp + w_indexer * indexer
    return Losses(total, lm.item(), mtp.item(), indexer.item())


@torch.no_grad()
def balance_routers_(model: DeepseekV4, ctx: Ctx, gamma: float) -> None:
    """DeepSeek's auxiliary-loss-free balancing: nudge each top-k router's bias towards equal loads."""
    loads = ctx.stats.get("loads", {})
    for key, counts in loads.items():
        block = model.mtp["0"] if key == "mtp.0" else model.layers[key]
        counts = counts.float()
        block.ffn.gate.bias.add_(gamma * torch.sign(counts.mean() - counts))


# --- parity with the inference forward ------------------------------------------------------------------
@torch.no_grad()
def check_parity(model: DeepseekV4, ids: torch.Tensor, tol: float = 2e-3) -> float:
    """Runs the batched training forward and the model's own (inference) forward + MTP forward on `ids`
    [B, L + 2] and returns the largest difference of their log-probabilities; raises RuntimeError if it
    exceeds `tol` on more than 1% of the positions (a rare near-tie of the indexer may flip one selection)."""
    from leanserve.model.batch import Chunk, build_forward_batch
    from leanserve.model.cache import CacheGeometry

    batch, length = ids.shape[0], ids.shape[1] - 2
    ctx = make_ctx(model, batch, length)
    logits, mtp_logits = forward_train(model, ids, ctx)
    ref, ref_mtp = inference_logits(model, ids[:, : length + 1], Chunk, build_forward_batch, CacheGeometry)
    diffs = []
    for a, b in ((logits, ref), (mtp_logits, ref_mtp)):
        diffs.append((a.log_softmax(-1) - b.log_softmax(-1)).abs().amax(dim=-1))
    worst = torch.cat(diffs)
    bad = (worst > tol).float().mean().item()
    if bad > 0.01:
        raise RuntimeError(
            f"The training forward disagrees with the model's inference forward on {bad:.1%} of positions "
            f"(max |log p| difference {worst.max().item():.3g}); the model code changed in a way the trainer "
            "does not follow."
        )
    return worst.max().item()


def inference_logits(model: DeepseekV4, ids: torch.Tensor, Chunk, build_forward_batch, CacheGeometry):
    """The inference path: trunk logits at positions 0..L-1 of ids [B, L+1] and MTP logits at 0..L-1 (the MTP
    layer at t embedding ids[t+1])."""
    batch, length = ids.shape[0], ids.shape[1] - 1
    geo = CacheGeometry.build(model.cfg, num_slots=batch, max_model_len=length + 1)
    dtype = next(p.dtype for n, p in model.named_parameters() if n.endswith("wkv.weight"))
    caches = model.allocate_cache(geo, dtype)
    rows = ids.tolist()
    fb = build_forward_batch([Chunk(i, 0, r[:length]) for i, r in enumerate(rows)], geo)
    hidden = torch.empty(fb.num_tokens, model.cfg.hc_dim, dtype=dtype)
    logits = model(fb, caches, target_hidden=hidden)
    mtp_fb = build_forward_batch([Chunk(i, 0, r[1 : length + 1]) for i, r in enumerate(rows)], geo)
    streams = hidden.view(fb.num_tokens, model.cfg.hc_mult, model.cfg.hidden_size)
    mtp_logits, _ = model.mtp_forward(streams, mtp_fb, caches)
    return logits, mtp_logits


# --- the training run -----------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    out: str
    corpus: str | None = None  # None: the running interpreter's standard library
    seed: int = 0
    steps: int | None = None  # exactly this many steps (deterministic) ...
    minutes: float | None = None  # ... or a wall-clock budget (LR schedule follows elapsed time)
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    w_mtp: float = 0.3
    w_indexer: float = 1.0
    balance_gamma: float = 1e-3
    threads: int = 2
    vocab_size: int = 4096
    save_every_minutes: float = 10.0
    eval_tokens: int = 32768  # after training: held-out figures through leanserve's inference path (0: skip)
    progress: bool = True
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig overrides of DEFAULT_MODEL

    def validate(self) -> None:
        if (self.steps is None) == (self.minutes is None):
            raise ValueError("Give exactly one of steps or minutes.")
        if self.steps is not None and (
            isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1
        ):
            raise ValueError(f"steps must be a positive integer, got {self.steps!r}.")
        if self.minutes is not None and not (self.minutes > 0 and math.isfinite(self.minutes)):
            raise ValueError(f"minutes must be a positive number, got {self.minutes!r}.")
        for name in ("batch_size", "seq_len", "threads", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}.")
        for name in ("w_mtp", "w_indexer", "weight_decay", "balance_gamma", "grad_clip", "warmup_steps"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be >= 0, got {value!r}.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}.")


def lr_at(tc: TrainConfig, step: int, progress: float) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr down to lr * min_lr_ratio as progress goes 0 -> 1."""
    warm = min(1.0, (step + 1) / tc.warmup_steps) if tc.warmup_steps else 1.0
    cosine = 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return tc.lr * warm * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * cosine)


def _optimizer(model: DeepseekV4, tc: TrainConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        matrix = p.dim() >= 2 and not leaf.startswith("hc_") and leaf not in ("ape", "tid2eid")
        (decay if matrix else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95), eps=1e-8)


def prepare(tc: TrainConfig):
    """Everything that can refuse the run, before any training: arguments, corpus, model config."""
    tc.validate()
    corpus = data_mod.load_corpus(tc.corpus)
    cfg = model_config(**{"vocab_size": tc.vocab_size, **tc.model})
    check_trainable(cfg, tc.seq_len)
    return corpus, cfg


def train(tc: TrainConfig, log=print) -> dict[str, Any]:
    """Trains, writes the model directory (config.json, model.safetensors with mtp.0.*, tokenizer.json,
    generation_config.json, train_log.jsonl, train_summary.json) and returns the summary."""
    from tqdm import tqdm

    from leanserve.model.loader import save_checkpoint

    corpus, cfg = prepare(tc)
    torch.set_num_threads(tc.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(tc.threads))  # the tokenizers library's thread pool
    torch.manual_seed(tc.seed)
    out = Path(tc.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"corpus: {corpus.summary()}")

    t0 = time.perf_counter()
    tok = train_tokenizer_for(corpus, tc.vocab_size)
    stream = data_mod.encode_documents(tok, corpus.train, seed=tc.seed)
    data_mod.save_tokenizer_files(tok, out)
    log(
        f"tokenizer: {tok.get_vocab_size()} tokens, train stream {stream.numel() / 1e6:.2f}M tokens "
        f"({sum(len(d.text) for d in corpus.train) / max(stream.numel(), 1):.2f} chars/token), "
        f"{time.perf_counter() - t0:.0f}s"
    )
    sampler = data_mod.WindowSampler(stream, tc.seq_len + 2, tc.batch_size, tc.seed)

    model = new_model(cfg, tc.seq_len, tc.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"model: {n_params / 1e6:.2f}M parameters ({sum(p.numel() for p in model.mtp.parameters()) / 1e6:.2f}M in the "
        f"MTP layer), layers {list(cfg.layer_types)}, mlp {list(cfg.mlp_layer_types)}"
    )
    parity_len = min(tc.seq_len, 256)
    parity_ids = (
        stream[: 2 * (parity_len + 2)].view(2, parity_len + 2) if stream.numel() >= 2 * (parity_len + 2) else None
    )
    if parity_ids is not None:
        diff = check_parity(model, parity_ids)
        log(f"parity: batched training forward vs leanserve's inference forward, max |dlog p| {diff:.2e}")

    optimizer = _optimizer(model, tc)
    ctx = make_ctx(model, tc.batch_size, tc.seq_len)
    budget = tc.minutes * 60 if tc.minutes is not None else None
    tokens_per_step = tc.batch_size * tc.seq_len
    log_path = out / "train_log.jsonl"
    summary: dict[str, Any] = {}
    step, tokens, last_save = 0, 0, time.perf_counter()
    smooth = None
    start = time.perf_counter()
    total = tc.steps if tc.steps is not None else int(budget)
    bar_format = None if tc.steps is not None else "{l_bar}{bar}| {n:.0f}/{total:.0f}s [{elapsed}<{remaining}{postfix}]"
    with (
        open(log_path, "w") as log_file,
        tqdm(total=total, desc="training", unit="step", bar_format=bar_format, disable=not tc.progress) as bar,
    ):
        try:
            while True:
                elapsed = time.perf_counter() - start
                if tc.steps is not None:
                    if step >= tc.steps:
                        break
                    progress = step / tc.steps
                else:
                    if elapsed >= budget:
                        break
                    progress = elapsed / budget
                lr = lr_at(tc, step, progress)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                ids = sampler.next()
                losses = compute_losses(model, ids, ctx, tc.w_mtp, tc.w_indexer)
                if not math.isfinite(losses.total.item()):
                    raise FloatingPointError(f"Loss became {losses.total.item()} at step {step}; lower --lr.")
                optimizer.zero_grad(set_to_none=True)
                losses.total.backward()
                if tc.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
                optimizer.step()
                balance_routers_(model, ctx, tc.balance_gamma)
                step += 1
                tokens += tokens_per_step
                elapsed = time.perf_counter() - start
                smooth = losses.lm if smooth is None else 0.95 * smooth + 0.05 * losses.lm
                record = {
                    "step": step,
                    "tokens": tokens,
                    "loss": round(losses.lm, 5),
                    "mtp_loss": round(losses.mtp, 5),
                    "indexer_kl": round(losses.indexer, 5),
                    "lr": lr,
                    "elapsed": round(elapsed, 2),
                }
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
                bar.set_postfix(
                    step=step,
                    loss=f"{smooth:.3f}",
                    mtp=f"{losses.mtp:.3f}",
                    lr=f"{lr:.2e}",
                    tok_s=f"{tokens / elapsed:.0f}",
                    refresh=False,
                )
                if tc.steps is not None:
                    bar.update(1)
                else:
                    bar.n = min(elapsed, budget)
                    bar.refresh()
                if time.perf_counter() - last_save > tc.save_every_minutes * 60:
                    save_checkpoint(model, out, dtype=torch.bfloat16)
                    last_save = time.perf_counter()
        except KeyboardInterrupt:
            summary["interrupted"] = True
            log(f"interrupted at step {step}; saving what has been trained")
    elapsed = time.perf_counter() - start
    save_checkpoint(model, out, dtype=torch.bfloat16)
    summary.update(
        steps=step,
        tokens=tokens,
        seconds=round(elapsed, 1),
        tokens_per_second=round(tokens / max(elapsed, 1e-9), 1),
        final_loss_smoothed=smooth,
        parameters=n_params,
        train_config={k: v for k, v in asdict(tc).items() if k != "progress"},
        corpus_files={"train": len(corpus.train), "heldout": len(corpus.heldout)},
        train_stream_tokens=stream.numel(),
    )
    log(
        f"trained {step} steps, {tokens / 1e6:.2f}M tokens in {elapsed / 60:.1f} min ({summary['tokens_per_second']:.0f} tok/s)"
    )
    if tc.eval_tokens and corpus.heldout and step:
        summary["heldout"] = evaluate(out, corpus=corpus, max_tokens=tc.eval_tokens, seq_len=tc.seq_len)
        log(format_eval(summary["heldout"]))
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def train_tokenizer_for(corpus: data_mod.Corpus, vocab_size: int):
    return data_mod.train_tokenizer([d.text for d in corpus.train], vocab_size)


# --- held-out evaluation through leanserve's inference path ----------------------------------------------
@torch.no_grad()
def evaluate(
    model_dir: str | Path,
    corpus: data_mod.Corpus | str | Path | None = None,
    max_tokens: int | None = None,
    seq_len: int | None = None,
    batch_size: int = 4,
    dtype: str = "auto",
) -> dict[str, Any]:
    """On the corpus' held-out files, packed like the training data into windows of seq_len + 1 tokens, with
    the checkpoint loaded by leanserve's strict loader and run by its inference forward:
      trunk_top1       trunk argmax at t == token t+1
      mtp_agreement    MTP argmax at t == trunk argmax at t+1 (trunk fed the real token t+1): the greedy
                       acceptance rate of a one-token speculative draft
      mtp_top1         MTP argmax at t == token t+2
    plus the two cross-entropies (nats/token)."""
    from leanserve.config import ModelConfig
    from leanserve.engine.llm_engine import resolve_dtype
    from leanserve.model.batch import Chunk, build_forward_batch
    from leanserve.model.cache import CacheGeometry
    from leanserve.model.loader import has_mtp_weights, load_weights

    model_dir = Path(model_dir)
    cfg = ModelConfig.from_hf(model_dir)
    if not has_mtp_weights(model_dir):
        raise ValueError(f"{model_dir} has no MTP weights (mtp.0.*); nothing to evaluate the MTP layer with.")
    if not isinstance(corpus, data_mod.Corpus):
        corpus = data_mod.load_corpus(corpus)
    if not corpus.heldout:
        raise data_mod.CorpusError(f"Corpus {corpus.root} has no held-out files (about 3% of the files are held out).")
    if seq_len is None:
        summary = model_dir / "train_summary.json"
        seq_len = 512
        if summary.is_file():
            seq_len = int(json.loads(summary.read_text()).get("train_config", {}).get("seq_len", 512))
    tok = data_mod.load_tokenizer(model_dir)
    stream = data_mod.encode_documents(tok, corpus.heldout)
    window = seq_len + 1
    n = (stream.numel() - 1) // seq_len
    if max_tokens:
        n = min(n, max(1, max_tokens // seq_len))
    if n < 1:
        raise data_mod.CorpusError(f"The held-out files encode to {stream.numel()} tokens, fewer than {window}.")
    windows = torch.stack([stream[i * seq_len : i * seq_len + window] for i in range(n)])

    torch_dtype = resolve_dtype(dtype, str(model_dir))
    model = build_model(cfg, max_positions=window, dtype=torch_dtype, with_mtp=True)
    load_weights(model, model_dir, progress=False)
    sums = dict.fromkeys(("trunk_hit", "mtp_agree", "mtp_hit", "trunk_nll", "mtp_nll"), 0.0)
    n_trunk = n_mtp = 0
    start = time.perf_counter()
    for i in range(0, n, batch_size):
        ids = windows[i : i + batch_size]
        b = ids.shape[0]
        logits, mtp_logits = inference_logits(model, ids, Chunk, build_forward_batch, CacheGeometry)
        logits, mtp_logits = logits.float().view(b, seq_len, -1), mtp_logits.float().view(b, seq_len, -1)
        trunk_pred, mtp_pred = logits.argmax(-1), mtp_logits.argmax(-1)
        target = ids[:, 1:]
        sums["trunk_hit"] += (trunk_pred == target).sum().item()
        sums["trunk_nll"] += F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum").item()
        m_pred = mtp_pred[:, :-1]  # positions t = 0..L-2, where t+1 and t+2 are in the window
        sums["mtp_agree"] += (m_pred == trunk_pred[:, 1:]).sum().item()
        sums["mtp_hit"] += (m_pred == ids[:, 2:]).sum().item()
        sums["mtp_nll"] += F.cross_entropy(
            mtp_logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten(), reduction="sum"
        ).item()
        n_trunk += target.numel()
        n_mtp += m_pred.numel()
    seconds = time.perf_counter() - start
    return {
        "model": str(model_dir),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "heldout_files": len(corpus.heldout),
        "tokens": n_trunk,
        "seq_len": seq_len,
        "trunk_top1": sums["trunk_hit"] / n_trunk,
        "mtp_agreement": sums["mtp_agree"] / n_mtp,
        "mtp_top1": sums["mtp_hit"] / n_mtp,
        "trunk_loss": sums["trunk_nll"] / n_trunk,
        "mtp_loss": sums["mtp_nll"] / n_mtp,
        "seconds": round(seconds, 1),
    }


def format_eval(r: dict[str, Any]) -> str:
    rows = [
        ("trunk next-token top-1", f"{r['trunk_top1']:.2%}"),
        ("MTP agreement with trunk greedy t+2", f"{r['mtp_agreement']:.2%}"),
        ("MTP top-1 vs real t+2", f"{r['mtp_top1']:.2%}"),
        ("trunk loss (nats/token)", f"{r['trunk_loss']:.3f}"),
        ("MTP loss (nats/token)", f"{r['mtp_loss']:.3f}"),
    ]
    width = max(len(k) for k, _ in rows)
    head = f"held-out: {r['tokens']} tokens from {r['heldout_files']} files, {r['dtype']}, windows of {r['seq_len']}"
    return "\n".join([head] + [f"  {k:<{width}}  {v:>8}" for k, v in rows])


# --- command lines (scripts/train_small.py, scripts/eval_small.py) ----------------------------------------
def _tune_malloc() -> None:
    """glibc returns freed large blocks to the OS and faults them back in on the next step; keeping them
    makes the many same-sized temporaries of a training step noticeably cheaper. Best effort."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 32 * 1024 * 1024)  # M_MMAP_THRESHOLD: the largest value glibc accepts
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        libc.mallopt(-2, 64 * 1024 * 1024)  # M_TOP_PAD
    except (OSError, AttributeError):
        pass


_MODEL_FLAGS = {  # flag -> ModelConfig field
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "head_dim": "head_dim",
    "experts": "n_routed_experts",
    "moe_inter": "moe_intermediate_size",
    "hc_mult": "hc_mult",
    "o_groups": "o_groups",
    "index_topk": "index_topk",
}


def train_main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    d = TrainConfig(out="")
    p = argparse.ArgumentParser(
        description="Train leanserve's small DeepSeek-V4-architecture model and its MTP layer on Python source."
    )
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--corpus", default=None, help="directory of .py files (default: this Python's standard library)")
    p.add_argument("--seed", type=int, default=d.seed)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None, help="train exactly this many steps (deterministic)")
    budget.add_argument("--minutes", type=float, default=None, help="train for this wall-clock time (default 60)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr (cosine)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--w-mtp", type=float, default=d.w_mtp, help="weight of the MTP loss")
    p.add_argument("--w-indexer", type=float, default=d.w_indexer, help="weight of the indexer's KL loss")
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocabulary (and model vocab) size")
    p.add_argument("--save-every-minutes", type=float, default=d.save_every_minutes)
    p.add_argument("--eval-tokens", type=int, default=d.eval_tokens, help="held-out tokens to evaluate at the end")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for flag, name in _MODEL_FLAGS.items():
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None, help=f"model {name}")
    p.add_argument("--model-json", default=None, help="JSON object of further ModelConfig overrides")
    args = p.parse_args(argv)

    overrides: dict[str, Any] = {}
    if args.model_json:
        try:
            overrides = json.loads(args.model_json)
        except json.JSONDecodeError as e:
            p.error(f"--model-json is not valid JSON: {e}")
        if not isinstance(overrides, dict):
            p.error("--model-json must be a JSON object")
        for key in ("layer_types", "mlp_layer_types"):
            if isinstance(overrides.get(key), list):
                overrides[key] = tuple(overrides[key])
    for flag, name in _MODEL_FLAGS.items():
        if getattr(args, flag) is not None:
            overrides[name] = getattr(args, flag)
    tc = TrainConfig(
        out=args.out,
        corpus=args.corpus,
        seed=args.seed,
        steps=args.steps,
        minutes=args.minutes if args.minutes is not None or args.steps is not None else 60.0,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        w_mtp=args.w_mtp,
        w_indexer=args.w_indexer,
        threads=args.threads,
        vocab_size=args.vocab_size,
        save_every_minutes=args.save_every_minutes,
        eval_tokens=args.eval_tokens,
        progress=not args.no_progress,
        model=overrides,
    )
    try:
        prepare(tc)  # refuse bad arguments, corpus or config before anything slow
    except (ValueError, OSError) as e:  # CorpusError and ConfigError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    _tune_malloc()
    summary = train(tc, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps({k: v for k, v in summary.items() if k != "train_config"}, indent=2))
    return 0


def eval_main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(description="Held-out figures of a model trained by scripts/train_small.py.")
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--corpus", default=None, help="the corpus it was trained on (default: the standard library)")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate at most this many held-out tokens")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the training seq_len)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        result = evaluate(args.model, args.corpus, args.max_tokens, args.seq_len, args.batch_size, args.dtype)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_eval(result))
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
