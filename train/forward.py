"""The batched training forward of a DeepSeek-V4-architecture model and its MTP layer, and the losses:

    loss = CE(trunk logits at t, token t+1) + w_mtp * CE(MTP logits at t, token t+2)
           (+ the Lightning Indexer's own KL loss, which only reaches the indexer's parameters)

The MTP layer at position t sees the trunk's pre-hc_head streams at t and the embedding of token t+1.

The math is the model's own torch statement, on its typed weights (model/torch_math/: mhc.hc_pre / hc_post,
attention.queries_kv / scores / attend_scores / output, compressor.pool, index_queries / index_scores /
index_pick, moe.routed, blocks.mtp_input; training builds its model on the torch backend); mHC's hc_pre and
hc_post can run through torch.compile (`make_ctx(..., compiled=True)`: the same statement, its many small ops on
[tokens, 4, 4] fused into fewer kernels). What this module adds is the layout of whole sequences that start at
position 0, instead of cache rings and per-token gathers: sliding-window attention in blocks of queries, every
window's compressed entry at once, the indexer's top-k as a mask; and what only training needs: the indexer's
KL target and the routers' loads. `check_parity` compares it with the model's inference forward (on the model's
own backend) before training starts.

This is a second statement of the model's wiring: it mirrors torch_math/blocks.py (`block`, `mtp`),
torch_math/attention.py (`attention`) and torch_math/moe.py (`moe`) name for name, and changes together with
them and with the CPU backend's decode step (model/backends/cpu/decode.py).

Two parts of DeepSeek-V4 get no gradient from the language-model loss, and are trained as DeepSeek does:
  * the Lightning Indexer (its top-k is a selection): a KL loss pulls its distribution over compressed
    entries towards the main attention's (heads averaged, detached); its inputs are detached;
  * the top-k router's correction bias (selection only): auxiliary-loss-free balancing, after every step
    bias_e += gamma * sign(mean load - load_e).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from leanserve.model.backends.torch import TorchBackend
from leanserve.model.batch import Chunk, build_forward_batch
from leanserve.model.cache import CacheGeometry
from leanserve.model.config import CSA, HCA
from leanserve.model.deepseek_v4 import DeepseekV4
from leanserve.model.torch_math import mhc
from leanserve.model.torch_math.attention import attend_scores, output, queries_kv, scores
from leanserve.model.torch_math.blocks import mtp_input
from leanserve.model.torch_math.compressor import index_pick, index_queries, index_scores, pool
from leanserve.model.torch_math.moe import routed
from leanserve.model.weights import AttentionWeights, BlockWeights, CompressorWeights, MixWeights, MoEWeights


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
    hc_pre: Callable = mhc.hc_pre  # mHC's torch statement, or its torch.compile'd build (make_ctx)
    hc_post: Callable = mhc.hc_post


@functools.cache
def compiled_mhc() -> tuple[Callable, Callable] | None:
    """mhc.hc_pre and hc_post through torch.compile, or None where it cannot compile here (it needs a C++
    compiler): probed once on a small input, so that a machine without one trains eagerly instead of failing."""
    pre, post = torch.compile(mhc.hc_pre, dynamic=False), torch.compile(mhc.hc_post, dynamic=False)
    try:
        streams = torch.ones(2, 2, 4)
        w = MixWeights(torch.ones(8, 8), torch.zeros(8), torch.ones(3), torch.ones(4), 1e-6, 1e-6, 2)
        x, p, c = pre(streams, w)
        post(x, streams, p, c)
    except Exception as e:  # (torch's compile errors have no common base class)
        logging.getLogger("leanserve").warning("torch.compile is unavailable (%s); mHC runs eagerly", type(e).__name__)
        return None
    return pre, post


def make_ctx(model: DeepseekV4, batch: int, length: int, compiled: bool = False) -> Ctx:
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
    ctx = Ctx(batch, length, block, padded, main, compress, row_rope, mask, visible)
    mhc = compiled_mhc() if compiled else None
    if mhc is not None:
        ctx.hc_pre, ctx.hc_post = mhc
    return ctx


def compress(ops: TorchBackend, w: CompressorWeights, kv: torch.Tensor, gate: torch.Tensor, ctx: Ctx, kind: str):
    """Every window's entry at once (torch_math.compressor.pool): kv, gate [B, L, width] (wkv(x), wgate(x)) ->
    [B, L // r, dim]."""
    r, d = w.ratio, w.dim
    batch, rows = kv.shape[0], kv.shape[1] // r
    kv = kv[:, : rows * r].unflatten(1, (rows, r))  # [B, rows, r, width]
    gate = gate[:, : rows * r].unflatten(1, (rows, r))
    if w.overlap:  # window w pools Ca of window w-1 (none before window 0), then its own Cb
        kv = torch.cat([F.pad(kv[:, :-1, :, :d], (0, 0, 0, 0, 1, 0)), kv[..., d:]], dim=2)  # [B, rows, 2r, d]
        gate = torch.cat([F.pad(gate[:, :-1, :, :d], (0, 0, 0, 0, 1, 0), value=float("-inf")), gate[..., d:]], dim=2)
    return pool(ops, w, kv.flatten(0, 1), gate.flatten(0, 1), ctx.row_rope[kind]).view(batch, rows, -1)


def attention(ops: TorchBackend, w: AttentionWeights, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """x: [B*L, hidden] (normed) -> [B*L, hidden]."""
    batch, length, block, padded = ctx.batch, ctx.length, ctx.block, ctx.padded
    heads, dim = w.heads, w.head_dim
    rope = ctx.main_rope if w.rope_kind == "main" else ctx.compress_rope
    # wq_a, wkv, then the compressor's (the indexer's, of detached x, in index_scores)
    projected = ops.linears(x, w.inputs[: 2 if w.compressor is None else 4])
    q_residual, q, kv = queries_kv(ops, w, projected[0], projected[1], rope)

    nb, window = padded // block, ctx.window_mask.shape[-1] - block
    pad = padded - length
    q_blocks = F.pad(q.view(batch, length, heads, dim), (0, 0, 0, 0, 0, pad)).view(batch * nb, block, heads, dim)
    kv_pad = F.pad(kv.view(batch, length, dim), (0, 0, window, pad))  # [B, W + Lp, D]
    keys = kv_pad.unfold(1, block + window, block).transpose(2, 3)  # [B, nb, Q + W, D]
    mask = ctx.window_mask.expand(batch, -1, -1, -1)  # [B, nb, Q, Q + W]
    if w.compressor is not None:
        kind = w.layer_type
        comp = compress(ops, w.compressor, *(p.view(batch, length, -1) for p in projected[2:4]), ctx, kind)
        n = comp.shape[1]
        visible = ctx.visible[kind].expand(batch, -1, -1)  # [B, L, n]
        selected = visible
        if w.indexer is not None:
            idx_scores = index_scores_all(ops, w, x.detach(), q_residual.detach(), ctx)  # [B, L, n]
            if n > w.indexer.topk:
                selected = index_pick(w.indexer, idx_scores.detach(), visible)
        selected = F.pad(selected, (0, 0, 0, pad)).view(batch, nb, block, n)
        keys = torch.cat([keys, comp.unsqueeze(1).expand(-1, nb, -1, -1)], dim=2)
        mask = torch.cat([mask, selected], dim=-1)
    keys, mask = keys.reshape(batch * nb, -1, dim), mask.reshape(batch * nb, block, -1)
    logits = scores(w, q_blocks, keys)  # [B*nb, Q, H, K]
    if w.indexer is not None and torch.is_grad_enabled():
        ctx.stats.setdefault("indexer_kl", []).append(indexer_kl(logits, idx_scores, ctx.visible[kind], ctx))
    out = attend_scores(w, logits, mask, keys)  # [B*nb, Q, H, D]
    out = out.view(batch, padded, heads, dim)[:, :length].reshape(batch * length, heads, dim)
    return output(ops, w, ops.apply_rope(out, rope, inverse=True))


def index_scores_all(
    ops: TorchBackend, w: AttentionWeights, x: torch.Tensor, q_residual: torch.Tensor, ctx: Ctx
) -> torch.Tensor:
    """The Lightning Indexer's score of every compressed entry for every token: [B, L, rows], -inf where the
    entry is not visible yet. x: [B*L, hidden], q_residual: [B*L, q_lora] (both detached)."""
    idx, batch, length = w.indexer, ctx.batch, ctx.length
    kv, gate, head_w = (p.view(batch, length, -1) for p in ops.linears(x, w.inputs[4:]))
    rows = compress(ops, idx.compressor, kv, gate, ctx, CSA)  # [B, n, d]
    q, head_w = index_queries(ops, idx, q_residual, head_w.reshape(batch * length, -1), ctx.compress_rope)
    out = index_scores(idx, q.view(batch, length, idx.heads, -1), rows.float(), head_w.view(batch, length, -1))
    return out.masked_fill(~ctx.visible[CSA], float("-inf"))


def indexer_kl(scores: torch.Tensor, idx_scores: torch.Tensor, visible: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """The indexer's loss: KL(the main attention's distribution over the visible compressed entries, heads
    averaged and detached || the indexer's). scores: the attention's [B*nb, Q, H, K] (entries last)."""
    batch, length, n = ctx.batch, ctx.length, idx_scores.shape[-1]
    with torch.no_grad():
        main = scores[..., -n:].detach().reshape(batch, ctx.padded, scores.shape[2], n)[:, :length]
        main = main.masked_fill(~visible[None, :, None, :], float("-inf"))
        has_rows = visible.any(dim=-1)  # tokens that see at least one entry
        target = main[:, has_rows].float().softmax(dim=-1).mean(dim=2)  # [B, L', n]
    log_q = idx_scores[:, has_rows].float().log_softmax(dim=-1)
    return (target * (target.clamp_min(1e-30).log() - log_q.clamp_min(-1e4))).sum(-1).mean()


def moe(ops: TorchBackend, w: MoEWeights, x: torch.Tensor, input_ids: torch.Tensor, ctx: Ctx, key: str):
    out, experts = routed(ops, w, x, input_ids)  # the router is differentiable as it is
    if w.tid2eid is None:  # (a top-k router: its loads, for balance_routers_)
        ctx.stats.setdefault("loads", {})[key] = torch.bincount(experts.flatten(), minlength=w.gate.shape[0])
    return out


def block(ops: TorchBackend, w: BlockWeights, streams: torch.Tensor, input_ids, ctx: Ctx, key: str) -> torch.Tensor:
    x, post, comb = ctx.hc_pre(streams, w.attn_mix)
    streams = ctx.hc_post(attention(ops, w.attn, x, ctx), streams, post, comb)
    x, post, comb = ctx.hc_pre(streams, w.ffn_mix)
    return ctx.hc_post(moe(ops, w.moe, x, input_ids, ctx, key), streams, post, comb)


def trunk_forward(model: DeepseekV4, ids: torch.Tensor, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: [B, >= L]. Returns (the trunk's pre-hc_head streams [B*L, hc, hidden] at positions 0..L-1, its
    logits [B*L, V] there)."""
    ctx.stats = {}
    trunk_in = ids[:, : ctx.length].reshape(-1)
    x = model.embed(trunk_in)
    streams = x.unsqueeze(1).expand(-1, model.cfg.hc_mult, -1)
    for key, w in zip(model.layers, model.stage_weights().blocks, strict=True):
        streams = block(model.ops, w, streams, trunk_in, ctx, key)
    return streams, model.logits(model.head_hidden(streams))


def mtp_forward(model: DeepseekV4, streams: torch.Tensor, ids: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """The MTP layer at positions 0..L-1 from the trunk's streams there and the embeddings of tokens 1..L of
    ids [B, >= L + 1]: its logits [B*L, V] (for tokens 2..L+1). (torch_math.blocks.mtp over whole sequences.)"""
    ops, w = model.ops, model.mtp_weights()
    mtp_in = ids[:, 1 : ctx.length + 1].reshape(-1)  # the MTP layer at t embeds token t+1
    out = block(ops, w.block, mtp_input(ops, w, streams, model.embed(mtp_in)), mtp_in, ctx, "mtp.0")
    return model.logits(ops.hc_head(out, w.head))


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
    indexer = indexer_loss(ctx)
    total = lm + w_mtp * mtp + w_indexer * indexer
    return Losses(total, lm.item(), mtp.item(), indexer.item())


def indexer_loss(ctx: Ctx) -> torch.Tensor:
    """The mean of the indexer KL losses the last forward recorded (zero for a model without indexers)."""
    kls = ctx.stats.get("indexer_kl", [])
    return torch.stack(kls).mean() if kls else torch.zeros(())


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
