"""Scoring through `leanserve serve`, as an evaluation harness uses it: completions with `echo` + `logprobs` (and
`max_tokens` 0) and vLLM's `prompt_logprobs`, read with the official `openai` client and equal to the in-process
engine's prompt logprobs; then lm-evaluation-harness itself as a client (`--model local-completions`) on a small
multiple-choice task over Python snippets (tests/data/scoring/), whose per-choice log-likelihoods must equal the
same task run on transformers' DeepseekV4ForCausalLM (`--model hf`) on the same checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from leanserve import LLM, SamplingParams
from test_server import NAME, SHIPPED, Server

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "scoring"
TASK = "leanserve_python_code"  # tests/data/scoring/python_code.yaml; its data_files path is relative to ROOT
TOL = 1e-5
PROMPTS = ["def add(a, b):\n    return a + b\n", "import os\n\n\nclass Stack:\n    def push(self, x):\n"]


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def local():
    """The server's engine settings in-process: what its scores must equal."""
    with LLM(str(SHIPPED), dtype="float32", max_model_len=512, max_num_seqs=8, load_progress=False) as llm:
        yield llm


def local_scores(llm: LLM, prompt, top: int):
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top))[0]
    return out.prompt_token_ids, out.prompt_logprobs, out.outputs[0].text


def top_of(entry: dict, n: int) -> dict[str, float]:
    return {lp.decoded_token: lp.logprob for lp in entry.values() if lp.rank is not None and lp.rank <= n}


# --- echo + logprobs, prompt_logprobs ----------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 0])
@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "ids"])
def test_echo_logprobs_equal_the_engines_prompt_logprobs(server, local, max_tokens, as_ids):
    tok = local.get_tokenizer()
    for text in PROMPTS:
        ids, want, generated = local_scores(local, text, 2)
        prompt = ids if as_ids else text
        out = server.client().completions.create(
            model=NAME, prompt=prompt, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0
        )
        choice, lps = out.choices[0], out.choices[0].logprobs
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == max_tokens
        # The prompt's entries first (the first token has no logprob), then the generated token's.
        assert len(lps.tokens) == len(lps.token_logprobs) == len(lps.top_logprobs) == len(ids) + max_tokens
        assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert abs(lps.token_logprobs[i] - want[i][ids[i]].logprob) <= TOL, i
            top = top_of(want[i], 2)
            assert lps.top_logprobs[i].keys() == top.keys(), i
            assert all(abs(lps.top_logprobs[i][t] - lp) <= TOL for t, lp in top.items()), i
        # The text: the prompt as the model read it (its <bos> included), then the completion.
        read = tok.decode(ids, skip_special_tokens=False)
        assert read.startswith("<bos>") and read.endswith(text)
        assert choice.text == read + (generated if max_tokens else "")
        # text_offset indexes that text, token by token.
        assert lps.text_offset[0] == 0
        for t, off in zip(lps.tokens, lps.text_offset, strict=True):
            assert choice.text[off : off + len(t)] == t
        assert lps.text_offset[-1] + len(lps.tokens[-1]) == len(choice.text)


def test_prompt_logprobs_in_vllms_shape(server, local):
    for text in PROMPTS:
        ids, want, generated = local_scores(local, text, 3)
        out = server.client().completions.create(
            model=NAME, prompt=text, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 3}
        )
        choice = out.choices[0]
        assert choice.logprobs is None and choice.text == generated
        got = choice.model_extra["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        for i in range(1, len(ids)):
            assert got[i].keys() == {str(t) for t in want[i]}, i  # the prompt token and the top 3
            assert str(ids[i]) in got[i] and {e["rank"] for e in got[i].values()} >= {1, 2, 3}
            for t, lp in want[i].items():
                e = got[i][str(t)]
                assert e["rank"] == lp.rank and e["decoded_token"] == lp.decoded_token
                assert abs(e["logprob"] - lp.logprob) <= TOL, (i, t)


@pytest.mark.parametrize("field", ["echo", "prompt_logprobs"])
def test_scoring_with_stream_is_a_400_naming_the_field(server, field):
    kw = {"echo": True, "logprobs": 1} if field == "echo" else {"extra_body": {"prompt_logprobs": 1}}
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=NAME, prompt="x = 1", max_tokens=1, stream=True, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == field and field in e.value.message


# --- lm-evaluation-harness as a client ---------------------------------------------------------------
def lm_eval_cmd(model: str, model_args: str, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASK]
    return cmd + ["--include_path", str(DATA.relative_to(ROOT)), "--log_samples", "--output_path", str(out)]


def lm_eval_env(tmp: Path) -> dict:
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp / "hf_datasets")}
    return {**os.environ, **offline, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def samples(out: Path) -> dict[int, list[tuple[float, bool]]]:
    """doc id -> [(log-likelihood, is_greedy)] per choice, from --log_samples' file."""
    files = list(out.rglob(f"samples_{TASK}_*.jsonl"))
    assert len(files) == 1, files
    docs = {}
    for line in files[0].read_text().splitlines():
        d = json.loads(line)
        docs[d["doc_id"]] = [(float(ll), greedy == "True") for ll, greedy in d["filtered_resps"]]
    return docs


def test_lm_eval_through_the_server_equals_transformers(server, tmp_path):
    env = lm_eval_env(tmp_path)
    url = f"{server.url}/v1/completions"
    runs = {
        "api": lm_eval_cmd(
            "local-completions",
            f"model={NAME},base_url={url},tokenizer_backend=huggingface,tokenizer={SHIPPED},"
            "add_bos_token=True,num_concurrent=1,max_retries=1",
            tmp_path / "api",
        ),
        # The same task on transformers' model of the same checkpoint.
        "hf": lm_eval_cmd("hf", f"pretrained={SHIPPED},dtype=float32,add_bos_token=True", tmp_path / "hf")
        + ["--device", "cpu"],
    }
    for name, cmd in runs.items():
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (name, run.stdout[-4000:], run.stderr[-6000:])

    want_docs = [json.loads(line) for line in (DATA / "python_code.jsonl").read_text().splitlines()]
    ours, theirs = samples(tmp_path / "api"), samples(tmp_path / "hf")
    assert sorted(ours) == sorted(theirs) == list(range(len(want_docs)))
    for i, doc in enumerate(want_docs):
        assert len(ours[i]) == len(theirs[i]) == len(doc["choices"]), i
        for (a, greedy_a), (b, greedy_b) in zip(ours[i], theirs[i], strict=True):
            assert a < 0 and abs(a - b) <= 1e-3, (i, doc, ours[i], theirs[i])
            assert greedy_a == greedy_b, (i, doc, ours[i], theirs[i])
