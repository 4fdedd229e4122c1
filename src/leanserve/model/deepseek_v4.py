"""The DeepSeek-V4 model, stage-aware: embedding (first stage), blocks [a, b), hc_head/norm/head and the
MTP layer (last stage). Parameter names follow DeepSeek's checkpoints (`embed`, `layers.N.attn.wq_a`, ...).
The model hands its typed weights to the stage's backend (`run_blocks`, `run_mtp`); the wiring is
torch_math/blocks.py. build.py builds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from leanserve.memory import KV_CACHE, ROPE, SPEC_MTP, MemoryLedger
from leanserve.model.block import Block
from leanserve.model.cache import CacheGeometry, LayerCache, allocate_layer_cache
from leanserve.model.config import SLIDING, ModelConfig
from leanserve.model.layers import Embedding, Linear, RMSNorm, Rotary, UsesBackend, fp32_param
from leanserve.model.mtp import MTPBlock
from leanserve.model.weights import MixWeights, MTPWeights, RopeTables, StageWeights

if TYPE_CHECKING:
    from leanserve.model.batch import ForwardBatch


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
        self._typed: dict[str, object] = {}  # typed weights, made once (see forget_weights)
        self.act_dtype = None
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

    # --- typed weights --------------------------------------------------------------------------------
    @property
    def act_dtype(self) -> torch.dtype | None:
        """The activations' dtype; None: the weights' (build_model sets it from the stage's backend)."""
        return self._act_dtype

    @act_dtype.setter
    def act_dtype(self, dtype: torch.dtype | None) -> None:
        self._act_dtype = dtype
        self.forget_weights()

    def forget_weights(self) -> None:
        """Drops the typed weights made so far. They hold the modules' parameter objects and are made once (made
        per step, they would cost more than a small model's decode step); loading in place and `.data =` show
        through them, but a parameter or module replaced by assignment does not: call this after one. (`.to()`
        and the like call it, see _apply.)"""
        self._typed.clear()

    def _apply(self, fn, recurse=True):
        self.forget_weights()
        return super()._apply(fn, recurse)

    def _kept(self, key: str, make):
        w = self._typed.get(key)
        if w is None:
            w = self._typed[key] = make()
        return w

    def rope_tables(self) -> RopeTables:
        compress = self.rotary_compress.freqs if self.rotary_compress is not None else None
        return RopeTables(self.rotary_main.freqs, compress)

    def stage_weights(self) -> StageWeights:
        """The typed weights of this stage's blocks (and embedding, on the first stage)."""
        return self._kept("stage", lambda: StageWeights(
            self.embed.weight if self.stage.is_first else None, tuple([b.weights() for b in self.layers.values()]),
            self.rope_tables(), self.cfg.hc_mult, self.act_dtype,
        ))  # fmt: skip

    def head_mix(self) -> MixWeights:
        """hc_head's weights and the final norm (last stage)."""

        def make() -> MixWeights:
            fn, base, scale, eps = self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg.rms_norm_eps
            return MixWeights(fn, base, scale, self.norm.weight, eps, self.cfg.hc_eps, 0)

        return self._kept("head", make)

    def mtp_weights(self) -> MTPWeights:
        return self._kept(
            "mtp", lambda: self.mtp["0"].mtp_weights(self.embed.weight, self.rope_tables(), self.act_dtype)
        )

    # --- forward --------------------------------------------------------------------------------------
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
        if not self.stage.is_last:
            return self.trunk(fb, caches, streams, target_hidden)
        if target_hidden is None:  # (the trunk's streams at the logits' rows only)
            return self.head_logits(self.trunk(fb, caches, streams, None, fb.logits_index))
        streams = self.trunk(fb, caches, streams, target_hidden)  # (target_hidden takes every row's streams)
        return self.head_logits(streams if fb.logits_index is None else streams[fb.logits_index])

    def trunk(
        self,
        fb: ForwardBatch,
        caches: dict[str, LayerCache],
        streams: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This stage's blocks: the streams [T, hc_mult, hidden] of every token (on the last stage before hc_head;
        `target_hidden` as in forward), for a caller that takes the head at rows of its own (`head_logits`). On the
        last stage without `target_hidden`, `rows` (None: all) names the rows whose streams it returns, in order:
        the others go through the last block's attention only (their keys into its cache), not its MoE."""
        assert rows is None or (self.stage.is_last and target_hidden is None), "rows: the last stage's, no capture"
        layer_caches = [caches[key] for key in self.layers]
        first = self.stage.is_first
        streams = self.ops.run_blocks(self.stage_weights(), fb, layer_caches, None if first else streams, rows)
        if self.stage.is_last and target_hidden is not None:
            target_hidden[: streams.shape[0]].copy_(streams.flatten(1))
        return streams

    def head_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """hc_head, the final norm and the head over trunk streams [R, hc_mult, hidden]: float32 logits [R, vocab]."""
        return self.logits(self.head_hidden(streams))

    def head_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The head's input [R, hidden]: hc_head and the final norm over trunk streams [R, hc_mult, hidden]."""
        return self.ops.hc_head(streams, self.head_mix())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def mtp_forward(
        self,
        streams: torch.Tensor,  # [T, hc_mult, hidden]: trunk pre-hc_head streams at position t
        fb: ForwardBatch,  # the t+1 tokens (input ids, positions) and the MTP cache geometry
        caches: dict[str, LayerCache],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits [T', vocab], the MTP block's output streams [T', hc, hidden]) at the rows fb.logits_index
        (None: all T); the other rows only put their keys in the MTP layer's cache."""
        assert self.mtp is not None, "this model was built without its MTP layer"
        hidden, out = self.ops.run_mtp(self.mtp_weights(), streams, fb, caches["mtp.0"])
        return self.logits(hidden), out
