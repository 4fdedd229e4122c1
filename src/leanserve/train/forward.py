"""The batched training forward of a DeepSeek-V4-architecture model and its MTP layer, and the losses:

    loss = CE(trunk logits at t, token t+1) + w_mtp * CE(MTP logits at t, token t+2)
           (+ the Lightning Indexer's own KL loss, which only reaches the indexer's parameters)

The MTP layer at position t sees the trunk's pre-hc_head streams at t and the embedding of token t+1.

The model's own forward is written for inference (cache rings written in place, per-token gathers). Training
uses a batched formulation of the same math over whole sequences that start at position 0: sliding-window
attention in blocks of queries, compressed entries computed for every window at once, the indexer's top-k
as a mask. It reads the model's own parameters and reuses its pure functions (hc_pre / hc_post, the
head_hidden methods, RoPE, norms); `check_parity` compares it with the model's inference forward before
training starts, so the two cannot drift apart silently.

Two parts of DeepSeek-V4 get no gradient from the language-model loss, and are trained as DeepSeek does:
  * the Lightning Indexer (its top-k is a selection): a KL loss pulls its distribution over compressed
    entries towards the main attention's (heads averaged, detached); its inputs are detached;
  * the top-k router's correction bias (selection only): auxiliary-loss-free balancing, after every step
    bias_e += gamma * sign(mean load - load_e).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from leanserve.config import CSA, HCA
from leanserve.model.attention import Attention
from leanserve.model.batch import Chunk, build_forward_batch
from leanserve.model.block import Block
from leanserve.model.cache import CacheGeometry
from leanserve.model.compressor import Compressor, Indexer
from leanserve.model.deepseek_v4 import DeepseekV4
from leanserve.model.moe import MoE
from leanserve.model.torch_ops import apply_rope, rms_norm, swiglu


@dataclass
class Ctx:
    """Per-(batch size, seq len) constants: RoPE tables and masks, all for positions 0..L-1."""

    batch: int
    length: int
    block: int  # queries per attention block (= the sliding window)
    padded: int  # length rounded up to a multiple of `block`
    main_rope: torch.Tensor  # [B*L, rope/2] complex RoPE factors
    compress_rope: torch.Tensor | None
    row_rope: dict[str, torch.Tensor]  # per kind: [B*rows, rope/2]
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
    return apply_rope(entries.reshape(batch * rows, d), ctx.row_rope[kind]).view(batch, rows, d)


def _indexer_scores(idx: Indexer, x: torch.Tensor, q_residual: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """The Lightning Indexer's score of every compressed entry for every token: [B, L, rows], -inf where the
    entry is not visible yet. x: [B, L, hidden], q_residual: [B*L, q_lora]."""
    batch, length = x.shape[:2]
    rows = _compress(idx.compressor, x, ctx, CSA)  # [B, n, dh]
    q = idx.wq_b(q_residual).view(batch * length, idx.n_heads, idx.head_dim)
    q = apply_rope(q, ctx.compress_rope).view(batch, length * idx.n_heads, idx.head_dim)
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
    q = apply_rope(rms_norm(attn.wq_b(q_residual).view(-1, heads, dim), attn.eps), rope)
    kv = apply_rope(attn.norm(attn.wkv(x)), rope)  # [B*L, D]

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
    out = apply_rope(out, rope, inverse=True)
    grouped = out.reshape(batch * length, attn.o_groups, -1)
    w = attn.wo_a.weight.view(attn.o_groups, -1, grouped.shape[-1])
    projected = torch.einsum("tgi,goi->tgo", grouped, w).flatten(1)
    return attn.wo_b(projected)


def _moe(moe: MoE, x: torch.Tensor, input_ids: torch.Tensor, ctx: Ctx, stats_key: str) -> torch.Tensor:
    gate, experts_mod = moe.gate, moe.experts
    weights, experts = gate(x, input_ids)  # the router is differentiable as it is

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


def trunk_forward(model: DeepseekV4, ids: torch.Tensor, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: [B, >= L]. Returns (the trunk's pre-hc_head streams [B*L, hc, hidden] at positions 0..L-1, its
    logits [B*L, V] there)."""
    ctx.stats = {}
    trunk_in = ids[:, : ctx.length].reshape(-1)
    x = model.embed(trunk_in)
    streams = x.unsqueeze(1).expand(-1, model.cfg.hc_mult, -1)
    for key, block in model.layers.items():
        streams = _block(block, streams, trunk_in, ctx, key)
    return streams, model.logits(model.head_hidden(streams))


def mtp_forward(model: DeepseekV4, streams: torch.Tensor, ids: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """The MTP layer at positions 0..L-1 from the trunk's streams there and the embeddings of tokens 1..L of
    ids [B, >= L + 1]: its logits [B*L, V] (for tokens 2..L+1)."""
    mtp = model.mtp["0"]
    mtp_in = ids[:, 1 : ctx.length + 1].reshape(-1)  # the MTP layer at t embeds token t+1
    h = mtp.h_proj(mtp.hnorm(streams)) + mtp.e_proj(mtp.enorm(model.embed(mtp_in))).unsqueeze(1)
    out = _block(mtp, h, mtp_in, ctx, "mtp.0")
    return model.logits(mtp.head_hidden(out))


def forward_train(model: DeepseekV4, ids: torch.Tensor, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: [B, L + 2]. Returns (trunk logits [B*L, V] for tokens 1..L, MTP logits [B*L, V] for tokens 2..L+1)."""
    streams, logits = trunk_forward(model, ids, ctx)
    return logits, mtp_forward(model, streams, ids, ctx)


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
    batch, length = ids.shape[0], ids.shape[1] - 2
    ctx = make_ctx(model, batch, length)
    logits, mtp_logits = forward_train(model, ids, ctx)
    ref, ref_mtp = inference_logits(model, ids[:, : length + 1])
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


def inference_logits(model: DeepseekV4, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inference path: trunk logits at positions 0..L-1 of ids [B, L+1] and MTP logits at 0..L-1 (the MTP
    layer at t embedding ids[t+1])."""
    batch, length = ids.shape[0], ids.shape[1] - 1
    geo = CacheGeometry.build(model.cfg, num_slots=batch, max_model_len=length + 1)
    dtype = model.act_dtype  # (float32 with bfloat16 weights on the CPU: see activation_dtype)
    caches = model.allocate_cache(geo, dtype)
    rows = ids.tolist()
    fb = build_forward_batch([Chunk(i, 0, r[:length]) for i, r in enumerate(rows)], geo)
    hidden = torch.empty(fb.num_tokens, model.cfg.hc_dim, dtype=dtype)
    logits = model(fb, caches, target_hidden=hidden)
    mtp_fb = build_forward_batch([Chunk(i, 0, r[1 : length + 1]) for i, r in enumerate(rows)], geo)
    streams = hidden.view(fb.num_tokens, model.cfg.hc_mult, model.cfg.hidden_size)
    mtp_logits, _ = model.mtp_forward(streams, mtp_fb, caches)
    return logits, mtp_logits
