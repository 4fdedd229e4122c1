"""`leanserve bench formats`' accounting (no timing): the weight bytes a decode token reads, and the vocabulary
that gives the head a chosen share of them."""

from __future__ import annotations

import dataclasses

import pytest

from leanserve.bench.formats import bench_config, head_share, matched_vocab, step_cost, token_bytes
from leanserve.bench.host import share_of_reads_then
from leanserve.make_random import preset_config


def test_token_bytes_counts_top_k_experts_the_head_and_one_embedding_row():
    cfg = preset_config("tiny")  # hidden 64, experts of 32, 8 experts top-2, 4 layers (one hash-routed), vocab 512
    h, inter, e, k, layers = 64, 32, 8, 2, 4
    plain = token_bytes(cfg, published=False)
    assert plain.experts == layers * e * (2 * inter * h + h * inter) * 2 * k // e  # bf16
    assert plain.head == 512 * h * 2
    assert plain.embed_row == h * 2 + k * 8  # an embedding row and the hash layer's tid2eid row (int64)
    published = token_bytes(cfg, published=True)
    fp4 = (2 * inter * h // 2 + 2 * inter * h // 32) + (h * inter // 2 + h * inter // 32)  # packed values + scales
    assert published.experts == layers * e * fp4 * k // e
    assert published.head == plain.head  # (bf16 in both formats)
    assert published.dense < plain.dense  # FP8 linears


def test_a_steps_bytes_count_the_experts_its_tokens_reach_and_its_arithmetic_every_token():
    cfg = preset_config("tiny")  # 8 experts, top-2
    for published in (False, True):
        b = token_bytes(cfg, published)
        one, many = step_cost(cfg, published, 1), step_cost(cfg, published, 1000)
        assert one.mb * 1e6 == pytest.approx(b.total)  # batch 1: a token's bytes
        # every expert read once, the embedding row per token
        assert many.mb * 1e6 == pytest.approx(b.dense + b.head + 1000 * b.embed_row + b.experts * 8 / 2)
        assert many.gflop == pytest.approx(1000 * one.gflop)  # the same arithmetic per token in either format
    assert step_cost(cfg, True, 1).gflop == step_cost(cfg, False, 1).gflop


def test_each_step_is_set_beside_the_reads_just_before_and_after_it():
    # 500 MB in 20 ms is 25 GB/s: half of a 50 GB/s read, whatever the reads of other moments were
    steps = [(0.020, 40.0, 60.0), (0.010, 60.0, 40.0), (0.025, 20.0, 20.0)]  # 0.5, 1.0 and 1.0 of their reads
    assert share_of_reads_then(500.0, steps) == pytest.approx(1.0)
    assert share_of_reads_then(500.0, steps[:1]) == pytest.approx(0.5)
    assert share_of_reads_then(500.0, [(0.020, 25.0, 75.0)]) == pytest.approx(0.5)  # (the mean of the two reads)
    with pytest.raises(ValueError, match="no steps"):
        share_of_reads_then(500.0, [])


def test_matched_vocab_gives_the_head_its_share():
    cfg = preset_config("tiny")
    vocab = matched_vocab(cfg, 0.25, multiple=8)
    assert head_share(dataclasses.replace(cfg, vocab_size=vocab)) == pytest.approx(0.25, abs=0.01)


def test_bench_config_is_flash_per_layer():
    cfg = bench_config(layers=2, experts=16, vocab_size=1024)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank) == (4096, 64, 512, 1024)
    assert (cfg.o_groups, cfg.o_lora_rank, cfg.index_n_heads, cfg.index_head_dim) == (8, 1024, 64, 128)
    assert (cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok) == (2048, 16, 6)
    assert cfg.quantization is None and not cfg.has_mtp and cfg.vocab_size == 1024


def test_the_kernel_profile_counts_every_decode_call_and_its_weight_bytes():
    """`bench formats --profile`'s accounting: a 4-layer model decoding one token a step calls the MoE 4 times a
    step, the head once, and each call's bytes are its weights' (the MoE's: router, top-k experts, shared one)."""
    from pathlib import Path

    from leanserve import LLM, SamplingParams
    from leanserve.bench.profile import kernel_profile, moe_bytes, profile_rows
    from leanserve.model.backends.cpu import decode

    model = str(Path(__file__).resolve().parent.parent / "models" / "dsv4-stdlib-8m")
    llm = LLM(model, max_model_len=64, max_num_seqs=1, load_progress=False, enable_prefix_caching=False)
    try:
        steps = 5  # a one-token prompt: every step is a decode-path step of one token
        with kernel_profile() as totals:
            llm.generate([{"prompt_token_ids": [7]}], SamplingParams(max_tokens=steps, ignore_eos=True))
        assert decode.moe.__name__ == "moe"  # (the profile put every function back)
        model, cfg = llm.engine.executor.runner.model, llm.engine.model_config
        moe = totals["moe (router, experts, shared expert)"]
        assert moe[0] == cfg.num_hidden_layers * steps
        assert moe[2] == steps * sum(moe_bytes(block.ffn.weights()) for block in model.layers.values())
        head = [v for k, v in totals.items() if k.startswith("linear") and k.endswith(f"-> {cfg.vocab_size}]")]
        assert len(head) == 1 and head[0][0] == steps
        assert head[0][2] == steps * cfg.vocab_size * cfg.hidden_size * model.head.weight.element_size()
        for once in (
            "step metadata (build_forward_batch)",
            "hc_head (the head's mix and norm)",
            "sampling (logits to tokens)",
        ):
            assert totals[once][0] == steps, once  # (one a step, outside the blocks)
        rows = profile_rows(totals, steps, 1.0)
        assert rows[-1].kernel == "rest of the step" and rows[0].ms >= rows[1].ms
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fp8_inputs", ["float32", "bfloat16"])
def test_the_kernel_profile_counts_fp8_linears_bytes(tmp_path, fp8_inputs):
    """A published model's FP8 linears (their calls carry the inputs flag too): each profiled linear's bytes are
    its weights' values and scales."""
    from leanserve import LLM, SamplingParams
    from leanserve.bench.host import weight_bytes
    from leanserve.bench.profile import kernel_profile
    from leanserve.make_random import make_random

    path = make_random(tmp_path, "tiny", 1, format="published")
    llm = LLM(str(path), max_model_len=64, max_num_seqs=1, load_progress=False, fp8_inputs=fp8_inputs)
    try:
        with kernel_profile() as totals:
            llm.generate([{"prompt_token_ids": [7]}], SamplingParams(max_tokens=3, ignore_eos=True))
        attn = llm.engine.executor.runner.model.layers["0"].attn
        wq_b = totals[f"linear fp8 [{attn.wq_b.in_features} -> {attn.wq_b.out_features}]"]
        # (every FP8 linear of that shape, e.g. the indexer's too, has the same bytes a call)
        assert wq_b[0] % 3 == 0 and wq_b[2] == wq_b[0] * weight_bytes(attn.wq_b.w())
        fp8 = "FP8" if fp8_inputs == "float32" else "FP8, bfloat16 inputs"
        assert wq_b[3] == {fp8: wq_b[2]}  # (its bytes by format, for the floor)
        calls, _, _, moe = totals["moe (router, experts, shared expert)"]
        assert set(moe) == {"bfloat16", fp8, "FP4"}  # (the router; the shared expert; the routed experts)
        assert moe["FP4"] == calls * _routed_fp4_bytes(llm.engine.model_config)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("argv", "row"),
    [
        ([], "published"),
        (["--fp8-inputs", "bfloat16"], "published, bf16 inputs"),
        (["--fp4-inputs", "int8"], "published, int8 inputs"),
        (["--fp4-inputs", "int8", "--fp8-inputs", "bfloat16"], "published, int8/bf16 inputs"),
        (["--fp4-inputs", "float32"], "published"),
    ],
)
def test_the_profile_names_the_row_it_times(argv, row):
    """`--profile` times the row of rounded inputs when the options ask for one, and its name says which."""
    import argparse

    from leanserve.bench.formats import add_arguments, profiled_row
    from leanserve.bench.options import inputs_of

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert profiled_row(inputs_of(parser.parse_args(argv))) == row


def test_a_batch_decodes_different_prompts_and_slot_0_the_peers():
    from leanserve.bench.common import varied_prompts

    prompts = varied_prompts(8, 16, 5888)
    assert len(prompts) == 8 and all(len(p) == 17 for p in prompts)
    assert prompts[0] == list(range(3, 19)) + [5]  # (bench/peer.py gives llama.cpp this prompt)
    assert len({tuple(p) for p in prompts}) == 8  # (the same prompt would route every token to the same experts)
    assert all(3 <= t < 5888 for p in prompts for t in p)
    assert varied_prompts(2, 16, 5888) == prompts[:2]


def test_the_decode_note_names_the_formats_a_core_decodes_slower_than_its_share_of_the_read():
    """`bench formats`' note on the in-cache decode rates: a format one core decodes slower than its share of the
    machine's read is named as bound by arithmetic; the rates are printed as measured."""
    from leanserve.bench.host import decode_note

    note = decode_note({"FP4": 14.04, "FP8": 17.5, "bfloat16": 40.0}, 16.9)
    assert "(16.9 GB/s): FP4 14.0 GB/s (0.83x), FP8 17.5 GB/s (1.04x), bfloat16 40.0 GB/s (2.37x)" in note
    assert note.endswith("bound by arithmetic here: FP4")
    assert decode_note({"FP4": 9.0, "FP8": 12.0}, 16.9).endswith("bound by arithmetic here: FP4, FP8")
    assert decode_note({"FP4": 20.0, "FP8": 30.0}, 16.9).endswith("bound by arithmetic here: none")


def test_decode_rates_time_each_weight_format_through_its_kernel():
    """One rate per weight format the decode step reads, each from a weight of IN_CACHE_BYTES (values and scales)
    that went through the kernel: finite and positive."""
    pytest.importorskip("numba")
    from leanserve.bench.host import decode_rates

    rates = decode_rates(repeats=2)
    assert list(rates) == [
        "FP4", "FP8", "bfloat16", "float32", "FP4, bfloat16 inputs", "FP8, bfloat16 inputs", "FP4, int8 inputs"
    ]  # fmt: skip
    assert all(0 < r < float("inf") for r in rates.values())


def _routed_fp4_bytes(cfg) -> int:
    """A batch-1 token's FP4 expert bytes in one MoE layer of cfg: top_k experts' gate, up and down values and
    scales (one scale byte per 32 values)."""
    weights = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return cfg.num_experts_per_tok * (weights // 2 + weights // 32)


def test_a_tokens_bytes_by_format_add_up_to_its_bytes():
    """bench/host.py's accounting: a published token's bytes split into FP4 (the routed experts), FP8 (the FP8
    linears, scales included), bfloat16 and float32, adding up to token_bytes; the bf16 checkpoint's have no FP4
    or FP8, and bfloat16 or int8 inputs rename the quantized formats."""
    from leanserve.bench.host import token_format_bytes

    cfg = preset_config("tiny")
    published, plain = token_format_bytes(cfg, True), token_format_bytes(cfg, False)
    assert sum(published.values()) == pytest.approx(token_bytes(cfg, True).total)
    assert sum(plain.values()) == pytest.approx(token_bytes(cfg, False).total)
    assert published["FP4"] == token_bytes(cfg, True).experts
    assert published["FP8"] > 0 and published["bfloat16"] > token_bytes(cfg, True).head
    assert set(plain) == {"bfloat16", "float32", "other"}  # ("other": the hash layer's tid2eid row)
    rounded = token_format_bytes(cfg, True, fp4_inputs="bfloat16", fp8_inputs="bfloat16")
    assert rounded["FP4, bfloat16 inputs"] == published["FP4"] and rounded["FP8, bfloat16 inputs"] == published["FP8"]
    assert token_format_bytes(cfg, True, fp8_inputs="bfloat16").keys() == {
        "FP4", "FP8, bfloat16 inputs", "bfloat16", "float32", "other"
    }  # fmt: skip
    assert token_format_bytes(cfg, True, fp4_inputs="int8")["FP4, int8 inputs"] == published["FP4"]


def test_the_floor_reads_each_format_at_the_slower_of_the_read_and_its_cores_decode():
    from leanserve.bench.host import floor_note, floor_seconds

    rates = {"FP4": 2.0, "bfloat16": 50.0}  # (GB/s, one core)
    # FP4: 2 cores decode 4 GB/s, slower than the 10 GB/s read; bfloat16 at the read; "other" has no rate: the read
    assert floor_seconds({"FP4": 1e9, "bfloat16": 1e9, "other": 1e9}, 10.0, 2, rates) == pytest.approx(
        1 / 4 + 1 / 10 + 1 / 10
    )
    assert floor_seconds({"FP4": 1e9}, 3.0, 2, rates) == pytest.approx(1 / 3)  # (the read slower than 4 GB/s)
    note = floor_note({"published": 0.0125}, {"published": 0.01}, 2)
    assert "2 cores' in-cache decode" in note and "published 12.50 ms (the read alone 10.00 ms: at most 80% of" in note


def test_the_profile_gives_each_kernel_its_floor_over_its_time():
    from leanserve.bench.profile import profile_rows

    totals = {"moe": [2, 0.004, 3e6, {"FP4": 2e6, "FP8": 1e6}], "mHC": [10, 0.001, 0, {}]}
    rows = profile_rows(totals, 2, 0.006, floor=lambda b: b["FP4"] / 1e9 + b["FP8"] / 2e9)  # (2.5 ms)
    assert [(r.kernel, r.of_floor) for r in rows] == [("moe", 0.62), ("mHC", None), ("rest of the step", None)]
    assert profile_rows(totals, 2, 0.006)[0].of_floor is None
