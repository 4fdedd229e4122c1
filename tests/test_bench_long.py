"""`leanserve bench long`: its arithmetic (rows, the fit to 1M tokens, the targets), its option checks, and one
end-to-end run on a tiny checkpoint."""

from __future__ import annotations

import argparse
import json

import pytest

from leanserve import cli
from leanserve.bench import long
from leanserve.bench.long import LongRow, Measured, check, length_list, linear_fit, on_paper, rows_of, targets


def _measured(tokens: int, ms_per_token: float, peak_gib: float, buffers_mib: float, step_s: float) -> Measured:
    parts = {"indexer": 0.1 * ms_per_token * tokens / 1e3, "moe": 0.5 * ms_per_token * tokens / 1e3}
    return Measured(tokens, ms_per_token * tokens / 1e3, parts, int(peak_gib * 2**30), True,
                    int(buffers_mib * 2**20 / 2), int(buffers_mib * 2**20), [step_s, step_s, 10 * step_s], "cpu")  # fmt: skip


def test_lengths_take_k_and_m_suffixes():
    assert length_list("4K, 16k,1M,512") == [4096, 16384, 1 << 20, 512]
    with pytest.raises(argparse.ArgumentTypeError):
        length_list("4G")


def test_rows_are_per_token_and_against_the_first_length():
    rows = rows_of([_measured(4096, 10.0, 2.0, 64, 0.2), _measured(16384, 12.0, 2.5, 576, 0.25)])
    first, second = rows
    assert (first.ms_per_token, first.vs_first, first.rest_vs_first, first.decode_vs_first) == (10.0, 1.0, 1.0, 1.0)
    assert second.ms_per_token == 12.0 and second.vs_first == 1.2
    # the parts per prompt token, "other" the rest of the prefill
    assert (second.indexer_ms, second.moe_ms, second.attention_ms) == (1.2, 6.0, 0.0)
    assert second.other_ms == pytest.approx(12.0 * 0.4, abs=1e-3)
    # peak less the ledger's buffers: (2.5 GiB - 576 MiB) / (2 GiB - 64 MiB)
    assert second.rest_vs_first == round((2.5 * 1024 - 576) / (2 * 1024 - 64), 3)
    assert second.cache_mib == 288.0 and second.buffers_mib == 576.0
    # decode: the median step (the slow third step ignored)
    assert (first.decode_tok_s, second.decode_tok_s, second.decode_vs_first) == (5.0, 4.0, 0.8)


def test_the_fit_is_least_squares_and_extrapolates_to_a_million_tokens():
    assert linear_fit([1, 2, 3], [3, 5, 7]) == pytest.approx((1, 2))
    assert linear_fit([1, 2, 3], [1, 3, 2]) == pytest.approx((1, 0.5))  # (not through every point)
    assert linear_fit([4096], [7.0]) == (7.0, 0.0)  # one length: flat
    # ms/token = 10 + 1e-4 * length; decode step = 0.2 s + 1e-6 s per token of depth
    rows = rows_of([_measured(n, 10 + 1e-4 * n, 2.0, 64, 0.2 + 1e-6 * n) for n in (4096, 16384, 65536)])
    p = on_paper(rows)
    per_token = 10 + 1e-4 * (1 << 20)
    assert p.prefill_ms_per_token == pytest.approx(per_token, rel=1e-3)
    assert p.prefill_s == pytest.approx(per_token * (1 << 20) / 1e3, rel=1e-3)
    assert p.decode_tok_s == pytest.approx(1 / (0.2 + 1e-6 * (1 << 20)), rel=1e-3)
    assert p.flat == ()
    # a fit that falls with length (noise: the model's cost does not) is taken as flat, not run down to zero
    falling = on_paper(rows_of([_measured(1024, 10.0, 2.0, 64, 0.2), _measured(4096, 5.0, 2.0, 64, 0.1)]))
    assert falling.flat == ("prefill", "decode")
    assert falling.prefill_ms_per_token == 7.5 and falling.decode_tok_s == pytest.approx(1 / 0.15)


def _row(**ratios) -> LongRow:
    base = dict.fromkeys(LongRow.__dataclass_fields__, 0.0) | {"tokens": 1}
    return LongRow(**(base | ratios))


def test_the_targets_are_the_issues_bounds_on_the_longest_length():
    first = _row(tokens=4096, vs_first=1.0, rest_vs_first=1.0, decode_vs_first=1.0)
    good = _row(tokens=131072, vs_first=2.0, rest_vs_first=1.1, decode_vs_first=0.7)
    bad = _row(tokens=131072, vs_first=2.01, rest_vs_first=1.101, decode_vs_first=0.69)
    assert [t.met for t in targets([first, good])] == [True, True, True]
    assert [t.met for t in targets([first, bad])] == [False, False, False]
    assert [t.met for t in targets([first])] == [None, None, None]  # one length: nothing to compare
    assert "NOT met" in long.target_lines([first, bad])[0] and "131072 vs 4096" in long.target_lines([first, bad])[0]


@pytest.mark.parametrize(
    "options, message",
    [
        (["--lengths", "0,4096"], "--lengths must be positive"),
        (["--lengths", "1M"], "exceeds the model's max_position_embeddings (1048576)"),
        (["--decode-steps", "0"], "--decode-steps and --chunk must be positive"),
        (["--chunk", "0"], "--decode-steps and --chunk must be positive"),
        (["--experts", "4"], "--experts must be at least the top-k (6)"),
        (["--layers", "0"], "--layers must be positive"),
        (["--hidden", "100"], "--hidden must be a positive multiple of 64"),
    ],
)
def test_bad_options_fail_in_one_sentence_before_any_work(tmp_path, capsys, options, message):
    model_dir = tmp_path / "model"
    assert cli.main(["bench", "long", "--dir", str(model_dir), *options]) == 2
    assert message in capsys.readouterr().err
    assert not model_dir.exists()  # (no checkpoint written)


def test_check_counts_the_decode_tokens_against_the_positions():
    check([1000], 23, 2048, 1024)
    with pytest.raises(ValueError, match="plus 25 decode tokens"):
        check([1000], 24, 2048, 1024)


def test_a_tiny_run_has_every_field_and_its_parts_within_the_prefill(make_ckpt, capsys):
    model = make_ckpt("long-tiny")  # max_position_embeddings 1024, window 16, CSA rate 4, top-4
    args = ["--log-level", "warning", "bench", "long", "--model", str(model), "--lengths", "96,300"]
    assert cli.main([*args, "--decode-steps", "3", "--chunk", "128", "--same-process", "--output", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert [r["tokens"] for r in rows] == [96, 300]
    assert set(rows[0]) == set(LongRow.__dataclass_fields__)
    for r in rows:
        parts = sum(r[f"{p}_ms"] for p in long.PARTS)
        assert r["indexer_ms"] + r["attention_ms"] + r["moe_ms"] + r["linears_ms"] > 0
        assert parts <= r["ms_per_token"] + 1e-3  # (the parts never overlap: rounding only)
        assert parts + r["other_ms"] == pytest.approx(r["ms_per_token"], abs=5e-3)
        assert r["peak_gib"] > 0 and r["buffers_mib"] >= r["cache_mib"] > 0 and r["decode_tok_s"] > 0
    assert rows[0]["vs_first"] == 1.0 and rows[1]["vs_first"] > 0
    assert out["rows"][1]["indexer_ms"] > 0  # (300 tokens: past the top-4 of 75 compressed rows)
    assert out["on_paper"]["tokens"] == 1 << 20 and len(out["targets"]) == 3
