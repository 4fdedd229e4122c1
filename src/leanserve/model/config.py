"""Typed, frozen configuration parsed once at the edge.

`ModelConfig.from_hf(dir)` reads a HuggingFace `config.json` with `model_type: deepseek_v4`, accepting both
the field names transformers writes and the legacy names DeepSeek's own configs ship.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
ATTENTION_KINDS = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_KINDS = (HASH_MOE, MOE)
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    # YaRN (only ever on the compressed-attention rope); rope_type "default" ignores the rest.
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0


@dataclass(frozen=True)
class Quantization:
    """How a published checkpoint stores its weights (`quantization_config` and the top-level `expert_dtype`):
    block-scaled FP8 e4m3 linears (UE8M0 scales per 128x128 block) and FP4 e2m1 or FP8 routed experts. Norms,
    the embedding, the head, the router, the compressors, mHC, sinks and biases stay unquantized."""

    experts: str = "fp4"  # fp4 | fp8
    activation_scheme: str = "dynamic"  # (DeepSeek quantizes activations too; leanserve computes them in float)

    def to_hf(self) -> dict[str, Any]:
        return {
            "quantization_config": {
                "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
                "activation_scheme": self.activation_scheme,
            },
            "expert_dtype": self.experts,
        }  # fmt: skip


def parse_quantization(raw: dict[str, Any]) -> Quantization | None:
    """The checkpoint's quantization from its config fields, or None when it stores plain weights."""
    qc, expert_dtype = raw.get("quantization_config"), raw.get("expert_dtype")
    if qc is None:
        if expert_dtype is not None:
            raise ConfigError(f"expert_dtype {expert_dtype!r} needs a quantization_config (fp8), and there is none.")
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"quantization_config must be a JSON object, got {qc!r}.")
    expected = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0"}
    for key, want in expected.items():
        value = qc.get(key, want if key != "quant_method" else None)
        if value != want:
            raise ConfigError(f"quantization_config.{key} {value!r} is not supported; leanserve reads {want!r}.")
    block = qc.get("weight_block_size", [128, 128])
    if list(block) != [128, 128]:
        raise ConfigError(f"quantization_config.weight_block_size {block!r} is not supported; it must be [128, 128].")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"quantization_config.activation_scheme {scheme!r} is not supported; it must be 'dynamic'.")
    experts = "fp8" if expert_dtype is None else expert_dtype
    if experts not in ("fp4", "fp8"):
        raise ConfigError(f"expert_dtype {expert_dtype!r} is not supported; use 'fp4' or 'fp8'.")
    return Quantization(experts, scheme)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    main_rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=10000.0))
    compress_rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=160000.0))
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    quantization: Quantization | None = None  # a published checkpoint's FP8 / FP4 storage; None: plain weights
    # Training-only knobs transformers carries; parsed so a config round-trips, unused at inference.
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    attention_dropout: float = 0.0
    attention_bias: bool = False
    mlp_bias: bool = False
    use_cache: bool = True

    def __post_init__(self) -> None:
        self._validate()

    # --- derived values -------------------------------------------------------------------------------
    def compress_rate(self, layer_type: str) -> int:
        return {SLIDING: 0, CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}[layer_type]

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.hidden_size

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    # --- parsing --------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"No config.json in {model_dir}; a model directory needs a HuggingFace config.")
        return cls.from_json_file(path)

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}.") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object, not {type(raw).__name__}.")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type != "deepseek_v4":
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; leanserve serves 'deepseek_v4' models."
            )
        try:
            return cls(**_normalise(raw))
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            raise ConfigError(f"{source}: malformed field ({e}).") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The config as transformers' DeepseekV4Config writes it (both engines load the result)."""
        compress = {
            "rope_type": self.compress_rope.rope_type,
            "rope_theta": self.compress_rope.theta,
            "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
        }
        if self.compress_rope.rope_type == "yarn":
            compress.update(
                factor=self.compress_rope.factor,
                original_max_position_embeddings=self.compress_rope.original_max_position_embeddings,
                beta_fast=self.compress_rope.beta_fast,
                beta_slow=self.compress_rope.beta_slow,
                attention_factor=self.compress_rope.attention_factor,
            )
        skip = {"main_rope", "compress_rope", "compress_rate_csa", "compress_rate_hca", "eos_token_ids", "quantization"}
        out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
        for f in fields(self):
            if f.name not in skip:
                value = getattr(self, f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        out["dtype"] = out.pop("torch_dtype")
        out["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        out["partial_rotary_factor"] = self.qk_rope_head_dim / self.head_dim
        out["compress_rates"] = {CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}
        out["rope_parameters"] = {
            "main": {
                "rope_type": "default",
                "rope_theta": self.main_rope.theta,
                "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
            },
            "compress": compress,
        }
        if self.quantization is not None:
            out.update(self.quantization.to_hf())
        return out

    # --- validation -----------------------------------------------------------------------------------
    def _validate(self) -> None:
        positive = (
            "vocab_size hidden_size moe_intermediate_size num_hidden_layers num_attention_heads head_dim "
            "q_lora_rank num_experts_per_tok n_routed_experts hc_mult hc_sinkhorn_iters sliding_window "
            "o_groups o_lora_rank index_n_heads index_head_dim index_topk compress_rate_csa compress_rate_hca"
        )
        for name in positive.split():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}.")
        if self.num_nextn_predict_layers < 0:
            raise ConfigError("num_nextn_predict_layers must be >= 0.")
        if self.num_key_value_heads != 1:
            raise ConfigError(
                f"num_key_value_heads must be 1 (DeepSeek-V4 uses shared-KV MQA), got {self.num_key_value_heads}."
            )
        if self.n_shared_experts != 1:
            raise ConfigError(f"n_shared_experts must be 1 for DeepSeek-V4, got {self.n_shared_experts}.")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act must be 'silu', got {self.hidden_act!r}.")
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}.")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})."
            )
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by o_groups ({self.o_groups})."
            )
        rope = self.qk_rope_head_dim
        if rope < 2 or rope % 2 or rope > self.head_dim or rope > self.index_head_dim:
            raise ConfigError(
                f"qk_rope_head_dim ({rope}) must be even, >= 2 and at most head_dim ({self.head_dim}) and "
                f"index_head_dim ({self.index_head_dim})."
            )
        for name, kinds, allowed in (
            ("layer_types", self.layer_types, ATTENTION_KINDS),
            ("mlp_layer_types", self.mlp_layer_types, MLP_KINDS),
        ):
            if len(kinds) != self.num_hidden_layers:
                raise ConfigError(f"{name} has {len(kinds)} entries but num_hidden_layers is {self.num_hidden_layers}.")
            bad = sorted({k for k in kinds if k not in allowed})
            if bad:
                raise ConfigError(f"{name} entries must be one of {allowed}, got {bad}.")
        for name in ("rms_norm_eps", "hc_eps", "swiglu_limit", "routed_scaling_factor"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}.")
        for rope_cfg in (self.main_rope, self.compress_rope):
            if rope_cfg.rope_type not in ("default", "yarn"):
                raise ConfigError(f"rope_type {rope_cfg.rope_type!r} is not supported (use 'default' or 'yarn').")
            if rope_cfg.rope_type == "yarn" and not rope_cfg.original_max_position_embeddings:
                raise ConfigError("YaRN rope needs original_max_position_embeddings.")
            if rope_cfg.theta <= 0:
                raise ConfigError(f"rope theta must be positive, got {rope_cfg.theta}.")
        if self.torch_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype {self.torch_dtype!r} is not supported (float32, bfloat16, float16).")
        if any(t < 0 or t >= self.vocab_size for t in self.eos_token_ids):
            raise ConfigError(f"eos_token_id {list(self.eos_token_ids)} is outside the vocabulary.")


def _normalise(raw: dict[str, Any]) -> dict[str, Any]:
    """Maps transformers' and DeepSeek's field names onto ModelConfig's keyword arguments."""
    known = {f.name for f in fields(ModelConfig)}
    cfg = {k: v for k, v in raw.items() if k in known}
    n = _as(int, raw, "num_hidden_layers", ModelConfig.num_hidden_layers)
    head_dim = _as(int, raw, "head_dim", ModelConfig.head_dim)

    rates = _as(dict, raw, "compress_rates", None) or {}
    csa = _as(int, raw, "compress_rate_csa", rates.get(CSA, 4))
    hca = _as(int, raw, "compress_rate_hca", rates.get(HCA, 128))
    cfg["compress_rate_csa"], cfg["compress_rate_hca"] = csa, hca

    if raw.get("layer_types") is not None:
        cfg["layer_types"] = tuple(raw["layer_types"])[:n]
    elif raw.get("compress_ratios") is not None:
        by_ratio = {0: SLIDING, csa: CSA, hca: HCA}
        ratios = list(raw["compress_ratios"])
        unknown = sorted({r for r in ratios if r not in by_ratio})
        if unknown:
            raise ConfigError(f"compress_ratios holds {unknown}, which is neither 0, {csa} (CSA) nor {hca} (HCA).")
        cfg["layer_types"] = tuple(by_ratio[r] for r in ratios[:n])
    else:  # transformers' default: two HCA layers, then CSA / HCA interleaved
        cfg["layer_types"] = tuple([HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))])

    if raw.get("mlp_layer_types") is not None:
        cfg["mlp_layer_types"] = tuple(raw["mlp_layer_types"])[:n]
    else:
        n_hash = _as(int, raw, "num_hash_layers", 3)
        cfg["mlp_layer_types"] = tuple([HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash))

    rope_params = _as(dict, raw, "rope_parameters", None) or {}
    if isinstance(rope_params.get("main"), dict) and isinstance(rope_params.get("compress"), dict):
        main, compress = rope_params["main"], dict(rope_params["compress"])
        rope_theta = main.get("rope_theta", raw.get("rope_theta", 10000.0))
        compress_theta = compress.get("rope_theta", raw.get("compress_rope_theta", 160000.0))
        partial = compress.get("partial_rotary_factor", main.get("partial_rotary_factor"))
    else:
        rope_theta = raw.get("rope_theta", 10000.0)
        compress_theta = raw.get("compress_rope_theta", 160000.0)
        compress = dict(rope_params or _as(dict, raw, "rope_scaling", None) or {})
        partial = raw.get("partial_rotary_factor")
    if raw.get("qk_rope_head_dim") is not None and partial is None:
        cfg["qk_rope_head_dim"] = _as(int, raw, "qk_rope_head_dim")
    else:
        cfg["qk_rope_head_dim"] = int(
            head_dim * _num(partial if partial is not None else 64 / 512, "partial_rotary_factor")
        )
    rope_type = compress.get("rope_type", compress.get("type", "default"))
    rope_theta, compress_theta = _num(rope_theta, "rope_theta"), _num(compress_theta, "compress_rope_theta")
    cfg["rope_theta"], cfg["compress_rope_theta"] = rope_theta, compress_theta
    cfg["main_rope"] = RopeConfig(theta=rope_theta)
    if rope_type == "yarn":
        cfg["compress_rope"] = RopeConfig(
            theta=compress_theta,
            rope_type="yarn",
            factor=_num(compress.get("factor"), "rope factor"),
            original_max_position_embeddings=int(
                _num(compress.get("original_max_position_embeddings"), "original_max_position_embeddings")
            ),
            beta_fast=_num(compress.get("beta_fast") or 32.0, "beta_fast"),
            beta_slow=_num(compress.get("beta_slow") or 1.0, "beta_slow"),
            # DeepSeek-V4 does not scale cos/sin by YaRN's mscale unless a config says so explicitly.
            attention_factor=_num(compress.get("attention_factor", 1.0), "attention_factor"),
        )
    else:
        cfg["compress_rope"] = RopeConfig(theta=compress_theta, rope_type=rope_type)

    eos = raw.get("eos_token_id", 1)
    eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos_list):
        raise ConfigError(f"eos_token_id must be an integer or a list of integers, got {eos!r}.")
    cfg["eos_token_ids"] = tuple(eos_list)
    dtype = raw.get("dtype", raw.get("torch_dtype", "bfloat16"))
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg["quantization"] = parse_quantization(raw)
    return cfg


def _num(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {value!r}.")
    return float(value)


def _as(kind: type, raw: dict[str, Any], key: str, default: Any = ...) -> Any:
    value = raw[key] if default is ... else raw.get(key, default)
    if value is None or (kind is int and isinstance(value, int) and not isinstance(value, bool)):
        return value
    if kind is not int and isinstance(value, kind):
        return value
    article = "an integer" if kind is int else "a JSON object"
    raise ConfigError(f"{key} must be {article}, got {value!r}.")
