"""Checkpoint and config loading: clear errors for broken inputs, and every accepted layout (sharded files,
DeepSeek's own tensor names, legacy config names, bf16) loads to the same model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from leanserve.model.batch import Chunk
from leanserve.model.build import build_model
from leanserve.model.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ConfigError, ModelConfig
from leanserve.model.loader import CheckpointError, has_mtp_weights, load_weights

SINGLE = "model.safetensors"


# --- helpers ------------------------------------------------------------------------------------------
def clone(src: Path, dst: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of checkpoint `src` in `dst`, optionally with its tensors replaced."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    if tensors is None:
        shutil.copy(src / SINGLE, dst / SINGLE)
    else:
        save_file(tensors, str(dst / SINGLE), metadata={"format": "pt"})
    return dst


_DROP = object()


def edit_config(model_dir: Path, **changes) -> Path:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DROP:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    return path


def load(model_dir: Path, dtype: torch.dtype = torch.float32, with_mtp: bool = False):
    model = build_model(ModelConfig.from_hf(model_dir), max_positions=128, dtype=dtype, with_mtp=with_mtp)
    load_weights(model, model_dir, progress=False)
    return model


def logits_of(model, lean_runner_cls, ids) -> torch.Tensor:
    return lean_runner_cls(model, num_slots=1, max_len=128).prefill(ids)


@pytest.fixture(scope="module")
def tensors(tiny_ckpt) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_ckpt / SINGLE))


@pytest.fixture(scope="module")
def prompt(ids_of) -> list[int]:
    return ids_of(60, 99)


@pytest.fixture(scope="module")
def ref_logits(tiny_ckpt, lean_runner_cls, prompt) -> torch.Tensor:
    return logits_of(load(tiny_ckpt), lean_runner_cls, prompt)


# --- checkpoint errors --------------------------------------------------------------------------------
def test_error_types_are_value_errors():
    assert issubclass(CheckpointError, ValueError)
    assert issubclass(ConfigError, ValueError)


def test_missing_model_safetensors(tiny_ckpt, tmp_path):
    shutil.copy(tiny_ckpt / "config.json", tmp_path / "config.json")
    model = build_model(ModelConfig.from_hf(tmp_path), max_positions=16)
    with pytest.raises(CheckpointError, match=r"model\.safetensors") as e:
        load_weights(model, tmp_path, progress=False)
    assert str(tmp_path) in str(e.value)


@pytest.mark.parametrize(
    "drop, reported",
    [
        ("model.layers.1.attn.wkv.weight", "layers.1.attn.wkv.weight"),
        ("model.layers.2.ffn.experts.5.w3.weight", "layers.2.ffn.experts.5.w3.weight"),
        ("model.layers.0.ffn.gate.tid2eid", "layers.0.ffn.gate.tid2eid"),
        ("model.layers.3.attn.indexer.compressor.ape", "layers.3.attn.indexer.compressor.ape"),
        ("model.hc_head.hc_base", "hc_head_base"),
        ("model.embed_tokens.weight", "embed.weight"),
        ("head.weight", "head.weight"),
    ],
)
def test_missing_tensor(tiny_ckpt, tensors, tmp_path, drop, reported):
    assert drop in tensors
    broken = clone(tiny_ckpt, tmp_path, {k: v for k, v in tensors.items() if k != drop})
    with pytest.raises(CheckpointError, match="Missing tensor") as e:
        load(broken)
    assert repr(reported) in str(e.value) and str(broken) in str(e.value)


def test_missing_mtp_weights_when_the_mtp_layer_is_built(tiny_ckpt, tensors, tmp_path):
    broken = clone(tiny_ckpt, tmp_path, {k: v for k, v in tensors.items() if not k.startswith("mtp.")})
    assert not has_mtp_weights(broken) and has_mtp_weights(tiny_ckpt)
    load(broken)  # fine without the MTP layer
    with pytest.raises(CheckpointError, match=r"Missing tensor 'mtp\.0\."):
        load(broken, with_mtp=True)


def test_mtp_weights_are_skipped_without_the_mtp_layer(tiny_ckpt):
    assert any(k.startswith("mtp.0.") for k in load_file(str(tiny_ckpt / SINGLE)))
    assert load(tiny_ckpt, with_mtp=False).mtp is None


@pytest.mark.parametrize(
    "extra, with_mtp",
    [
        ("model.layers.4.attn.wkv.weight", False),  # a layer the config does not have
        ("mtp.1.attn.wkv.weight", True),  # a second MTP layer the config does not have
        ("model.something_else", False),
        ("model.norm.bias", False),
        ("model.layers.0.attn.bogus.weight", False),
        ("model.layers.3.ffn.experts.8.w1.weight", False),
        ("mtp.0.attn.bogus.weight", True),
        ("hc_head_bogus", False),
    ],
)
def test_unexpected_tensor(tiny_ckpt, tensors, tmp_path, extra, with_mtp):
    broken = clone(tiny_ckpt, tmp_path, {**tensors, extra: torch.zeros(3, 5)})
    with pytest.raises(CheckpointError, match="Unexpected tensor") as e:
        load(broken, with_mtp=with_mtp)
    assert repr(extra) in str(e.value) and str(broken / SINGLE) in str(e.value)


@pytest.mark.parametrize(
    "name",
    ["model.layers.1.attn.wq_b.weight", "model.layers.2.ffn.experts.3.w1.weight", "model.layers.1.hc_attn_fn"],
)
def test_wrong_shape(tiny_ckpt, tensors, tmp_path, name):
    wrong = tensors[name].t().contiguous()
    assert wrong.shape != tensors[name].shape
    broken = clone(tiny_ckpt, tmp_path, {**tensors, name: wrong})
    with pytest.raises(CheckpointError, match="shape") as e:
        load(broken)
    msg = str(e.value)
    assert repr(name) in msg and str(broken / SINGLE) in msg
    assert str(tuple(wrong.shape)) in msg and str(tuple(tensors[name].shape)) in msg


def test_wrong_rank(tiny_ckpt, tensors, tmp_path):
    name = "model.layers.0.attn.attn_sink"
    broken = clone(tiny_ckpt, tmp_path, {**tensors, name: tensors[name][None]})
    with pytest.raises(CheckpointError, match=r"attn_sink.*shape"):
        load(broken)


@pytest.mark.parametrize("keep", [0.5, 0.999, 20 / 1e9])
def test_truncated_file(tiny_ckpt, tmp_path, keep):
    broken = clone(tiny_ckpt, tmp_path)
    data = (broken / SINGLE).read_bytes()
    (broken / SINGLE).write_bytes(data[: max(int(len(data) * keep), 1)])
    with pytest.raises(CheckpointError) as e:
        load(broken)
    assert str(broken / SINGLE) in str(e.value)


def test_not_a_safetensors_file(tiny_ckpt, tmp_path):
    broken = clone(tiny_ckpt, tmp_path)
    (broken / SINGLE).write_text("definitely not safetensors")
    with pytest.raises(CheckpointError, match="safetensors"):
        load(broken)


def test_same_tensor_under_two_names(tiny_ckpt, tensors, tmp_path):
    broken = clone(tiny_ckpt, tmp_path, {**tensors, "embed.weight": tensors["model.embed_tokens.weight"].clone()})
    with pytest.raises(CheckpointError, match="twice"):
        load(broken)


# --- sharded checkpoints ------------------------------------------------------------------------------
def write_sharded(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
    (dst / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
    return dst


def assert_loads_like(reference_dir, model_dir, lean_runner_cls, prompt, ref_logits):
    # The same logits and the same parameters, tensor for tensor, as the reference checkpoint.
    model = load(model_dir, with_mtp=True)
    assert torch.equal(logits_of(model, lean_runner_cls, prompt), ref_logits)
    reference = load(reference_dir, with_mtp=True).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), name


def test_sharded_checkpoint_loads_to_identical_logits(
    tiny_ckpt, tensors, tmp_path, ref_logits, prompt, lean_runner_cls
):
    sharded = write_sharded(tiny_ckpt, tmp_path, tensors)
    assert not (sharded / SINGLE).exists()
    assert has_mtp_weights(sharded)
    assert_loads_like(tiny_ckpt, sharded, lean_runner_cls, prompt, ref_logits)


def test_sharded_checkpoint_with_a_missing_shard(tiny_ckpt, tensors, tmp_path):
    sharded = write_sharded(tiny_ckpt, tmp_path, tensors)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load(sharded)


def test_sharded_checkpoint_with_a_broken_index(tiny_ckpt, tensors, tmp_path):
    sharded = write_sharded(tiny_ckpt, tmp_path, tensors)
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="index"):
        load(sharded)


def test_sharded_checkpoint_missing_a_tensor(tiny_ckpt, tensors, tmp_path):
    name = "model.layers.2.attn.compressor.wgate.weight"
    sharded = write_sharded(tiny_ckpt, tmp_path, {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(CheckpointError, match=r"'layers\.2\.attn\.compressor\.wgate\.weight'"):
        load(sharded)


# --- DeepSeek's own tensor names ----------------------------------------------------------------------
def deepseek_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed.weight"
    if name.startswith("hc_head.hc_"):
        return "hc_head_" + name.removeprefix("hc_head.hc_")
    return name


def test_deepseek_names_load_to_identical_logits(tiny_ckpt, tensors, tmp_path, ref_logits, prompt, lean_runner_cls):
    renamed = {deepseek_name(k): v for k, v in tensors.items()}
    assert len(renamed) == len(tensors)
    assert {"embed.weight", "hc_head_fn", "hc_head_base", "hc_head_scale", "head.weight", "norm.weight"} <= set(renamed)
    assert not any(k.startswith("model.") for k in renamed)
    ds = clone(tiny_ckpt, tmp_path, renamed)
    assert has_mtp_weights(ds)
    assert_loads_like(tiny_ckpt, ds, lean_runner_cls, prompt, ref_logits)


def test_deepseek_names_sharded_and_mixed(tiny_ckpt, tensors, tmp_path, ref_logits, prompt, lean_runner_cls):
    # Half the tensors under DeepSeek's names, half under transformers', across two shards.
    mixed = {(deepseek_name(k) if i % 2 else k): v for i, (k, v) in enumerate(sorted(tensors.items()))}
    model = load(write_sharded(tiny_ckpt, tmp_path, mixed))
    assert torch.equal(logits_of(model, lean_runner_cls, prompt), ref_logits)


# --- bf16 -----------------------------------------------------------------------------------------------
def top1_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def test_bf16_model_from_fp32_checkpoint(tiny_ckpt, ref_logits, prompt, lean_runner_cls):
    model = load(tiny_ckpt, dtype=torch.bfloat16)
    assert model.layers["1"].attn.wq_b.weight.dtype == torch.bfloat16
    assert model.layers["1"].attn.attn_sink.dtype == torch.float32  # kept fp32 as in DeepSeek's release
    assert model.norm.weight.dtype == torch.float32 and model.hc_head_fn.dtype == torch.float32
    logits = logits_of(model, lean_runner_cls, prompt)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert top1_agreement(logits, ref_logits) >= 0.75
    assert (logits - ref_logits).abs().mean() < 0.1 * ref_logits.abs().mean()


def test_bf16_checkpoint(make_ckpt, lean_runner_cls, ids_of):
    ckpt16 = make_ckpt("tiny-bf16", dtype="bfloat16", index_n_heads=16)
    stored = load_file(str(ckpt16 / SINGLE))
    assert stored["model.layers.1.attn.wq_b.weight"].dtype == torch.bfloat16
    assert json.loads((ckpt16 / "config.json").read_text())["dtype"] == "bfloat16"
    prompt = ids_of(60, 98)
    fp32 = logits_of(load(ckpt16, dtype=torch.float32), lean_runner_cls, prompt)  # bf16 weights, fp32 compute
    model = load(ckpt16, dtype=torch.bfloat16, with_mtp=True)
    # bfloat16 activations, as off the CPU (on it, bfloat16 weights meet float32 activations by default)
    model.act_dtype = torch.bfloat16
    run = lean_runner_cls(model, num_slots=1, max_len=128)
    assert run.caches["1"].comp_rows.dtype == torch.bfloat16
    rows = [run.prefill(prompt[:40])]
    for t in range(40, len(prompt)):  # incremental decoding in bf16 too
        rows.append(run.step([Chunk(slot=0, start=t, token_ids=[prompt[t]])]))
    bf16 = torch.cat(rows)
    assert torch.isfinite(bf16).all()
    assert top1_agreement(bf16, fp32) >= 0.75


# --- config errors --------------------------------------------------------------------------------------
@pytest.fixture
def cfg_dir(tiny_ckpt, tmp_path) -> Path:
    shutil.copy(tiny_ckpt / "config.json", tmp_path / "config.json")
    return tmp_path


def test_config_round_trips(tiny_ckpt):
    cfg = ModelConfig.from_hf(tiny_ckpt)
    assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA) and cfg.index_n_heads == 16


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_hf(tmp_path)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "llama", None])
def test_unknown_model_type(cfg_dir, model_type):
    path = edit_config(cfg_dir, model_type=model_type if model_type else _DROP)
    with pytest.raises(ConfigError, match="model_type") as e:
        ModelConfig.from_hf(cfg_dir)
    assert str(path) in str(e.value) and repr(model_type) in str(e.value)


@pytest.mark.parametrize("text", ["{not json", "", '{"model_type": "deepseek_v4",}', "\xff\xfe"])
def test_config_not_json(cfg_dir, text):
    (cfg_dir / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError, match="JSON") as e:
        ModelConfig.from_hf(cfg_dir)
    assert str(cfg_dir / "config.json") in str(e.value)


@pytest.mark.parametrize("text", ["[1, 2]", '"deepseek_v4"', "null", "42"])
def test_config_not_an_object(cfg_dir, text):
    (cfg_dir / "config.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(cfg_dir)
    assert str(cfg_dir / "config.json") in str(e.value)


WRONG_TYPES = [
    ("hidden_size", "64", "hidden_size"),
    ("vocab_size", True, "vocab_size"),
    ("num_attention_heads", 4.0, "num_attention_heads"),
    ("index_topk", 0, "index_topk"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps"),
    ("layer_types", 5, None),
    ("compress_rates", [1, 2], None),
    ("scoring_func", "relu", "scoring_func"),
    ("num_key_value_heads", 8, "num_key_value_heads"),
    ("eos_token_id", 4096, "eos_token_id"),
    ("dtype", "int8", "int8"),
]
WRONG_TYPES_NESTED = [  # fields converted while normalising legacy/nested names
    ("num_hidden_layers", "four", "num_hidden_layers"),
    ("head_dim", "abc", "head_dim"),
    ("eos_token_id", "x", "eos_token_id"),
    ("rope_parameters", "yarn", "rope_parameters"),
    ("rope_parameters", {"main": {"rope_theta": "big"}, "compress": {}}, "rope_theta"),
]


@pytest.mark.parametrize(
    "field, value, named",
    WRONG_TYPES + WRONG_TYPES_NESTED,
)
def test_config_field_of_the_wrong_type(cfg_dir, field, value, named):
    path = edit_config(cfg_dir, **{field: value})
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(cfg_dir)
    assert str(path) in str(e.value)
    if named:
        assert named in str(e.value)


def test_layer_types_length_mismatch(cfg_dir):
    path = edit_config(cfg_dir, layer_types=[SLIDING, CSA, HCA])
    with pytest.raises(ConfigError, match=r"layer_types has 3 entries but num_hidden_layers is 4") as e:
        ModelConfig.from_hf(cfg_dir)
    assert str(path) in str(e.value)


def test_mlp_layer_types_length_mismatch(cfg_dir):
    edit_config(cfg_dir, mlp_layer_types=[HASH_MOE, MOE])
    with pytest.raises(ConfigError, match=r"mlp_layer_types has 2 entries"):
        ModelConfig.from_hf(cfg_dir)


def test_unknown_layer_type(cfg_dir):
    edit_config(cfg_dir, layer_types=[SLIDING, CSA, "full_attention", CSA])
    with pytest.raises(ConfigError, match="full_attention"):
        ModelConfig.from_hf(cfg_dir)


def test_heads_not_divisible_by_o_groups(cfg_dir):
    path = edit_config(cfg_dir, o_groups=3)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) must be divisible by o_groups \(3\)") as e:
        ModelConfig.from_hf(cfg_dir)
    assert str(path) in str(e.value)


def test_unknown_compress_ratio(cfg_dir):
    edit_config(cfg_dir, layer_types=_DROP, compress_ratios=[0, 4, 8, 4])
    with pytest.raises(ConfigError, match=r"compress_ratios holds \[8\]"):
        ModelConfig.from_hf(cfg_dir)


def test_yarn_without_original_max_positions(cfg_dir, tiny_ckpt):
    rope = json.loads((tiny_ckpt / "config.json").read_text())["rope_parameters"]
    del rope["compress"]["original_max_position_embeddings"]
    edit_config(cfg_dir, rope_parameters=rope)
    with pytest.raises(ConfigError):
        ModelConfig.from_hf(cfg_dir)


# --- legacy (DeepSeek) config names ---------------------------------------------------------------------
def legacy_config(hf: dict, rope_key: str) -> dict:
    """DeepSeek's own spelling of a transformers-written config."""
    out = {
        k: v
        for k, v in hf.items()
        if k
        not in (
            "layer_types",
            "mlp_layer_types",
            "compress_rates",
            "rope_parameters",
            "partial_rotary_factor",
            "dtype",
            "qk_rope_head_dim",
        )
    }
    rates = hf["compress_rates"]
    by_type = {SLIDING: 0, CSA: rates[CSA], HCA: rates[HCA]}
    out["compress_ratios"] = [by_type[t] for t in hf["layer_types"]] + [0]  # DeepSeek lists the MTP layer too
    out["compress_rate_csa"], out["compress_rate_hca"] = rates[CSA], rates[HCA]
    out["num_hash_layers"] = hf["mlp_layer_types"].count(HASH_MOE)
    assert hf["mlp_layer_types"] == [HASH_MOE] * out["num_hash_layers"] + [MOE] * (
        len(hf["mlp_layer_types"]) - out["num_hash_layers"]
    )
    out["qk_rope_head_dim"] = round(hf["partial_rotary_factor"] * hf["head_dim"])
    out["torch_dtype"] = hf["dtype"]
    compress = hf["rope_parameters"]["compress"]
    out["rope_theta"] = hf["rope_parameters"]["main"]["rope_theta"]
    out["compress_rope_theta"] = compress["rope_theta"]
    flat = {k: v for k, v in compress.items() if k not in ("rope_theta", "partial_rotary_factor", "attention_factor")}
    if rope_key == "rope_scaling":  # DeepSeek's spelling: "type", no attention_factor
        flat["type"] = flat.pop("rope_type")
    out[rope_key] = flat
    return out


@pytest.mark.parametrize("rope_key", ["rope_scaling", "rope_parameters"])
def test_legacy_config_names_parse_to_the_same_config(tiny_ckpt, tmp_path, rope_key):
    hf = json.loads((tiny_ckpt / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(legacy_config(hf, rope_key)))
    legacy, modern = ModelConfig.from_hf(tmp_path), ModelConfig.from_hf(tiny_ckpt)
    assert legacy.compress_rope.rope_type == "yarn"
    assert legacy == modern


def test_legacy_config_matches_transformers_parse(make_ckpt, tmp_path):
    # With DeepSeek's real rates (4 / 128), transformers reads the legacy names too: both must agree.
    from transformers import DeepseekV4Config

    ckpt = make_ckpt(
        "legacy-128",
        num_hidden_layers=5,
        layer_types=(HCA, HCA, CSA, HCA, CSA),
        mlp_layer_types=(HASH_MOE, HASH_MOE, MOE, MOE, MOE),
        compress_rate_hca=128,
    )
    hf = json.loads((ckpt / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(legacy_config(hf, "rope_scaling")))
    ours = ModelConfig.from_hf(tmp_path)
    assert ours == ModelConfig.from_hf(ckpt)
    theirs = DeepseekV4Config.from_pretrained(tmp_path)
    assert list(ours.layer_types) == theirs.layer_types
    assert list(ours.mlp_layer_types) == theirs.mlp_layer_types
    assert ours.qk_rope_head_dim == theirs.qk_rope_head_dim
    compress = theirs.rope_parameters["compress"]
    assert compress["rope_type"] == ours.compress_rope.rope_type == "yarn"
    assert compress["factor"] == ours.compress_rope.factor
    assert compress["original_max_position_embeddings"] == ours.compress_rope.original_max_position_embeddings
    assert compress.get("attention_factor", 1.0) == ours.compress_rope.attention_factor
    assert compress["rope_theta"] == ours.compress_rope.theta
    assert theirs.rope_parameters["main"]["rope_theta"] == ours.main_rope.theta
