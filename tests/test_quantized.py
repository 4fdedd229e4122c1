"""Published (FP8 / FP4) checkpoints: transformers and leanserve agree on the same quantized files, `leanserve
quantize` is exact, bad checkpoints fail with one sentence before anything is allocated, and the engine holds
the file's bytes (the weights stay quantized in memory).

transformers (with accelerate) dequantizes the published format at load on a CPU (its FineGrainedFP8 quantizer's
Fp8Dequantize: FP8 blocks and I8-packed FP4 experts); leanserve keeps the bytes and dequantizes per call.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from leanserve import LLM, SamplingParams
from leanserve.cli import main
from leanserve.model import loader
from leanserve.model.batch import Chunk
from leanserve.model.build import build_model
from leanserve.model.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ConfigError, ModelConfig
from leanserve.model.deepseek_v4 import DeepseekV4
from leanserve.model.loader import CheckpointError, load_weights
from leanserve.model.quant import Fp4Weight, Fp8Experts, quantize_fp4, quantize_fp8
from leanserve.quantize import quantize_checkpoint
from test_memory import live_storages

TOL = 1e-4
NEW_TOKENS = 32
SINGLE = "model.safetensors"

CONFIGS = {
    # The tiny preset (sliding / CSA / HCA, hash + top-k MoE, YaRN, MTP layer): every dimension below 128, so each
    # FP8 linear is one partial block; FP4 experts.
    "tiny-fp4": dict(seed=0, prompt_len=80, expert_dtype="fp4", overrides=dict(index_n_heads=16)),
    # FP8 (Base-style) experts, layers in another order, hc_mult 2, sigmoid router.
    "tiny-fp8-experts": dict(
        seed=1,
        prompt_len=70,
        expert_dtype="fp8",
        overrides=dict(
            hc_mult=2,
            scoring_func="sigmoid",
            num_hidden_layers=3,
            layer_types=(HCA, CSA, SLIDING),
            mlp_layer_types=(HASH_MOE, MOE, MOE),
            index_n_heads=16,
            index_topk=64,
        ),
    ),
    # Dimensions that are multiples of 128 with several FP8 blocks per matrix (hidden 256: 2 x 2 blocks for wo_b),
    # DeepSeek's rates 4 / 128 (config.json then has compress_ratios only, no layer_types), FP4 experts.
    "x128-fp4": dict(
        seed=2,
        prompt_len=300,
        expert_dtype="fp4",
        overrides=dict(
            hidden_size=256,
            moe_intermediate_size=128,
            q_lora_rank=128,
            o_lora_rank=128,
            head_dim=64,
            qk_rope_head_dim=16,
            index_head_dim=64,
            index_n_heads=16,
            compress_rate_hca=128,
            layer_types=(SLIDING, CSA, HCA, CSA),
            max_position_embeddings=2048,
        ),
    ),
}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """published(name) -> a random published-format checkpoint for CONFIGS[name], written once."""
    from leanserve.make_random import make_random

    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            spec = CONFIGS[name]
            made[name] = make_random(
                tmp_path_factory.mktemp(f"pub-{name}"),
                "tiny",
                spec["seed"],
                format="published",
                expert_dtype=spec["expert_dtype"],
                **spec["overrides"],
            )
        return made[name]

    return make


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, published, lean_loader):
    from transformers import DeepseekV4ForCausalLM

    spec = CONFIGS[request.param]
    path = published(request.param)
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return request.param, spec, path, lean_loader(path, with_mtp=True, max_len=512), hf


def test_the_file_is_the_published_layout(pair):
    name, spec, path, lean, hf = pair
    with safe_open(str(path / SINGLE), "pt") as f:
        names = f.keys()
        dtypes = {k: f.get_slice(k).get_dtype() for k in names}
    raw = json.loads((path / "config.json").read_text())
    assert raw["quantization_config"]["weight_block_size"] == [128, 128] and raw["expert_dtype"] == spec["expert_dtype"]
    assert len(raw["compress_ratios"]) == lean.cfg.num_hidden_layers + 1  # the MTP layer's entry too
    assert ("layer_types" in raw) == (lean.cfg.compress_rate_hca != 128)
    assert not any(k.startswith("model.") for k in dtypes)
    assert dtypes["layers.0.attn.kv_norm.weight"] == "BF16" and "layers.0.attn.norm.weight" not in dtypes
    assert dtypes["layers.1.attn.wq_a.weight"] == dtypes["mtp.0.e_proj.weight"] == "F8_E4M3"
    assert dtypes["layers.1.attn.wq_a.scale"] == dtypes["layers.1.ffn.experts.0.w1.scale"] == "F8_E8M0"
    assert dtypes["layers.1.ffn.experts.3.w2.weight"] == ("I8" if spec["expert_dtype"] == "fp4" else "F8_E4M3")
    assert dtypes["embed.weight"] == dtypes["head.weight"] == dtypes["layers.1.attn.compressor.wkv.weight"] == "BF16"
    assert dtypes["layers.1.hc_attn_fn"] == dtypes["layers.1.attn.attn_sink"] == "F32"
    assert dtypes["layers.0.ffn.gate.tid2eid"] == "I64"
    # leanserve keeps the stored formats (the torch backend dequantizes per call) and built the MTP layer.
    assert lean.cfg.quantization.experts == spec["expert_dtype"] and lean.mtp is not None
    assert lean.layers["1"].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert lean.layers["1"].ffn.experts.w13.dtype == (
        torch.uint8 if spec["expert_dtype"] == "fp4" else torch.float8_e4m3fn
    )
    assert list(lean.cfg.layer_types) == list(hf.config.layer_types)


def test_prefill_logits_match_transformers(pair, lean_runner_cls, ids_of):
    name, spec, path, lean, hf = pair
    ids = ids_of(spec["prompt_len"], spec["seed"] + 100)
    assert len(ids) > lean.cfg.sliding_window and len(ids) // lean.cfg.compress_rate_hca >= 2
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = lean_runner_cls(lean, num_slots=1, max_len=512).prefill(ids)
    err = (ours - ref).abs().max().item()
    print(f"{name}: prefill max |dlogit| {err:.3g} over {len(ids)} positions")
    assert err <= TOL, f"max |dlogit| {err:.3g}"
    assert ref.abs().max() > 0.5
    # The default backend ("auto") and the torch one give the same model (quantized weights run through torch).
    auto = build_model(lean.cfg, 512, torch.float32, with_mtp=True, backend="auto", checkpoint=path)
    load_weights(auto, path, progress=False)
    assert torch.equal(lean_runner_cls(auto, num_slots=1, max_len=512).prefill(ids), ours)


def test_greedy_matches_transformers_generate(pair, lean_runner_cls, ids_of):
    name, spec, path, lean, hf = pair
    ids = ids_of(spec["prompt_len"], spec["seed"] + 200)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids) :].tolist()
    ours = lean_runner_cls(lean, num_slots=1, max_len=512).greedy(ids, NEW_TOKENS)
    same = sum(a == b for a, b in zip(ours, ref, strict=True))
    print(f"{name}: greedy tokens equal {same}/{NEW_TOKENS}")
    assert ours == ref


def test_decode_logits_match_transformers_full_forward(pair, lean_runner_cls, ids_of):
    name, spec, path, lean, hf = pair
    prompt = spec["prompt_len"]
    ids = ids_of(prompt + 16, spec["seed"] + 300)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    run = lean_runner_cls(lean, num_slots=1, max_len=512)
    rows = [run.prefill(ids[:prompt])]
    for t in range(prompt, len(ids)):
        rows.append(run.step([Chunk(slot=0, start=t, token_ids=ids[t : t + 1])]))
    err = (torch.cat(rows) - ref).abs().max().item()
    print(f"{name}: decode max |dlogit| {err:.3g}")
    assert err <= TOL


@pytest.mark.xfail(strict=True, reason="transformers 5.24 splits a partial 128-block evenly (rows // scale rows)")
def test_transformers_dequantizes_partial_fp8_blocks_over_128():
    # Why the transformers parity configs keep each dimension below 128 or a multiple of it: for 192 rows (two
    # scale rows) transformers' Fp8Dequantize uses 96-row blocks, where DeepSeek's are 128 + 64 (and for 320 rows
    # it refuses: 320 is not divisible by 3). The published checkpoints' dimensions are all multiples of 128.
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = torch.randn(192, 64) * torch.logspace(0, 3, 192)[:, None]
    q = quantize_fp8(w)
    theirs = Fp8Dequantize(None)._dequantize_one(q.q, q.scale.view(torch.float8_e8m0fnu), torch.float32)
    assert torch.equal(theirs, q.dequantize())


# --- the published layout's variants load to the same model -----------------------------------------------
def logits(model_dir: Path, lean_runner_cls, ids) -> torch.Tensor:
    model = build_model(ModelConfig.from_hf(model_dir), 256, torch.float32, checkpoint=model_dir)
    load_weights(model, model_dir, progress=False)
    return lean_runner_cls(model, num_slots=1, max_len=256).prefill(ids)


def clone(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / SINGLE), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def tiny_pub(published) -> Path:
    return published("tiny-fp4")


@pytest.fixture(scope="module")
def pub_tensors(tiny_pub) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_pub / SINGLE))


@pytest.fixture(scope="module")
def pub_logits(tiny_pub, lean_runner_cls, ids_of) -> torch.Tensor:
    return logits(tiny_pub, lean_runner_cls, ids_of(40, 7))


def test_sharded_and_byte_scales_and_transformers_names_load_alike(
    tiny_pub, pub_tensors, tmp_path, lean_runner_cls, ids_of, pub_logits
):
    ids = ids_of(40, 7)
    # Sharded as published (make-random --max-shard-size).
    sharded = tmp_path / "sharded"
    assert main(["make-random", str(sharded), "--format", "published", "--max-shard-size", "150KB"]) == 0
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) == len(pub_tensors)
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 2
    assert torch.equal(logits(sharded, lean_runner_cls, ids), pub_logits)  # (seed 0 tiny, as tiny_pub)
    # Scales as U8 bytes, packed FP4 as U8, the kv norm under transformers' name `attn.norm`.
    variant = {}
    for k, v in pub_tensors.items():
        if v.dtype in (torch.float8_e8m0fnu, torch.int8):
            v = v.view(torch.uint8)
        variant[k.replace(".attn.kv_norm.", ".attn.norm.")] = v
    assert torch.equal(logits(clone(tiny_pub, tmp_path / "bytes", variant), lean_runner_cls, ids), pub_logits)


def test_tid2eid_as_int32_loads_alike(tiny_pub, pub_tensors, tmp_path, lean_runner_cls, ids_of, pub_logits):
    i32 = {k: (v.to(torch.int32) if k.endswith("tid2eid") else v) for k, v in pub_tensors.items()}
    assert torch.equal(logits(clone(tiny_pub, tmp_path, i32), lean_runner_cls, ids_of(40, 7)), pub_logits)


def test_loaded_bytes_are_the_files_bytes(tiny_pub, pub_tensors, lean_loader):
    model = lean_loader(tiny_pub, with_mtp=True)
    experts = model.layers["1"].ffn.experts
    for e in (0, 5):
        packed = pub_tensors[f"layers.1.ffn.experts.{e}.w1.weight"].view(torch.uint8)
        assert torch.equal(experts.w13[e, : packed.shape[0]], packed)
        assert torch.equal(experts.w2_scale[e], pub_tensors[f"layers.1.ffn.experts.{e}.w2.scale"].view(torch.uint8))
    wkv = model.mtp["0"].attn.wkv
    assert torch.equal(wkv.weight.view(torch.uint8), pub_tensors["mtp.0.attn.wkv.weight"].view(torch.uint8))


# --- leanserve quantize --------------------------------------------------------------------------------
@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_quantize_is_exact_and_close_to_the_source(
    tiny_ckpt, tmp_path, lean_loader, lean_runner_cls, ids_of, expert_dtype
):
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    (src / "generation_config.json").write_text('{"eos_token_id": 1}')
    (src / "tokenizer.json").write_text("{}")
    dst = tmp_path / "dst"
    argv = ["quantize", str(src), str(dst), "--expert-dtype", expert_dtype]
    assert main(argv) == 0
    assert (dst / "generation_config.json").read_text() == '{"eos_token_id": 1}' and (dst / "tokenizer.json").exists()
    source, quantized = lean_loader(src, with_mtp=True), lean_loader(dst, with_mtp=True)
    assert quantized.cfg.quantization.experts == expert_dtype
    # Exactness: every stored weight dequantizes to re-quantizing the source's.
    fp4 = expert_dtype == "fp4"
    for (name, m), (_, s) in zip(quantized.named_modules(), source.named_modules(), strict=True):
        if hasattr(m, "w") and getattr(m, "quant", None) == "fp8":
            assert torch.equal(m.w().dequantize(), quantize_fp8(s.weight).dequantize()), name
        if name.endswith(".ffn.experts"):
            w13, w2 = m.stored()
            assert isinstance(w13, Fp4Weight if fp4 else Fp8Experts)
            for e in (0, 7):
                inter = s.w13.shape[1] // 2
                requant = quantize_fp4 if fp4 else quantize_fp8
                ref13 = torch.cat([requant(s.w13[e, :inter]).dequantize(), requant(s.w13[e, inter:]).dequantize()])
                got13 = Fp4Weight(w13.packed[e], w13.scale[e]).dequantize() if fp4 else w13.expert(e)
                assert torch.equal(got13, ref13), name
                got2 = Fp4Weight(w2.packed[e], w2.scale[e]).dequantize() if fp4 else w2.expert(e)
                assert torch.equal(got2, requant(s.w2[e]).dequantize()), name
    assert torch.equal(quantized.embed.weight, source.embed.weight.bfloat16().float())
    # Close to the unquantized model: teacher-forced logits correlate and mostly share their top-1 (a random
    # model's near-flat logits make greedy runs part at the first differing token: reported, not asserted).
    ids = ids_of(60, 11)
    a, b = lean_runner_cls(quantized, 1, 256).prefill(ids), lean_runner_cls(source, 1, 256).prefill(ids)
    corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    ours = lean_runner_cls(quantized, 1, 256).greedy(ids, NEW_TOKENS)
    ref = lean_runner_cls(source, 1, 256).greedy(ids, NEW_TOKENS)
    same = sum(x == y for x, y in zip(ours, ref, strict=True))
    print(
        f"quantize ({expert_dtype} experts): greedy {same}/{NEW_TOKENS} equal; logits corr {corr:.3f}, top-1 {top1:.2f}"
    )
    assert corr > 0.9 and top1 > 0.5


def test_quantize_a_bf16_source(make_ckpt, tmp_path, lean_loader):
    src = make_ckpt("tiny-bf16-quantize", dtype="bfloat16")
    quantize_checkpoint(src, tmp_path / "out", "fp4")
    assert lean_loader(tmp_path / "out").cfg.quantization is not None


def test_quantize_refuses(tiny_ckpt, tiny_pub, tmp_path, capsys):
    assert main(["quantize", str(tiny_pub), str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "already quantized" in err and str(tiny_pub) in err and err.count("\n") == 1
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep")
    assert main(["quantize", str(tiny_ckpt), str(busy)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err and err.count("\n") == 1
    assert main(["quantize", str(tiny_ckpt), str(busy), "--force"]) == 0
    assert ModelConfig.from_hf(busy).quantization is not None and (busy / "notes.txt").exists()


# --- bad input: one sentence naming the tensor (or field) and the file, before anything is allocated -------
@pytest.fixture
def never_allocates(monkeypatch):
    """Counts model allocations (to_empty) and tensor reads while a bad checkpoint is opened."""
    calls = {"to_empty": 0, "read": 0}
    to_empty, read = DeepseekV4.to_empty, loader._read

    def counting_to_empty(self, *a, **k):
        calls["to_empty"] += 1
        return to_empty(self, *a, **k)

    def counting_read(*a, **k):
        calls["read"] += 1
        return read(*a, **k)

    monkeypatch.setattr(DeepseekV4, "to_empty", counting_to_empty)
    monkeypatch.setattr(loader, "_read", counting_read)
    return calls


def edited(tiny_pub: Path, tmp_path: Path, tensors: dict, **config) -> Path:
    out = clone(tiny_pub, tmp_path / "bad", tensors)
    raw = json.loads((out / "config.json").read_text())
    for key, value in config.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (out / "config.json").write_text(json.dumps(raw))
    return out


def replaced(tensors: dict, name: str, value: torch.Tensor) -> dict:
    return {**tensors, name: value}


def fp8_as_bf16(t):
    fp8 = "layers.2.attn.wo_b.weight"
    return replaced(t, fp8, t[fp8].float().bfloat16()), fp8, r"stored as BF16.*F8_E4M3"


def plain_config_with_fp8(t):
    return t, None, r"has no quantization_config"


def scale_shape(t):
    name = "layers.1.attn.indexer.wq_b.scale"
    return replaced(t, name, t[name][:2]), name, r"shape \(2, 1\), expected \(4, 1\).*128x128 block"


def scale_dtype(t):
    name = "layers.3.ffn.experts.6.w3.scale"
    return replaced(t, name, t[name].float()), name, r"stored as F32.*F8_E8M0"


def fp4_inner_dim(t):
    name = "layers.2.ffn.experts.1.w2.weight"  # stored [H, I] bytes instead of [H, I / 2]
    return replaced(t, name, torch.cat([t[name], t[name]], dim=1)), name, r"\(64, 32\), expected \(64, 16\).*two values"


def fp4_expert_scale_shape(t):
    name = "layers.1.ffn.experts.0.w1.scale"
    return replaced(t, name, t[name][:, :1].contiguous()), name, r"per 32 inputs"


BAD = [fp8_as_bf16, plain_config_with_fp8, scale_shape, scale_dtype, fp4_inner_dim, fp4_expert_scale_shape]


@pytest.mark.parametrize("bad", BAD, ids=lambda f: f.__name__)
def test_bad_published_checkpoint(tiny_pub, pub_tensors, tmp_path, never_allocates, bad):
    tensors, name, message = bad(pub_tensors)
    changes = {"quantization_config": None, "expert_dtype": None} if bad is plain_config_with_fp8 else {}
    model_dir = edited(tiny_pub, tmp_path, tensors, **changes)
    with pytest.raises(CheckpointError, match=message) as e:
        LLM(str(model_dir), max_model_len=64, load_progress=False)
    text = str(e.value)
    assert str(model_dir) in text and text.count(". ") <= 1, text
    if name is not None:
        assert repr(name) in text
    assert never_allocates == {"to_empty": 0, "read": 0}


def test_fp8_experts_config_with_fp4_tensors(tiny_pub, pub_tensors, tmp_path, never_allocates):
    model_dir = edited(tiny_pub, tmp_path, pub_tensors, expert_dtype="fp8")
    with pytest.raises(CheckpointError, match=r"stored as I8.*expert_dtype 'fp8' says F8_E4M3") as e:
        LLM(str(model_dir), max_model_len=64, load_progress=False)
    assert "ffn.experts." in str(e.value) and str(model_dir) in str(e.value)
    assert never_allocates == {"to_empty": 0, "read": 0}


def test_plain_checkpoint_with_a_stray_scale(tiny_ckpt, tmp_path, never_allocates):
    tensors = load_file(str(tiny_ckpt / SINGLE))
    tensors["model.layers.1.attn.wq_a.scale"] = torch.zeros(1, 1, dtype=torch.uint8)
    model_dir = clone(tiny_ckpt, tmp_path / "stray", tensors)
    with pytest.raises(CheckpointError, match=r"'model.layers.1.attn.wq_a.scale'.*quantization scale.*no quantization"):
        LLM(str(model_dir), max_model_len=64, load_progress=False)
    assert never_allocates["to_empty"] == 0


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("weight_block_size", [64, 64], "quantization_config.weight_block_size"),
        ("quant_method", "awq", "quantization_config.quant_method"),
        ("fmt", "e5m2", "quantization_config.fmt"),
        ("scale_fmt", "float", "quantization_config.scale_fmt"),
        ("expert_dtype", "int4", "expert_dtype"),
    ],
)
def test_bad_quantization_config(tiny_pub, tmp_path, never_allocates, field, value, named):
    out = tmp_path / "cfg"
    shutil.copytree(tiny_pub, out)
    raw = json.loads((out / "config.json").read_text())
    if field == "expert_dtype":
        raw["expert_dtype"] = value
    else:
        raw["quantization_config"][field] = value
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=named) as e:
        LLM(str(out), max_model_len=64, load_progress=False)
    assert str(out) in str(e.value) and repr(value) in str(e.value)
    assert never_allocates["to_empty"] == 0


def test_fp4_needs_dimensions_in_multiples_of_32(tmp_path):
    from leanserve.make_random import make_random

    with pytest.raises(ConfigError, match="moe_intermediate_size 48 is not a multiple of 32"):
        make_random(tmp_path, "tiny", format="published", moe_intermediate_size=48)
    make_random(tmp_path / "fp8", "tiny", format="published", expert_dtype="fp8", moe_intermediate_size=48)


# --- memory: the engine holds the file's bytes ----------------------------------------------------------
def test_engine_holds_about_the_files_bytes(tiny_pub, pub_tensors, ids_of):
    before = live_storages()
    llm = LLM(str(tiny_pub), max_model_len=128, max_num_seqs=2, load_progress=False)  # dtype auto: bfloat16
    llm.generate([{"prompt_token_ids": ids_of(40, seed=1)}], SamplingParams(max_tokens=6))
    (stage,) = llm.memory_ledger()
    alive = sum(n for ptr, n in live_storages().items() if ptr not in before)
    assert alive == stage.weights_bytes + stage.buffers_bytes
    file_bytes = sum(t.nbytes for k, t in pub_tensors.items() if not k.startswith("mtp."))  # (no MTP layer built)
    norms = sum(t.nbytes for k, t in pub_tensors.items() if "norm" in k and not k.startswith("mtp."))
    # The same bytes, but the norms, which the model keeps in float32 (the file has them in bfloat16).
    assert stage.weights_bytes == file_bytes + norms


def test_pipeline_and_mtp_speculation_on_a_published_checkpoint_give_plain_tokens(tiny_pub, ids_of):
    # PP=2 (two stage processes) and MTP speculation on the FP4 / FP8 checkpoint give PP=1's plain greedy tokens
    # and logprobs: the stored formats are read alike on every stage and by the MTP layer.
    prompts = [{"prompt_token_ids": ids_of(n, seed=n)} for n in (5, 40, 75)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = {}
    for name, kwargs in {
        "plain": {},
        "pp2": {"pipeline_parallel_size": 2},
        "mtp": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
        "pp2+mtp": {"pipeline_parallel_size": 2, "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}},
    }.items():
        with LLM(
            str(tiny_pub), dtype="float32", max_model_len=128, max_num_seqs=3, load_progress=False, **kwargs
        ) as llm:
            runs[name] = llm.generate(prompts, params)
            if "speculative_config" in kwargs:
                assert llm.spec_decode_metrics()["num_drafts"] > 0
    for name, outs in runs.items():
        for a, b in zip(runs["plain"], outs, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids, name
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                (tok,) = x
                assert abs(x[tok].logprob - y[tok].logprob) < 1e-4, name
