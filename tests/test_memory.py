"""The memory ledger: it lists every persistent tensor the engine allocates besides weights (checked against
the tensors really alive), and `target_hidden_states` exists only on the last stage with MTP on."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

import pytest
import torch

from leanserve import LLM, SamplingParams
from leanserve.cli import main
from leanserve.config import ConfigError, EngineConfig, ModelConfig, SpeculativeConfig
from leanserve.engine.runner import StageRunner
from leanserve.engine.topology import PipelineTopology
from leanserve.memory import PIPELINE, SPEC_MTP

MIB = 2**20
SPECS = {
    "none": None,
    "mtp": {"method": "mtp", "num_speculative_tokens": 2},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 2, "model": "DRAFT"},
}


def live_storages() -> dict[int, int]:
    """data_ptr -> bytes of every tensor storage alive in this process (views share one storage)."""
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
