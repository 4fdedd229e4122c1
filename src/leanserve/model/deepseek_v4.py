"""The DeepSeek-V4 model, stage-aware: embedding (first stage), blocks [a, b), hc_head/norm/head and the
MTP layer (last stage). Parameter names follow DeepSeek's checkpoints (`embed`, `layers.N.attn.wq_a`, ...).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from leanserve.config import SLIDING, ModelConfig
from leanserve.memory import KV_CACHE, ROPE, SPEC_MTP, MemoryLedger
from leanserve.model.attention import Rope
from leanserve.model.backend import UsesBackend, select_backend, set_backend
from leanserve.model.batch import ForwardBatch
from leanserve.model.block import Block
from leanserve.model.cache import CacheGeometry, LayerCache, allocate_layer_cache
from leanserve.model.hyper import MixWeights
from leanserve.model.layers import Embedding, Linear, RMSNorm, Rotary, fp32_param
from leanserve.model.mtp import MTPBlock


@dataclass(frozen=True)
class StageLayout:
    """Which part of the model a process holds."""

    first_layer: int
    end_layer: int
    is_first: bool = True
    is_last: bool = True
    index: int = 0  # the stage's number, 0 = first

    @classmethod
    def whole(cls, cfg: ModelConfig) -> StageLayout:
        return cls(0, cfg.num_hidden_layers)


class DeepseekV4(UsesBackend, nn.Module):
    def __init__(
        self, cfg: ModelConfig, max_positions: int, stage: StageLayout | None = None, with_mtp: bool = False
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.act_dtype: torch.dtype | None = None  # activations' dtype; None: the weights' (see build_model)
        self.stage = stage = stage or StageLayout.whole(cfg)
        with_mtp = with_mtp and stage.is_last
        # The MTP layer shares the embedding, so a last stage that runs it holds a copy of its own.
        if stage.is_first or with_mtp:
            self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict(
            {
                str(i): Block(cfg, cfg.layer_types[i], cfg.mlp_layer_types[i])
                for i in range(stage.first_layer, stage.end_layer)
            }
        )
        if stage.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.hc_head_fn = fp32_param(cfg.hc_mult, cfg.hc_dim)
            self.hc_head_base = fp32_param(cfg.hc_mult)
            self.hc_head_scale = fp32_param(1)
            self.head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleDict({"0": MTPBlock(cfg)}) if with_mtp else None
        kinds = {b.layer_type for b in self.layers.values()}
        rope_dim = cfg.qk_rope_head_dim
        self.rotary_main = Rotary(cfg.main_rope, rope_dim, max_positions)
        has_compressed = bool(kinds - {SLIDING})
        self.rotary_compress = Rotary(cfg.compress_rope, rope_dim, max_positions) if has_compressed else None

    # --- construction helpers -------------------------------------------------------------------------
    def allocate_cache(
        self,
        geo: CacheGeometry,
        dtype: torch.dtype,
        ledger: MemoryLedger | None = None,
        prefix: str = "",
        feature: str = KV_CACHE,
    ) -> dict[str, LayerCache]:
        """Caches for every layer this stage holds, allocated through `ledger` (a private one if None, on
        the model's device) under `feature`, named `{prefix}layers.N.*`; the MTP layer's belong to the MTP
        drafter. (A draft model's use prefix "draft." and the draft model's feature.)"""
        ledger = ledger or MemoryLedger(self.stage.index, self.device)
        caches = {
            k: allocate_layer_cache(self.cfg, b.layer_type, geo, dtype, ledger, f"{prefix}layers.{k}", feature)
            for k, b in self.layers.items()
        }
        if self.mtp is not None:
            caches["mtp.0"] = allocate_layer_cache(self.cfg, SLIDING, geo, dtype, ledger, "mtp.0", SPEC_MTP)
        return caches

    def register_tables(self, ledger: MemoryLedger, prefix: str = "", feature: str = ROPE) -> None:
        """Adds the derived tables (non-persistent buffers, computed rather than loaded) to the ledger."""
        weights = set(self.state_dict())
        for name, buf in self.named_buffers():
            if name not in weights:
                ledger.register(prefix + name, prefix + name.rsplit(".", 1)[0], feature, buf)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # --- forward --------------------------------------------------------------------------------------
    def ropes(self, fb: ForwardBatch, get=Rotary.table) -> dict:
        """The step's RoPE factors per kind: the main and compress tables at the tokens' positions, and the
        compress table at each compressed kind's new rows; `get(rotary, positions)` reads a table (default:
        Rotary.table, complex factors)."""
        ropes = {"main": get(self.rotary_main, fb.positions)}
        if self.rotary_compress is not None and fb.compress:  # (the MTP layer's batches have no compression)
            ropes["compress"] = get(self.rotary_compress, fb.positions)
            for kind, meta in fb.compress.items():
                ropes[kind] = get(self.rotary_compress, meta.row_pos)
        return ropes

    def forward(
        self,
        fb: ForwardBatch,
        caches: dict[str, LayerCache],
        streams: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """First stage: embeds fb.input_ids; other stages take the previous stage's `streams`
        [T, hc_mult, hidden]. Returns the streams (non-last stage) or float32 logits for the rows in
        fb.logits_index (last stage). `target_hidden`, when given, receives the pre-hc_head streams
        [T, hc_mult * hidden] (for the MTP drafter)."""
        streams = self.trunk(fb, caches, streams, target_hidden)
        if not self.stage.is_last:
            return streams
        return self.head_logits(streams if fb.logits_index is None else streams[fb.logits_index])

    def trunk(
        self,
        fb: ForwardBatch,
        caches: dict[str, LayerCache],
        streams: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This stage's blocks: the streams [T, hc_mult, hidden] of every token (on the last stage before hc_head;
        `target_hidden` as in forward), for a caller that takes the head at rows of its own (`head_logits`)."""
        streams = self.ops.run_blocks(self, fb, caches, None if self.stage.is_first else streams)
        if self.stage.is_last and target_hidden is not None:
            target_hidden[: streams.shape[0]].copy_(streams.flatten(1))
        return streams

    def head_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """hc_head, the final norm and the head over trunk streams [R, hc_mult, hidden]: float32 logits [R, vocab]."""
        return self.logits(self.head_hidden(streams))

    def blocks_torch(self, fb: ForwardBatch, caches, ropes: dict[str, Rope], streams: torch.Tensor | None):
        """The torch statement of run_blocks: embed (first stage, `streams` None), then every block."""
        if streams is None:
            x = self.embed_tokens(fb.input_ids)
            streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for key, block in self.layers.items():
            streams = block(streams, fb, caches[key], ropes)
        return streams

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `ids` in the activation dtype (where activations start)."""
        return self.embed(ids).to(self.act_dtype or self.embed.weight.dtype)

    def head_mix(self) -> MixWeights:
        """hc_head's weights and the final norm (last stage)."""
        fn, base, scale, eps = self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg.rms_norm_eps
        return MixWeights(fn, base, scale, self.norm.weight, eps, self.cfg.hc_eps, 0)

    def head_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        return self.ops.head_hidden(self, streams)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def mtp_forward(
        self,
        streams: torch.Tensor,  # [T, hc_mult, hidden]: trunk pre-hc_head streams at position t
        fb: ForwardBatch,  # the t+1 tokens (input ids, positions) and the MTP cache geometry
        caches: dict[str, LayerCache],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits [T', vocab] for fb.logits_index, the MTP block's output streams [T, hc, hidden])."""
        assert self.mtp is not None, "this model was built without its MTP layer"
        hidden, out = self.ops.run_mtp(self, streams, fb, caches)
        return self.logits(hidden), out

    def mtp_torch(self, streams: torch.Tensor, fb: ForwardBatch, caches: dict[str, LayerCache]):
        """The torch statement of run_mtp: the embeddings of fb's tokens, then the MTP layer (its hc_head too)."""
        mtp = self.mtp["0"]
        hidden, out = mtp(streams, self.embed_tokens(fb.input_ids), fb, caches["mtp.0"], self.ropes(fb))
        return (hidden if fb.logits_index is None else hidden[fb.logits_index]), out


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    cfg: ModelConfig,
    max_positions: int,
    dtype: torch.dtype = torch.float32,
    stage: StageLayout | None = None,
    with_mtp: bool = False,
    device: str = "cpu",
    backend: str = "auto",
    checkpoint: str | Path | None = None,
) -> DeepseekV4:
    """Builds on the meta device (no init cost), then allocates uninitialised storage on `device`; the
    loader (or a random init) must fill every parameter and persistent buffer. With `checkpoint` (a model
    directory), its safetensors headers are checked against the meta model first, so a checkpoint that does
    not fit fails before anything is allocated. The stage's backend is chosen here, once (see
    backend.select_backend), and sets the activations' dtype."""
    ops = select_backend(device, dtype, backend)
    with torch.device("meta"), _default_dtype(dtype):
        model = DeepseekV4(cfg, max_positions, stage, with_mtp)
    if checkpoint is not None:
        from leanserve.model.loader import check_checkpoint  # (the loader imports this module)

        check_checkpoint(model, checkpoint)
    # (as to_empty, but torch.empty: empty_like of a meta tensor runs torch's Python reference, whose first call
    # imports sympy, half a second of every process's start-up)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    set_backend(model, ops)
    model.act_dtype = ops.activation_dtype(dtype)
    for m in model.modules():
        if isinstance(m, Rotary):
            m.reset_tables()
    return model.eval().requires_grad_(False)
