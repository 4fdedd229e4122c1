"""Pipeline parallelism: PP=N gives PP=1's tokens and logprobs, each stage holds only its own part, stages
that die stop the engine with an error naming them and leave no processes behind, and torchrun works."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import FIVE_LAYERS
from leanserve import LLM, SamplingParams
from leanserve.engine.costs import stage_costs
from leanserve.engine.pipeline import StageFailure
from leanserve.engine.topology import PipelineTopology, balanced
from leanserve.make_random import preset_config
from leanserve.model.config import ConfigError, ModelConfig

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "dsv4-stdlib-12l"

MAX_LEN = 160
# Lengths that cross the sliding window (16), CSA (4) and HCA (16) boundaries of the tiny preset, with
# max_num_batched_tokens 48 so the long ones are prefilled in chunks over several steps.
PROMPT_LENGTHS = (3, 17, 40, 75)


def child_pids() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                pids.add(int(entry.name))
    return pids


def engine(ckpt: Path, **kwargs) -> LLM:
    kwargs.setdefault("max_num_seqs", 4)
    return LLM(str(ckpt), max_model_len=MAX_LEN, max_num_batched_tokens=48, load_progress=False, **kwargs)


@pytest.fixture(scope="module")
def prompts(ids_of) -> list[dict]:
    return [{"prompt_token_ids": ids_of(n, seed=100 + n)} for n in PROMPT_LENGTHS]


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=14, ignore_eos=True, logprobs=2),
]


def run(llm: LLM, prompts: list[dict], order: list[int] | None = None) -> list:
    """Prompt i gets PARAMS[i % 2] (greedy or seeded sampling), whatever the order they are submitted in."""
    order = order if order is not None else list(range(len(prompts)))
    results = llm.generate([prompts[i] for i in order], [PARAMS[i % 2] for i in order])
    return [r.outputs[0] for r in results]


@pytest.fixture(scope="module")
def reference(ckpt5, prompts) -> list:
    with engine(ckpt5) as llm:
        return run(llm, prompts)


def assert_same(reference: list, got: list) -> None:
    for ref, out in zip(reference, got, strict=True):
        assert out.token_ids == ref.token_ids
        for want, have in zip(ref.logprobs, out.logprobs, strict=True):
            assert want.keys() == have.keys()
            for t in want:
                assert abs(want[t].logprob - have[t].logprob) <= 1e-5


# --- the split ----------------------------------------------------------------------------------------
def test_the_default_split_balances_what_a_decode_token_reads_on_each_stage():
    # The shipped model's head is read by a decode token as much as 2.4 of its layers: the last stage, which
    # holds it, takes fewer layers, and no other split has a smaller largest stage.
    cfg = ModelConfig.from_hf(SHIPPED)
    layers, tail = stage_costs(cfg)
    assert 2 < tail / max(layers) < 3
    for stages in (2, 3, 4):
        counts = PipelineTopology.build(cfg, stages).layer_counts
        assert sum(counts) == 12 and min(counts) >= 1

        def largest(split):
            ends = list(itertools.accumulate(split, initial=0))
            return max(sum(layers[a:b]) + (tail if b == 12 else 0) for a, b in itertools.pairwise(ends))

        splits = [c for c in itertools.product(range(1, 12), repeat=stages) if sum(c) == 12]
        assert largest(counts) == min(largest(c) for c in splits)
    assert PipelineTopology.build(cfg, 2).layer_counts == (7, 5)
    # Equal costs and nothing besides: the even split, the remainder on the earliest stages.
    assert balanced([1] * 5, 0, 2) == (3, 2) and balanced([1] * 7, 0, 3) == (3, 2, 2)
    cfg = preset_config("tiny", **FIVE_LAYERS)
    assert PipelineTopology.build(cfg, 2).layer_counts == (3, 2)
    assert PipelineTopology.build(cfg, 3).layer_counts == (2, 2, 1)
    assert PipelineTopology.build(cfg, 5).layer_counts == (1, 1, 1, 1, 1)
    layouts = [PipelineTopology.build(cfg, 3).layout(i) for i in range(3)]
    assert [(s.first_layer, s.end_layer, s.is_first, s.is_last) for s in layouts] == [
        (0, 2, True, False),
        (2, 4, False, False),
        (4, 5, False, True),
    ]
    assert PipelineTopology.build(cfg, 2, (1, 4)).layer_counts == (1, 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be a positive integer"),
        ({"pipeline_parallel_size": -2}, "pipeline_parallel_size must be a positive integer"),
        ({"pipeline_parallel_size": 6}, r"pipeline_parallel_size \(6\) is larger than the model's 5 layers"),
        ({"pipeline_parallel_size": 2, "pipeline_layer_counts": [2, 2]}, "sums to 4, but the model has 5 layers"),
        ({"pipeline_parallel_size": 2, "pipeline_layer_counts": [5]}, "has 1 entries but pipeline_parallel_size is 2"),
        ({"pipeline_parallel_size": 2, "pipeline_layer_counts": [5, 0]}, "must be positive integers"),
    ],
)
def test_a_bad_split_fails_before_any_process_starts(ckpt5, kwargs, match):
    before = child_pids()
    with pytest.raises(ConfigError, match=match):
        engine(ckpt5, **kwargs)
    assert child_pids() == before  # no stage process was started


# --- PP=N equals PP=1 ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipelines(ckpt5):
    """PP=2 (3+2 layers) and PP=3 (2+2+1), started once for the tests below."""
    engines = {2: engine(ckpt5, pipeline_parallel_size=2), 3: engine(ckpt5, pipeline_parallel_size=3)}
    yield engines
    for llm in engines.values():
        llm.shutdown()


@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_gives_the_tokens_and_logprobs_of_one_stage(pipelines, prompts, reference, pp):
    llm = pipelines[pp]
    assert_same(reference, run(llm, prompts))
    # A second batch on the same engine: slots are reused, caches stay consistent across stages.
    assert_same(reference[::-1], run(llm, prompts, order=[3, 2, 1, 0]))


def test_two_pipelines_run_side_by_side_in_one_process(pipelines, prompts, reference):
    # Each engine has its own store on its own free port and its own process group: no collision.
    a, b = pipelines[2], pipelines[3]
    assert {p.pid for p in a.engine.executor.procs.values()}.isdisjoint(p.pid for p in b.engine.executor.procs.values())
    assert_same(reference[:2], run(a, prompts[:2]))
    assert_same(reference[:2], run(b, prompts[:2]))


def test_an_explicit_layer_split(ckpt5, prompts, reference):
    with engine(ckpt5, pipeline_parallel_size=2, pipeline_layer_counts=[1, 4]) as llm:
        assert [(i.layout.first_layer, i.layout.end_layer) for i in llm.engine.executor.infos] == [(0, 1), (1, 5)]
        assert_same(reference, run(llm, prompts))


def test_pipeline_on_an_even_split(tiny_ckpt, ids_of):
    prompts = [{"prompt_token_ids": ids_of(n, seed=n)} for n in (9, 33)]
    with engine(tiny_ckpt) as llm:
        want = run(llm, prompts)
    with engine(tiny_ckpt, pipeline_parallel_size=2) as llm:
        assert_same(want, run(llm, prompts))


def test_each_stage_holds_only_its_own_parameters(ckpt5, pipelines):
    with engine(ckpt5) as whole:
        whole_names = set(whole.engine.executor.infos[0].param_names)
        whole_bytes = whole.memory_ledger()[0].weights_bytes
    llm = pipelines[3]
    infos = llm.engine.executor.infos
    layers = [{int(n.split(".")[1]) for n in i.param_names if n.startswith("layers.")} for i in infos]
    assert layers == [{0, 1}, {2, 3}, {4}]
    tops = [{n for n in i.param_names if not n.startswith(("layers.", "mtp."))} for i in infos]
    assert tops[0] == {"embed.weight"}
    assert tops[1] == set()
    assert tops[2] == {"norm.weight", "head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}
    assert not any(n.startswith("mtp.") for i in infos for n in i.param_names)  # no speculation: no MTP
    # Together they are the whole model, each tensor on exactly one stage.
    assert sorted(n for i in infos for n in i.param_names) == sorted(whole_names)
    assert sum(m.weights_bytes for m in llm.memory_ledger()) == whole_bytes


# --- failures -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp, victim", [(2, 1), (3, 1)])
def test_a_stage_that_dies_stops_the_engine_naming_it(ckpt5, prompts, pp, victim):
    llm = engine(ckpt5, pipeline_parallel_size=pp)
    procs = llm.engine.executor.procs
    os.kill(procs[victim].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(StageFailure, match=f"pipeline stage {victim} died \\(killed by signal 9\\)"):
        llm.generate(prompts[:2], SamplingParams(max_tokens=4))
    assert time.monotonic() - start < 30
    assert all(p.poll() is not None for p in procs.values())  # every stage process is gone
    assert not (child_pids() & {p.pid for p in procs.values()})
    with pytest.raises(StageFailure, match=f"stage {victim}"):  # and the engine says so from then on
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))


def test_stages_exit_when_the_driver_process_dies(ckpt5, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys, time
        from leanserve import LLM
        llm = LLM({str(ckpt5)!r}, max_model_len=64, max_num_seqs=2, pipeline_parallel_size=2, load_progress=False)
        print(" ".join(str(p.pid) for p in llm.engine.executor.procs.values()), flush=True)
        time.sleep(600)
        """)
    )
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        stage_pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(stage_pids) == 1
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in stage_pids):
            time.sleep(0.1)
        assert not any(_alive(p) for p in stage_pids)
    finally:
        driver.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_stage_that_cannot_load_fails_start_up_naming_it(ckpt5, tmp_path):
    # The checkpoint lacks a tensor of layer 4, which only the last stage loads.
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(ckpt5, broken)
    tensors = load_file(broken / "model.safetensors")
    victim = next(n for n in tensors if ".layers.4." in n)
    del tensors[victim]
    save_file(tensors, broken / "model.safetensors")
    before = child_pids()
    with pytest.raises(
        StageFailure,
        match=f"pipeline stage 1 failed to start: CheckpointError: Missing tensor.*{victim.removeprefix('model.')}",
    ):
        engine(broken, pipeline_parallel_size=2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and child_pids() - before:
        time.sleep(0.1)
    assert child_pids() - before == set()


# --- torchrun ---------------------------------------------------------------------------------------
def test_torchrun_runs_the_same_pipeline_on_loopback(ckpt5, prompts, reference):
    ids = prompts[2]["prompt_token_ids"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "leanserve.cli", "--log-level", "warning", "generate", "--model", str(ckpt5)]
    cmd += ["--prompt-token-ids", ",".join(map(str, ids)), "--max-tokens", "14", "--ignore-eos", "--logprobs", "3"]
    cmd += ["-pp", "2", "--max-model-len", str(MAX_LEN), "--output", "json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["token_ids"] == reference[2].token_ids  # greedy (even-indexed prompts are greedy)
    for want, have in zip(reference[2].logprobs, result["logprobs"], strict=True):
        for t, lp in want.items():
            assert abs(have[str(t)] - lp.logprob) <= 1e-5
