"""StageRunner.warmup compiles (or loads from numba's cache) every kernel variant a request's steps take, so
no compilation lands inside a timed step: after the engine is built, generating compiles no new signature."""

from pathlib import Path

import pytest
import torch

numba = pytest.importorskip("numba")

from leanserve import LLM, SamplingParams  # noqa: E402
from leanserve.model import batch  # noqa: E402
from leanserve.model.backends.cpu import kernels as cpu_kernels  # noqa: E402
from leanserve.model.config import CSA, ModelConfig  # noqa: E402

MODEL = Path(__file__).resolve().parent.parent / "models" / "dsv4-stdlib-12l"


def _dispatchers() -> dict[str, object]:
    """Every numba dispatcher the model's steps call: the kernels (a Threaded one's compiled kernel), the launcher
    of their threaded parts (base._run_parts) and the step metadata kernels of model/batch.py."""
    found: dict[str, object] = {}
    for module in cpu_kernels.MODULES:
        for name, obj in vars(module).items():
            if isinstance(obj, numba.core.dispatcher.Dispatcher):
                builds = {name: obj}
            elif isinstance(obj, cpu_kernels.Threaded):
                builds = {name: obj.kernel}
            else:
                continue
            for key, build in builds.items():  # (one imported into several kernel modules is one dispatcher)
                if found.setdefault(key, build) is not build:
                    found[f"{module.__name__}.{key}"] = build
    for fn in batch._short_kernels or ():
        found[f"batch.{fn.py_func.__name__}"] = fn
    return found


def _signatures(dispatchers: dict[str, object]) -> dict[str, set]:
    return {name: set(d.signatures) for name, d in dispatchers.items()}


def test_generation_after_warmup_compiles_nothing(monkeypatch):
    cfg = ModelConfig.from_hf(MODEL)
    assert CSA in cfg.layer_types and cfg.index_topk > 0  # the model has an indexer that selects
    dispatchers = _dispatchers()
    kernels = ("attend", "moe_experts", "index_scores", "index_merge", "compress_windows", "hc_pre", "linear")
    for name in (*kernels, "_run_parts"):
        assert name in dispatchers, name
    # conftest runs one thread; two here, so that steps (and the warm-up) also run kernels in threaded parts
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with LLM(model=str(MODEL), max_num_seqs=2, max_model_len=512, load_progress=False) as llm:
            warmed = _signatures(dispatchers)
            tok = llm.get_tokenizer()
            # Long enough that the CSA layers' indexer selects (more than index_topk * ratio positions) during
            # the prefill, over more than one query block, and in every decode step after it.
            long_prompt = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(20))
            assert len(tok.encode(long_prompt)) > max(
                2 * batch.PREFILL_BLOCK, (cfg.index_topk + 1) * cfg.compress_rate_csa
            )
            selected = []  # the query blocks of each indexer top-k selection during the generation (not the warm-up)
            select = cpu_kernels.index_select  # (its arguments: work, q, head weights, q_rows [blocks, queries], ...)
            monkeypatch.setattr(cpu_kernels, "index_select", lambda *a: selected.append(a[3].shape[0]) or select(*a))
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            for prompts in (["x"], ["def fibonacci(n):"], [long_prompt], ["import os\n" * 6, "class A:"]):
                outs = llm.generate(prompts, params)
                assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
            after = _signatures(dispatchers)
    finally:
        torch.set_num_threads(threads)
    new = {name: sorted(map(str, after[name] - warmed[name])) for name in dispatchers if after[name] - warmed[name]}
    assert not new, f"compiled after the warm-up: {new}"
    # Not vacuous: the warm-up compiled the attention, MoE, indexer and compressor kernels and the launcher of
    # threaded parts, and the generation ran the indexer's selection, in prefill (several query blocks) and decode
    # (one) steps.
    for name in (*kernels, "_run_parts"):
        assert warmed[name], name
    assert 1 in selected and max(selected) > 1, selected


def test_the_warm_up_says_when_it_compiles_the_kernels(tmp_path, monkeypatch, caplog):
    import importlib.util
    import logging

    # cached(): a kernel's entry in numba's on-disk cache exists once some process compiled it.
    source = tmp_path / "one_kernel.py"
    source.write_text("import numba\n\n\n@numba.njit(cache=True)\ndef plus_one(x):\n    return x + 1\n")
    spec = importlib.util.spec_from_file_location("one_kernel", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not cpu_kernels.base.cached(module.plus_one)
    assert module.plus_one(1) == 2
    assert cpu_kernels.base.cached(module.plus_one)
    # An engine whose kernels are not in the cache says it compiles them (a first run takes minutes), and only then.
    for cold in (True, False):
        monkeypatch.setattr(cpu_kernels, "compiled_before", lambda cold=cold: not cold)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="leanserve"):
            LLM(str(MODEL), max_model_len=256, load_progress=False)
        assert ("compiling the CPU kernels" in caplog.text) == cold


def test_a_built_engine_leaves_the_collector_only_what_comes_after():
    # What exists once an engine is built (the model, torch's and numba's modules, the kernels) lives as long as
    # the process: warm-up puts it out of the garbage collector's walks (runner.freeze_built_objects), so that a
    # full collection, which the steps' own garbage sets off now and then, walks only what came after instead of
    # stalling a step on the start-up's few hundred thousand objects.
    import gc

    llm = LLM(str(MODEL), dtype="float32", max_model_len=64, load_progress=False)
    llm.generate([{"prompt_token_ids": list(range(3, 13))}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert gc.get_freeze_count() > 10 * len(gc.get_objects())
