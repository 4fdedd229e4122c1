"""The OpenAI-compatible server, tested with the official `openai` client against a real server process on
127.0.0.1 at a free port: shapes, streaming, stop strings, logprobs, seeds, concurrency, disconnects, bad
input, auth, pipeline + speculation through the server, and a clean shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from leanserve import LLM, SamplingParams

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "dsv4-stdlib-12l"
NAME = "stdlib-8m"
ENGINE = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8"]
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef main():\n    ", "class Stack:\n", "for i in range(", "x = {"]


class Server:
    def __init__(self, *extra: str, model: Path = SHIPPED) -> None:
        cmd = [sys.executable, "-m", "leanserve.cli", "--log-level", "warning", "serve", "--model", str(model)]
        cmd += ["--port", "0", "--served-model-name", NAME, *ENGINE, *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        deadline = time.monotonic() + 120
        self.port = None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            if "serving" in line:
                self.port = int(line.rsplit(":", 1)[1].split("/")[0])
                break
        assert self.port, f"server did not start (exit {self.proc.poll()})"
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def raw(self, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(
            self.url + path, data=body, headers=headers or {}, method="POST" if body is not None else "GET"
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metric(self, name: str) -> float:
        _, text = self.raw("/metrics")
        for line in text.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def local():
    """The same engine settings in-process, for what the server must equal."""
    with LLM(str(SHIPPED), dtype="float32", max_model_len=512, max_num_seqs=8, load_progress=False) as llm:
        yield llm


def greedy_text(llm: LLM, prompt: str, max_tokens: int) -> str:
    return llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].outputs[0].text


# --- shapes -------------------------------------------------------------------------------------------
def test_models(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]


def test_completion_equals_llm_generate(server, local):
    out = server.client().completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    choice = out.choices[0]
    assert choice.text == greedy_text(local, PROMPTS[0], 24)
    assert choice.finish_reason == "length" and out.object == "text_completion"
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == len(
        local.get_tokenizer().encode(PROMPTS[0])
    )


def test_a_resent_prompt_reports_its_cached_tokens_and_the_same_text(server):
    prompt = "import json\n\n\ndef load(path):\n    " * 8  # (a prompt no other test sends)
    client = server.client()
    first, again = (client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0) for _ in "ab")
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == n - 1  # all but the last token, fed again
    assert again.choices[0].text == first.choices[0].text


def test_chat_streaming_and_not_agree(server):
    client = server.client()
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    full = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.object == "chat.completion"
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


def test_stop_strings_cut_the_text_across_token_boundaries(server, local):
    text = greedy_text(local, PROMPTS[1], 40)
    stop = text[10:14]  # four characters that need not align with tokens
    want = text[: text.index(stop)]
    client = server.client()
    out = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=[stop, "@@@@"])
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=stop, stream=True
    )
    parts = list(streamed)
    assert "".join(c.choices[0].text for c in parts) == want and parts[-1].choices[0].finish_reason == "stop"


def test_logprobs(server, local):
    client = server.client()
    out = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    want = local.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3))[0].outputs[0]
    assert len(lp.token_logprobs) == 6 and all(len(t) == 3 for t in lp.top_logprobs)
    for got, ref, tok in zip(lp.token_logprobs, want.logprobs, want.token_ids, strict=True):
        assert abs(got - ref[tok].logprob) < 1e-4
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_seeds_reproduce_and_n_gives_n_choices(server):
    client = server.client()
    kw = dict(model=NAME, prompt=PROMPTS[3], max_tokens=16, temperature=1.0, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    many = client.completions.create(**kw, n=3)
    assert sorted(c.index for c in many.choices) == [0, 1, 2] and many.usage.completion_tokens == 48


# --- many clients -------------------------------------------------------------------------------------
def test_64_concurrent_streams_each_get_exactly_their_own_tokens(server, local):
    combos = [(p, m) for p in PROMPTS for m in (5, 9, 13)][:16]
    alone = {c: greedy_text(local, c[0], c[1]) for c in combos}

    async def one(client, prompt, max_tokens):
        stream = await client.completions.create(
            model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them():
        client = server.async_client()
        jobs = [combos[i % len(combos)] for i in range(64)]
        random.Random(0).shuffle(jobs)
        results = await asyncio.gather(*(one(client, p, m) for p, m in jobs))
        await client.close()
        return jobs, results

    jobs, results = asyncio.run(all_of_them())
    for job, text in zip(jobs, results, strict=True):
        assert text == alone[job], job


def test_a_client_that_disconnects_frees_its_slot(server):
    async def start_and_leave():
        client = server.async_client()
        streams = []
        for i in range(8):  # a full batch (max_num_seqs 8) of long requests
            s = await client.completions.create(
                model=NAME, prompt=PROMPTS[i % 5], max_tokens=450, stream=True, temperature=0
            )
            await s.__anext__()
            streams.append(s)
        for s in streams:
            await s.close()  # drop the connection mid-stream
        await client.close()

    asyncio.run(start_and_leave())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.metric("leanserve_num_requests_running") > 0:
        time.sleep(0.1)
    # A full batch still fits at once: nothing was left holding a slot.
    assert server.metric("leanserve_num_requests_running") == 0

    async def full_batch():
        client = server.async_client()
        outs = await asyncio.gather(
            *(
                client.completions.create(model=NAME, prompt=PROMPTS[i % 5], max_tokens=4, temperature=0)
                for i in range(8)
            )
        )
        await client.close()
        return outs

    assert all(o.choices[0].finish_reason == "length" for o in asyncio.run(full_batch()))


# --- bad input ---------------------------------------------------------------------------------------
BAD = [
    ({"model": NAME}, "prompt"),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "n": 0}, "n"),
    ({"model": NAME, "prompt": "x", "n": 10**6}, "n"),
    ({"model": NAME, "prompt": "x", "temperature": -0.5}, "temperature"),
    ({"model": NAME, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": NAME, "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": NAME, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": NAME, "prompt": "x", "stop": [""]}, "stop"),
    ({"model": NAME, "prompt": "x", "stop": 5}, "stop"),
    ({"model": NAME, "prompt": "x", "logprobs": 100}, "logprobs"),
    ({"model": NAME, "prompt": [1, 2, 10**9]}, "prompt"),
    ({"model": NAME, "prompt": "x " * 2000}, "prompt"),
    ({"model": NAME, "prompt": "x", "seed": "abc"}, "seed"),
    ({"model": NAME, "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": NAME, "prompt": "x", "echo": True, "stream": True}, "echo"),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"model": NAME, "prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"model": NAME, "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"50": 101}}, "logit_bias"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"4096": 1}}, "logit_bias"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"fifty": 1}}, "logit_bias"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_parameters_get_a_400_naming_the_field(server, body, param):
    status, raw = server.raw("/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_unknown_model_is_404_and_unknown_fields_are_refused_by_name(server):
    status, raw = server.raw("/v1/completions", json.dumps({"model": "gpt-9", "prompt": "x"}).encode())
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"
    body = {"model": NAME, "prompt": "x", "max_tokens": 2, "user": "me"}  # `user` is the caller's own label
    assert server.raw("/v1/completions", json.dumps(body).encode())[0] == 200
    status, raw = server.raw("/v1/completions", json.dumps({**body, "frobnicate": True}).encode())
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "frobnicate" and "'frobnicate' is not supported" in error["message"]


def test_fuzz_gets_only_4xx_and_the_server_keeps_serving(server):
    rng = random.Random(1234)
    valid = json.dumps({"model": NAME, "prompt": "def f(", "max_tokens": 3, "temperature": 0}).encode()
    junk_values = [None, -1, 0, 1.5, 10**30, -(10**30), "", "x" * 50, [], {}, [1, "a"], True, float("1e308")]
    bodies = [
        b"",
        b"{",
        b"[]",
        b"null",
        b"\xff\xfe\x00garbage",
        b'{"model": "' + b"\xc3\x28" + b'"}',
        b"x" * (5 * 2**20),
    ]
    for _ in range(60):
        cut = rng.randrange(len(valid))
        bodies.append(valid[:cut])  # truncated JSON
        body = json.loads(valid)
        body[rng.choice(["model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "seed"])] = (
            rng.choice(junk_values)
        )
        bodies.append(json.dumps(body).encode())
    for path in ("/v1/completions", "/v1/chat/completions"):
        for body in bodies:
            status, _ = server.raw(path, body, {"Content-Type": "application/json"})
            assert 200 <= status < 500, (path, body[:80], status)
    assert server.raw("/v1/completions", valid)[0] == 200
    assert server.raw("/health")[0] == 200


def test_metrics(server):
    # A request of each outcome first: the test must not depend on which tests ran before it in this worker.
    assert server.raw("/v1/completions", json.dumps({"model": NAME, "prompt": "x", "max_tokens": 1}).encode())[0] == 200
    assert server.raw("/v1/completions", json.dumps({"model": NAME, "prompt": "x", "n": 0}).encode())[0] == 400
    _, text = server.raw("/metrics")
    text = text.decode()
    for name in (
        "leanserve_requests_total", "leanserve_prompt_tokens_total", "leanserve_generation_tokens_total",
        "leanserve_num_requests_running", "leanserve_num_requests_waiting", "leanserve_time_to_first_token_seconds",
        "leanserve_inter_token_latency_seconds", 'leanserve_memory_bytes{feature="kv_cache",stage="0"}',
    ):  # fmt: skip
        assert name in text, name
    assert 'status="400"' in text and 'status="200"' in text
    # The paged cache: between requests only the prefix cache holds blocks; none preempted by short requests.
    used = re.search(r'leanserve_kv_cache_blocks\{state="used"\} (\S+)', text)
    free = re.search(r'leanserve_kv_cache_blocks\{state="free"\} (\S+)', text)
    assert used and free and float(free.group(1)) > 0
    assert "leanserve_num_preemptions_total 0.0" in text
    queries = re.search(r"^leanserve_prefix_cache_queries_total (\S+)", text, re.M)
    hits = re.search(r"^leanserve_prefix_cache_hits_total (\S+)", text, re.M)
    assert queries and hits and float(queries.group(1)) >= 1 and float(hits.group(1)) <= float(queries.group(1))


# --- auth, pipeline + speculation, shutdown ---------------------------------------------------------------
def test_api_key_pipeline_speculation_and_clean_shutdown(local):
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    s = Server("--api-key", "sekrit", "-pp", "2", "--speculative-config", spec)
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        assert s.raw("/v1/models")[0] == 401
        client = s.client(api_key="sekrit")
        out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=30, temperature=0)
        assert out.choices[0].text == greedy_text(local, PROMPTS[0], 30)
        assert s.metric("leanserve_spec_decode_num_accepted_tokens") > 0
        # Concurrent streams with stop strings: micro-batches in flight, requests finishing mid-flight.
        texts = [greedy_text(local, p, 30) for p in PROMPTS[:4]]
        stops = [t[10:14] for t in texts]

        def stream(i: int) -> str:
            parts = client.completions.create(
                model=NAME, prompt=PROMPTS[i], max_tokens=30, temperature=0, stop=stops[i], stream=True
            )
            return "".join(c.choices[0].text for c in parts)

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(stream, range(4)))
        assert got == [t[: t.index(stop)] for t, stop in zip(texts, stops, strict=True)]
        stages = [p for p in _children(s.proc.pid)]
        assert stages  # the pipeline's second stage
    finally:
        code = s.stop()
    assert code == 0
    assert not any(_alive(p) for p in stages)
    with socket.socket() as probe:  # the port is free again
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", s.port))


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- in-process: shutdown 503 and the chat template -------------------------------------------------------
def _app_client(model_dir: Path, llm_kwargs: dict | None = None):
    from fastapi.testclient import TestClient

    from leanserve.server.app import build_app

    llm = LLM(
        str(model_dir), dtype="float32", max_model_len=256, max_num_seqs=2, load_progress=False, **(llm_kwargs or {})
    )
    app = build_app(llm, NAME)
    return app, TestClient(app)


def test_requests_after_shutdown_began_get_503():
    app, client = _app_client(SHIPPED)
    with client:
        body = {"model": NAME, "prompt": "x", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
        app.state.leanserve["shutting_down"] = True
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert client.get("/health").status_code == 503


def test_chat_uses_the_models_chat_template(tmp_path):
    model = tmp_path / "with-template"
    model.mkdir()
    for f in SHIPPED.iterdir():
        if f.is_file() and f.name != "tokenizer_config.json":  # (written below: never through a link)
            (model / f.name).symlink_to(f)
    template = (
        "{{ bos_token }}{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<<assistant>>{% endif %}"
    )
    bos = {"__type": "AddedToken", "content": "<bos>"}  # as DeepSeek's tokenizer_config.json writes it
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": bos}))
    _, client = _app_client(model)
    with client:
        messages = [{"role": "user", "content": "def f(x):"}]
        r = client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 3})
        assert r.status_code == 200
        tok = LLM(str(SHIPPED), max_model_len=64, load_progress=False).get_tokenizer()
        # The template writes the BOS itself: one BOS, not two.
        want = tok.encode("<bos><<user>>def f(x):\n<<assistant>>", add_special_tokens=False)
        assert r.json()["usage"]["prompt_tokens"] == len(want) and want[0] == 0 and want[1] != 0
        # Without a template: the documented plain one.
    _, plain = _app_client(SHIPPED)
    with plain:
        r = plain.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 3})
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("user: def f(x):\nassistant:"))


def test_bench_serve_reports_each_concurrency_level(capsys):
    from leanserve.cli import main

    args = ["--log-level", "warning", "bench", "serve", "--model", str(SHIPPED), "--concurrency", "1,3"]
    assert main([*args, "--requests", "3", "--max-tokens", "4", "--prompt-len", "8", "--output", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["concurrency"], r["requests"]) for r in rows] == [(1, 3), (3, 3)]
    assert all(r["req_s"] > 0 and r["output_tok_s"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0 for r in rows)


def test_a_pipeline_stage_that_dies_stops_the_server_naming_it():
    s = Server("-pp", "2")
    try:
        (stage,) = _children(s.proc.pid)
        # Requests in flight (two micro-batches' worth) when the stage dies each get an error, not silence.
        body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 400, "ignore_eos": True}).encode()
        with ThreadPoolExecutor(4) as pool:
            running = [pool.submit(s.raw, "/v1/completions", body) for _ in range(4)]
            deadline = time.monotonic() + 30
            while s.metric("leanserve_num_requests_running") < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(stage, signal.SIGKILL)
            for f in running:
                status, raw = f.result(timeout=30)
                assert status == 503 and "pipeline stage 1 died" in json.loads(raw)["error"]["message"]
        code = s.proc.wait(timeout=30)  # the server shuts down so a supervisor can restart it
        assert code == 1 and "pipeline stage 1 died" in s.proc.stderr.read()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert not _alive(stage)


def test_stop_strings_keep_logprobs_and_usage_in_step_with_the_text(server, local):
    text = greedy_text(local, PROMPTS[0], 30)
    stop = text[12:15]
    client = server.client()
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=stop, logprobs=1)
    out = client.completions.create(**kw)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == text[: text.index(stop)]
    # The tokens up to the one completing the stop string: their text covers the answer and the stop string.
    assert "".join(lp.tokens).startswith(out.choices[0].text + stop) or (out.choices[0].text + stop).startswith(
        "".join(lp.tokens)
    )
    assert out.usage.completion_tokens == len(lp.tokens) < 30
    chunks = list(client.completions.create(**kw, stream=True))
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    offsets = [o for c in chunks for o in (c.choices[0].logprobs.text_offset if c.choices[0].logprobs else [])]
    assert tokens == lp.tokens
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


def test_a_request_cancelled_before_the_loop_takes_it_frees_its_slot():
    from leanserve.server.async_engine import AsyncEngine

    llm = LLM(str(SHIPPED), dtype="float32", max_model_len=256, max_num_seqs=2, load_progress=False)
    engine = llm.engine
    add = engine.add_request

    def slow_add(*args):  # the loop is busy when the client leaves
        time.sleep(0.3)
        return add(*args)

    engine.add_request = slow_add
    async_engine = AsyncEngine(engine)

    async def leave_early():
        async def consume():
            async for _ in async_engine.generate([0, 90, 91], SamplingParams(max_tokens=200, ignore_eos=True)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)  # "add" is posted, the loop is still adding it
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (engine.has_unfinished or async_engine._inbox.qsize()):
            await asyncio.sleep(0.05)

    asyncio.run(leave_early())
    assert not engine.has_unfinished and engine.scheduler.slots.num_free == 2
    async_engine.stop()


def test_async_engine_deltas_concatenate_to_the_offline_output():
    # Each request's deltas, read as a streaming client reads them, are exactly LLM.generate's tokens and
    # logprobs, also with MTP drafts (several tokens per delta) and a stop token inside a step's tokens.
    from leanserve.server.async_engine import AsyncEngine

    llm = LLM(
        str(SHIPPED), dtype="float32", max_model_len=256, max_num_seqs=4, load_progress=False,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )  # fmt: skip
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    (first,) = llm.generate({"prompt_token_ids": prompts[0]}, greedy)
    stop = first.outputs[0].token_ids[12]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop], logprobs=1),
        greedy,
        SamplingParams(temperature=0.8, seed=4, max_tokens=16, ignore_eos=True, logprobs=0),
    ]
    want = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    async_engine = AsyncEngine(llm.engine)

    async def collect(prompt, p):
        deltas = [d async for d in async_engine.generate(prompt, p)]
        tokens = [t for d in deltas for t in d.tokens]
        return tokens, [d.finish_reason for d in deltas], max(len(d.tokens) for d in deltas)

    async def main():
        return await asyncio.gather(*(collect(p, q) for p, q in zip(prompts, params, strict=True)))

    try:
        got = asyncio.run(main())
    finally:
        async_engine.stop()
    for (tokens, reasons, _), result in zip(got, want, strict=True):
        comp = result.outputs[0]
        assert [t.token_id for t in tokens] == comp.token_ids
        want_lp = [d[t].logprob for t, d in zip(comp.token_ids, comp.logprobs, strict=True)]
        assert [t.logprob for t in tokens] == pytest.approx(want_lp, abs=1e-5)  # (another batch composition)
        assert reasons[-1] == comp.finish_reason and all(r is None for r in reasons[:-1])
    assert want[0].outputs[0].finish_reason == "stop" and len(want[0].outputs[0].token_ids) <= 13
    assert max(g[2] for g in got) > 1  # some deltas carried accepted drafts
