"""The memory ledger: it lists every persistent tensor the engine allocates besides weights (checked against
the tensors really alive), and `target_hidden_states` exists only on the last stage with MTP on."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
from collections import Counter
from pathlib import Path

import pytest
import torch

from leanserve import LLM, SamplingParams
from leanserve.cli import main
from leanserve.engine.config import EngineConfig, SpeculativeConfig
from leanserve.engine.runner import StageRunner
from leanserve.engine.topology import PipelineTopology
from leanserve.memory import PIPELINE, SPEC_MTP, MemoryLedger, weights_by_format
from leanserve.model.build import build_model
from leanserve.model.cache import CacheGeometry
from leanserve.model.config import ConfigError, ModelConfig, Quantization
from leanserve.model.layers import Linear
from leanserve.model.moe import Experts

MIB = 2**20
SPECS = {
    "none": None,
    "mtp": {"method": "mtp", "num_speculative_tokens": 2},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 2, "model": "DRAFT"},
}


def live_storages() -> dict[int, int]:
    """data_ptr -> bytes of every tensor storage alive in this process (views share one storage). The collector
    lists only the objects it walks, so those an engine's warm-up put out of its walks (gc.freeze) come back first."""
    gc.unfreeze()
    gc.collect()
    out = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


def new_bytes(before: dict[int, int]) -> int:
    return sum(n for ptr, n in live_storages().items() if ptr not in before)


def spec_for(name: str, ckpt: Path) -> dict | None:
    spec = SPECS[name]
    return None if spec is None else {k: (str(ckpt) if v == "DRAFT" else v) for k, v in spec.items()}


# --- the ledger is what is allocated ------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_engine_allocates_exactly_its_weights_plus_its_ledger(tiny_ckpt, ids_of, spec):
    before = live_storages()
    llm = LLM(
        str(tiny_ckpt),
        max_model_len=128,
        max_num_seqs=3,
        load_progress=False,
        speculative_config=spec_for(spec, tiny_ckpt),
    )
    llm.generate([{"prompt_token_ids": ids_of(40, seed=1)}], SamplingParams(max_tokens=6))  # steady state
    (stage,) = llm.memory_ledger()
    assert new_bytes(before) == stage.weights_bytes + stage.buffers_bytes
    assert (stage.find("target_hidden_states") is not None) == (spec == "mtp")


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("pp", [1, 3])
def test_every_stage_allocates_its_ledger_and_target_hidden_only_where_mtp_reads_it(tiny_ckpt, pp, spec):
    cfg = ModelConfig.from_hf(tiny_ckpt)
    config = EngineConfig(
        str(tiny_ckpt), max_num_seqs=2, max_num_batched_tokens=64, speculative_config=spec_for(spec, tiny_ckpt)
    )
    topology = PipelineTopology.build(cfg, pp)
    for i in range(pp):
        before = live_storages()
        runner = StageRunner(cfg, config, topology.layout(i), torch.float32, 128, progress=False)
        memory = runner.memory
        assert new_bytes(before) == memory.weights_bytes + memory.buffers_bytes, f"stage {i}"
        target = memory.find("target_hidden_states")
        if spec == "mtp" and i == pp - 1:
            assert target is not None and target.feature == SPEC_MTP
            assert target.shape == (64, cfg.hc_mult * cfg.hidden_size) and target.dtype == "float32"
            assert target.bytes == 64 * cfg.hc_dim * 4
            assert runner.target_hidden.data_ptr() == runner.target_hidden.untyped_storage().data_ptr()
        else:
            assert target is None and runner.target_hidden is None
        # The MTP layer (and its cache) exist only with MTP on, on the last stage.
        has_mtp = any(e.owner == "mtp.0" for e in memory.buffers)
        assert has_mtp == (spec == "mtp" and i == pp - 1)
        assert (memory.find("pp_recv_streams") is not None) == (i > 0)
        del runner


def test_the_forward_fills_target_hidden_with_the_pre_head_streams(tiny_ckpt, ids_of):
    spec = spec_for("mtp", tiny_ckpt)
    with LLM(str(tiny_ckpt), max_model_len=128, max_num_seqs=2, load_progress=False, speculative_config=spec) as llm:
        runner = llm.engine.executor.runner
        runner.target_hidden.fill_(float("nan"))
        address = runner.target_hidden.data_ptr()
        llm.generate([{"prompt_token_ids": ids_of(20, seed=3)}], SamplingParams(max_tokens=1))
        assert runner.target_hidden.data_ptr() == address  # allocated once, never replaced
        assert torch.isfinite(runner.target_hidden[:20]).all()  # the prefill's 20 rows were written
        assert torch.isnan(runner.target_hidden[20:]).all()  # and nothing else


def test_generation_is_the_same_with_the_buffer_on(tiny_ckpt, ids_of):
    prompt = {"prompt_token_ids": ids_of(30, seed=4)}
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
    kwargs = dict(max_model_len=128, max_num_seqs=2, load_progress=False)
    with LLM(str(tiny_ckpt), **kwargs) as llm:
        want = llm.generate(prompt, params)[0].outputs[0]
    with LLM(str(tiny_ckpt), speculative_config=spec_for("mtp", tiny_ckpt), **kwargs) as llm:
        got = llm.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == want.token_ids


def test_pipeline_stages_report_their_ledgers(tiny_ckpt, caplog):
    spec = spec_for("mtp", tiny_ckpt)
    with caplog.at_level(logging.INFO, logger="leanserve"):
        llm = LLM(
            str(tiny_ckpt), max_model_len=128, pipeline_parallel_size=2, speculative_config=spec, load_progress=False
        )
    with llm:
        stages = llm.memory_ledger()
        assert [s.stage for s in stages] == [0, 1]
        assert stages[0].find("target_hidden_states") is None and stages[0].find("pp_recv_streams") is None
        assert stages[1].find("target_hidden_states").bytes == 2048 * 4 * 64 * 4  # 2048 tokens x hc_dim, fp32
        assert stages[1].find("pp_recv_streams").feature == PIPELINE
    logged = caplog.text
    assert "stage 0 (layers 0-1)" in logged and "stage 1 (layers 2-3)" in logged and "spec_decode:mtp" in logged


# --- weights by stored format ---------------------------------------------------------------------------
def test_a_plain_models_weights_are_named_by_dtype(tiny_ckpt):
    cfg = ModelConfig.from_hf(tiny_ckpt)
    layout = PipelineTopology.build(cfg, 1).layout(0)
    runner = StageRunner(cfg, EngineConfig(str(tiny_ckpt)), layout, torch.bfloat16, 64, progress=False)
    by_format = runner.memory.weights_by_format
    stored = Counter()
    for t in runner.model.state_dict().values():
        stored[{torch.bfloat16: "bf16", torch.float32: "fp32", torch.int64: "int64"}[t.dtype]] += t.nbytes
    assert by_format == dict(stored) and set(by_format) == {"bf16", "fp32", "int64"}
    assert runner.memory.weights_bytes == sum(stored.values())


@pytest.mark.parametrize("experts", ["fp4", "fp8"])
def test_a_quantized_model_counts_its_stored_bytes_by_format_and_allocates_exactly_that(tiny_ckpt, experts):
    cfg = dataclasses.replace(ModelConfig.from_hf(tiny_ckpt), quantization=Quantization(experts))
    before = live_storages()
    model = build_model(cfg, 128, torch.bfloat16, with_mtp=True)
    ledger = MemoryLedger(0)
    model.register_tables(ledger)
    caches = model.allocate_cache(CacheGeometry.build(cfg, 2, 128, 1), model.act_dtype, ledger)
    by_format = weights_by_format(model)
    # Everything alive is the weights (scale buffers included) plus the ledger: no scale is a ledger buffer.
    assert new_bytes(before) == sum(by_format.values()) + ledger.memory.buffers_bytes
    assert not any(e.name.endswith("scale") and e.dtype == "uint8" for e in ledger.memory.buffers)
    # Each format is the bytes of its tensors: fp8 = the e4m3 linears and their UE8M0 scales (and FP8 experts),
    # fp4 = the packed experts and their scales; the rest by dtype.
    want = Counter()
    for m in model.modules():
        own = [t for key, t in m.state_dict(keep_vars=True).items() if "." not in key]  # its own, persistent
        if isinstance(m, Experts):
            want[experts] += sum(t.nbytes for t in (m.w13, m.w2, m.w13_scale, m.w2_scale))
        elif isinstance(m, Linear) and m.quant == "fp8":
            assert m.weight.dtype == torch.float8_e4m3fn and m.scale.dtype == torch.uint8
            want["fp8"] += m.weight.nbytes + m.scale.nbytes
        else:
            for t in own:
                want[{torch.bfloat16: "bf16", torch.float32: "fp32", torch.int64: "int64"}[t.dtype]] += t.nbytes
    assert by_format == dict(want)
    assert sum(by_format.values()) == sum(t.nbytes for t in model.state_dict().values())
    # Against the same experts in bf16: FP4 is 4.25 bits a weight (a quarter, plus a scale byte per 32 weights),
    # FP8 a half (plus a scale byte per 128x128 block).
    plain = build_model(dataclasses.replace(cfg, quantization=None), 128, torch.bfloat16, with_mtp=True, device="meta")
    plain_experts = sum(t.numel() * t.element_size() for n, t in plain.state_dict().items() if ".experts." in n)
    stored = sum(t.nbytes for m in model.modules() if isinstance(m, Experts) for t in m.state_dict().values())
    if experts == "fp4":
        assert stored == by_format["fp4"] and stored / plain_experts == pytest.approx(0.5 / 2 + 1 / 32 / 2)
    else:
        assert 0.5 < stored / plain_experts < 0.51
    del caches


def stored_bytes(stages: list[dict]) -> int:
    return sum(s["weights_bytes"] for s in stages)


def test_the_flash_plan_stores_what_the_published_checkpoint_holds(capsys):
    # The published files: 159.6 GB (decimal) in 46 shards, the MTP layer included. Like with like: the whole
    # model on one stage with the MTP layer (MTP on). Split over two stages, the last also holds a copy of the
    # embedding (the MTP layer embeds its input tokens; the files hold the table once).
    whole = memory_json(capsys, "--plan", "--config", "deepseek-v4-flash", "--speculative-config", MTP1)
    assert stored_bytes(whole) == pytest.approx(159.6e9, rel=0.01)
    formats = whole[0]["weights_by_format"]
    assert set(formats) == {"fp4", "fp8", "bf16", "fp32", "int64"}
    # Routed experts: 43 layers and the MTP layer, 256 experts x 3 matrices of 2048 x 4096, 4.25 bits a weight.
    assert formats["fp4"] == 44 * 256 * 3 * 2048 * 4096 * 17 // 32
    split = memory_json(capsys, "--plan", "--config", "deepseek-v4-flash", "-pp", "2", "--speculative-config", MTP1)
    assert stored_bytes(split) == stored_bytes(whole) + 129280 * 4096 * 2
    # Without MTP the last stage builds no MTP layer: less than the files hold.
    assert stored_bytes(memory_json(capsys, "--plan", "--config", "deepseek-v4-flash")) < stored_bytes(whole)


def test_the_plan_dtype_is_the_unquantized_weights_dtype(capsys):
    bf16 = memory_json(capsys, "--plan", "--config", "deepseek-v4-flash")[0]["weights_by_format"]
    fp32 = memory_json(capsys, "--plan", "--config", "deepseek-v4-flash", "--dtype", "float32")[0]
    assert fp32["weights_by_format"]["fp4"] == bf16["fp4"] and fp32["weights_by_format"]["fp8"] == bf16["fp8"]
    assert "bf16" not in fp32["weights_by_format"]


def test_the_memory_table_shows_weights_by_format(capsys):
    assert main(["--log-level", "warning", "memory", "--plan", "--config", "deepseek-v4-pro", "-pp", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("weights by format: fp4 ") == 2 and "all stages: weights" in out and " GB" in out


# --- speculative config -------------------------------------------------------------------------------
def test_speculative_methods_and_what_they_need():
    mtp = SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 1}')
    ngram = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    draft = SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2, "model": "d"})
    assert (mtp.use_eagle(), mtp.uses_draft_model(), mtp.needs_target_hidden_states()) == (True, False, True)
    assert (ngram.use_eagle(), ngram.uses_draft_model(), ngram.needs_target_hidden_states()) == (False, False, False)
    assert (draft.use_eagle(), draft.uses_draft_model(), draft.needs_target_hidden_states()) == (False, True, False)
    assert ngram.prompt_lookup_min == 1


@pytest.mark.parametrize(
    "value, match",
    [
        ({"method": "medusa", "num_speculative_tokens": 1}, "method must be one of"),
        ({"num_speculative_tokens": 1}, r"speculative_config.method is required"),
        ({"method": "mtp"}, r"speculative_config.num_speculative_tokens is required"),
        ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "mtp", "num_speculative_tokens": 1, "k": 2}, r"unknown field\(s\) \['k'\]"),
        ({"method": "draft_model", "num_speculative_tokens": 1}, r"speculative_config.model .* is required"),
        ({"method": "ngram", "num_speculative_tokens": 1}, "prompt_lookup_max is required"),
        (
            {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            r"prompt_lookup_min \(4\) is larger than prompt_lookup_max \(2\)",
        ),
        ({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 2}, "only for ngram"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_speculative_configs_name_the_field(tiny_ckpt, value, match):
    with pytest.raises(ConfigError, match=match):
        LLM(str(tiny_ckpt), speculative_config=value, load_progress=False)


def test_mtp_on_a_checkpoint_without_mtp_weights_is_refused(make_ckpt):
    no_mtp = make_ckpt("tiny-no-mtp", num_nextn_predict_layers=0)
    with pytest.raises(ConfigError, match="needs the checkpoint's MTP layer"):
        LLM(str(no_mtp), speculative_config={"method": "mtp", "num_speculative_tokens": 1}, load_progress=False)


# --- leanserve memory -----------------------------------------------------------------------------------
def memory_json(capsys, *args: str) -> list[dict]:
    assert main(["--log-level", "warning", "memory", *args, "--output", "json"]) == 0
    return json.loads(capsys.readouterr().out)["stages"]


def target_hidden_bytes(stages: list[dict]) -> list[int | None]:
    return [next((b["bytes"] for b in s["buffers"] if b["name"] == "target_hidden_states"), None) for s in stages]


MTP1 = '{"method": "mtp", "num_speculative_tokens": 1}'


def test_plan_shows_the_seeds_448_mib_only_where_mtp_needs_it(capsys):
    args = ["--plan", "--config", "deepseek-v4-pro", "-pp", "4", "--max-num-batched-tokens", "8192"]
    with_mtp = memory_json(capsys, *args, "--speculative-config", MTP1)
    assert target_hidden_bytes(with_mtp) == [None, None, None, 448 * MIB]
    entry = next(b for b in with_mtp[3]["buffers"] if b["name"] == "target_hidden_states")
    assert entry["shape"] == [8192, 28672] and entry["dtype"] == "bfloat16" and entry["feature"] == SPEC_MTP
    assert target_hidden_bytes(memory_json(capsys, *args)) == [None] * 4
    ngram = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    assert target_hidden_bytes(memory_json(capsys, *args, "--speculative-config", ngram)) == [None] * 4
    # Layers split 16/15/15/15; the last stage also carries the head and (with MTP on) the MTP layer.
    assert all(s["weights_bytes"] > 0 for s in with_mtp)


def test_plan_for_flash_is_256_mib_and_pp1_puts_it_on_the_only_stage(capsys):
    stages = memory_json(
        capsys,
        "--plan",
        "--config",
        "deepseek-v4-flash",
        "--max-num-batched-tokens",
        "8192",
        "--speculative-config",
        MTP1,
    )
    assert target_hidden_bytes(stages) == [256 * MIB]


def test_memory_table_of_a_running_pipeline(tiny_ckpt, capsys):
    assert (
        main(["--log-level", "warning", "memory", "--model", str(tiny_ckpt), "-pp", "2", "--max-model-len", "64"]) == 0
    )
    out = capsys.readouterr().out
    assert "stage 0: weights" in out and "stage 1: weights" in out
    assert "layers.3.comp_rows" in out and "pp_recv_streams" in out and "target_hidden_states" not in out
    assert "paged cache: " in out and "bytes per token, every stage: " in out and "requests of 64 tokens" in out


def test_memory_rejects_bad_input(tiny_ckpt, capsys):
    assert main(["memory", "--plan", "--config", "deepseek-v4-nano"]) == 2
    assert "neither a shipped config" in capsys.readouterr().err
    assert main(["memory", "--plan", "--config", "deepseek-v4-pro", "-pp", "62"]) == 2
    assert "larger than the model's 61 layers" in capsys.readouterr().err
    assert main(["memory", "--config", "deepseek-v4-pro"]) == 2
    assert "--config needs --plan" in capsys.readouterr().err


# --- benchmarks ---------------------------------------------------------------------------------------
def test_bench_copy_reports_rows_per_token_count(capsys):
    args = ["bench", "copy", "--tokens", "1,8,32", "--hc-dim", "256", "--repeats", "3", "--output", "json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in rows] == [1, 8, 32]
    assert [r["bytes"] for r in rows] == [t * 256 * 2 for t in (1, 8, 32)]
    assert all(r["latency_us"] > 0 and r["gbps"] > 0 for r in rows)


def test_bench_step_compares_buffer_on_and_off(tiny_ckpt, capsys):
    args = ["bench", "step", "--model", str(tiny_ckpt), "--batch-sizes", "1,2", "--repeats", "3", "--output", "json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["batch_size"] for r in rows] == [1, 2]
    assert all(r["on_us"] > 0 and r["off_us"] > 0 and r["buffer_bytes"] == 8192 * 4 * 64 * 4 for r in rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_memory_allocated_is_the_weights_plus_the_ledger(tiny_ckpt):  # pragma: no cover - needs a GPU
    def block(n: int) -> int:  # the caching allocator hands out 512-byte multiples
        return -(-n // 512) * 512

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    llm = LLM(str(tiny_ckpt), max_model_len=128, max_num_seqs=2, device="cuda", load_progress=False)
    torch.cuda.synchronize()
    runner = llm.engine.executor.runner
    weights = sum(block(t.numel() * t.element_size()) for t in runner.model.state_dict().values())
    ledger = sum(block(e.bytes) for e in llm.memory_ledger()[0].buffers)
    assert torch.cuda.memory_allocated() - before == weights + ledger


def _mapping_of(ptr: int) -> dict[str, str | tuple[int, int]]:
    """The /proc/self/smaps fields of the mapping holding address ptr, and its address range ("range": (lo, hi))."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line.split() else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= ptr < hi
            if inside:
                fields["range"] = (lo, hi)
        elif inside and ":" in head:
            fields[head[:-1]] = line.split(":", 1)[1].strip()
    return fields


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
    reason="no transparent huge pages on this kernel",
)
def test_large_weights_sit_in_memory_advised_for_huge_pages():
    # build_model gives each CPU tensor of at least two huge pages memory of its own advised for them (madvise), a
    # smaller one torch's allocator; both exactly their bytes.
    from leanserve.make_random import preset_config

    model = build_model(preset_config("tiny", vocab_size=32768), 64)
    big, small = model.embed.weight, model.layers["0"].attn.wq_a.weight
    assert big.nbytes >= 4 << 20 > small.nbytes
    assert _mapping_of(big.data_ptr()).get("THPeligible") == "1"
    assert "hg" in _mapping_of(big.data_ptr())["VmFlags"].split()  # (advised: MADV_HUGEPAGE)
    # (the small one is torch's allocator's, outside the loader's advised memory; which mapping the allocator uses,
    # and whether an earlier test's numpy array had that heap memory advised, is the process's history)
    assert _mapping_of(small.data_ptr())["range"] != _mapping_of(big.data_ptr())["range"]
    assert big.untyped_storage().nbytes() == big.nbytes
