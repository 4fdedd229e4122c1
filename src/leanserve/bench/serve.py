"""`leanserve bench serve`: a bounded loopback load generator against a real `leanserve serve` process:
requests/s, output tokens/s, time to first token and inter-token latency at each concurrency level.

`leanserve bench serve --vs-engine`: what streaming through the server costs per token next to the offline
engine's own decode step, on the same model and settings, side by side in one run (arms alternated)."""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise

from leanserve.bench.common import print_rows
from leanserve.bench.options import SHIPPED_MODEL, add_output, int_list
from leanserve.bench.prompts import code_prompts


@dataclass
class ServeRow:
    concurrency: int
    requests: int
    req_s: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float


SERVE_HEADERS = {
    "concurrency": "concurrency",
    "requests": "requests",
    "req_s": "req/s",
    "output_tok_s": "output tok/s",
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
    "itl_p50_ms": "ITL p50 ms",
    "itl_p99_ms": "ITL p99 ms",
}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def serve_bench(
    model: str,
    concurrencies: list[int],
    requests_per_level: int = 32,
    max_tokens: int = 32,
    prompt_tokens: int = 48,
    server_args: list[str] | None = None,
) -> list[ServeRow]:
    """Starts `leanserve serve` on a free loopback port, then for each concurrency c keeps c streaming
    completions in flight until `max(requests_per_level, c)` have finished; reports requests/s, output
    tokens/s (the server's usage counts), time to first token and inter-token latency (p50, p99: the wait for a
    chunk over the tokens in it). Everything is bounded in count."""
    try:
        import httpx
    except ImportError:
        raise ValueError("bench serve needs httpx (pip install httpx).") from None
    import asyncio

    from leanserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model)
    if tokenizer is None:
        raise ValueError(f"{model} has no tokenizer.json; bench serve prompts with held-out code text.")
    most = max(max(concurrencies), requests_per_level)
    prompts = code_prompts(tokenizer, min(most, 64), prompt_tokens)
    with _server(model, ["--max-num-seqs", str(max(concurrencies)), *(server_args or [])]) as url:
        name = model

        async def one(client, prompt, ttfts, itls) -> int:
            body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
            start = time.perf_counter()
            chunks: list[tuple[float, int]] = []  # (arrival, characters) of each chunk with text
            tokens = 0
            async with client.stream("POST", url + "/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                    if text:
                        chunks.append((now, len(text)))
            if chunks:
                ttfts.append(chunks[0][0] - start)
                # A chunk may carry several tokens (the server sends at most every few ms): the wait for it is
                # shared by its tokens, counted by its share of the text.
                per_char = tokens / max(1, sum(n for _, n in chunks))
                itls += [(t - before) / max(1.0, n * per_char) for (before, _), (t, n) in pairwise(chunks)]
            return tokens

        async def level(c: int) -> ServeRow:
            n = max(requests_per_level, c)
            ttfts, itls = [], []
            queue = list(range(n))
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=c)) as client:

                async def worker() -> int:
                    done = 0
                    while queue:
                        i = queue.pop()
                        done += await one(client, prompts[i % len(prompts)], ttfts, itls)
                    return done

                await one(client, prompts[0], [], [])  # warm-up
                start = time.perf_counter()
                counts = await asyncio.gather(*(worker() for _ in range(c)))
                elapsed = time.perf_counter() - start
            return ServeRow(
                c, n, round(n / elapsed, 2), round(sum(counts) / elapsed, 1),
                round(1000 * _percentile(ttfts, 50), 1), round(1000 * _percentile(ttfts, 99), 1),
                round(1000 * _percentile(itls, 50), 1), round(1000 * _percentile(itls, 99), 1),
            )  # fmt: skip

        return [asyncio.run(level(c)) for c in concurrencies]


@contextlib.contextmanager
def _server(model: str, args: list[str]) -> Iterator[str]:
    """A `leanserve serve` process on a free loopback port for the block; yields its base URL (.../v1)."""
    cmd = [sys.executable, "-m", "leanserve.cli", "--log-level", "warning", "serve", "--model", model, "--port", "0"]
    proc = subprocess.Popen([*cmd, *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        url = None
        lines: list[str] = []
        for line in proc.stderr:
            if "serving" in line:
                url = line.strip().rsplit(" ", 1)[1]  # http://127.0.0.1:PORT/v1
                break
            lines = [*lines[-4:], line.strip()]
        if url is None:
            said = f": {' | '.join(lines)}" if lines else ""
            raise ValueError(f"the server did not start (exit code {proc.wait()}){said}")
        # Its stderr is read on (and dropped), so a chatty server never blocks on a full pipe.
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@dataclass
class VsEngineRow:
    arm: str
    tokens: int
    repeats: int
    ms_per_token: float | None  # decode: first token (chunk) to the last, per token after the first; a median
    ratio: float | None  # ms_per_token / the engine's
    first_quarter_ms: float | None  # ms per token over the first quarter of the output
    last_quarter_ms: float | None  # ... and over the last quarter (equal when the cost is flat in the length)
    same_text: bool | None  # the streamed text is the engine's (greedy, same prompt); None: not compared


VS_ENGINE_HEADERS = {
    "arm": "arm",
    "tokens": "tokens",
    "repeats": "repeats",
    "ms_per_token": "ms/token",
    "ratio": "vs engine",
    "first_quarter_ms": "1st quarter ms/tok",
    "last_quarter_ms": "last quarter ms/tok",
    "same_text": "same text",
}

ENGINE_ARM = "engine: LLM.generate"
COMPLETIONS_ARM = "server: /v1/completions stream"
CHAT_ARM = "server: /v1/chat/completions stream"


def serve_vs_engine_bench(
    model: str, max_tokens: int = 1000, repeats: int = 5, prompt_tokens: int = 48, dtype: str = "float32"
) -> list[VsEngineRow]:
    """In one run: the offline engine (LLM.generate, batch 1, greedy, ignore_eos, `max_tokens` tokens) in this
    process, and a `leanserve serve` process of the same model, dtype and engine settings streaming the same
    completion (and a chat completion of the same text) to a plain blocking client here; the arms alternate
    `repeats` times and never overlap. ms/token is the decode part: from the first token (first chunk) to the
    last, per token after the first. The quarters show whether the per-token cost grows with the length."""
    from leanserve import LLM, SamplingParams
    from leanserve.server.detokenizer import IncrementalDetokenizer
    from leanserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model)
    if tokenizer is None:
        raise ValueError(f"{model} has no tokenizer.json; bench serve prompts with held-out code text.")
    prompt = code_prompts(tokenizer, 1, prompt_tokens)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    bodies = {
        COMPLETIONS_ARM: ("/completions", {**body, "prompt": prompt}),
        CHAT_ARM: ("/chat/completions", {**body, "messages": [{"role": "user", "content": tokenizer.decode(prompt)}]}),
    }
    with _server(model, ["--dtype", dtype]) as url:
        llm = LLM(model, dtype=dtype, load_progress=False)
        try:
            engine = llm.engine
            steps: list[tuple[float, int]] = []  # (time after a step, tokens so far): the engine's quarters
            step = engine.step

            def timed_step():
                out = step()
                done = steps[-1][1] if steps else 0
                steps.append((time.perf_counter(), done + sum(len(u.new_tokens) for u in out)))
                return out

            engine.step = timed_step  # LLM.generate looks it up on the engine each step
            llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
            for path, b in bodies.values():
                _stream(url + path, {**b, "max_tokens": 16})
            runs: dict[str, list] = {ENGINE_ARM: [], COMPLETIONS_ARM: [], CHAT_ARM: []}
            reference = None
            for _ in range(repeats):
                steps.clear()
                (result,) = llm.generate({"prompt_token_ids": prompt}, greedy)
                out = result.outputs[0]
                m = result.metrics
                if reference is None:
                    detok = IncrementalDetokenizer(tokenizer)
                    for t in out.token_ids:
                        detok.add(t)
                    detok.flush()
                    reference = (out.text, detok.ends)
                ms = _per_token((m.first_token_time, 1), (m.finished_time, len(out.token_ids)))
                runs[ENGINE_ARM].append((ms, _quarters(list(steps), len(out.token_ids)), None))  # the reference
                for arm, (path, b) in bodies.items():
                    samples, text = _stream(url + path, b)
                    ends = reference[1] if arm == COMPLETIONS_ARM and text == reference[0] else None
                    counts = _token_counts(samples, ends, len(text), max_tokens)
                    ms = _per_token(counts[0], counts[-1])
                    same = text == reference[0] if arm == COMPLETIONS_ARM else None
                    runs[arm].append((ms, _quarters(counts, max_tokens), same))
        finally:
            llm.shutdown()
    rows = []
    base = _median([r[0] for r in runs[ENGINE_ARM]])
    for arm, results in runs.items():
        ms = _median([r[0] for r in results])
        ratio = round(ms / base, 3) if ms is not None and base else None
        first, last = _median([r[1][0] for r in results]), _median([r[1][1] for r in results])
        same = None if results[0][2] is None else all(r[2] for r in results)
        rows.append(VsEngineRow(arm, max_tokens, repeats, _round(ms), ratio, _round(first), _round(last), same))
    return rows


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _stream(url: str, body: dict) -> tuple[list[tuple[float, int]], str]:
    """One streaming request with a plain blocking client (little CPU of its own): (arrival time, text length
    so far) for each chunk carrying text or the finish, and the whole text."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    try:
        conn.request("POST", parts.path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ValueError(f"the server answered {resp.status}: {resp.read().decode(errors='replace')[:300]}")
        samples: list[tuple[float, int]] = []
        pieces: list[str] = []
        length = 0
        while line := resp.readline():
            now = time.perf_counter()
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ValueError(f"the stream ended with an error: {chunk['error']}")
            for c in chunk.get("choices") or []:
                text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if text or c.get("finish_reason") is not None:
                    pieces.append(text or "")
                    length += len(text or "")
                    samples.append((now, length))
        return samples, "".join(pieces)
    finally:
        conn.close()


def _token_counts(samples, ends: list[int] | None, total_chars: int, tokens: int) -> list[tuple[float, float]]:
    """(time, tokens received) per chunk: exactly from the tokens' end offsets where the text is known, else in
    proportion to the characters received (the last chunk holds all `tokens`)."""
    if not samples:
        raise ValueError("the stream carried no text")
    if ends is not None:
        counts = [(t, float(bisect.bisect_right(ends, n))) for t, n in samples]
    else:
        counts = [(t, tokens * n / max(1, total_chars)) for t, n in samples]
    counts[-1] = (counts[-1][0], float(tokens))
    return counts


def _per_token(a: tuple[float, float], b: tuple[float, float]) -> float | None:
    """ms per token between two (time, tokens so far) points; None if no token lies between them."""
    return 1000 * (b[0] - a[0]) / (b[1] - a[1]) if b[1] > a[1] else None


def _quarters(counts: list[tuple[float, float]], tokens: int) -> tuple[float | None, float | None]:
    """ms per token over the first and the last quarter of an output, from (time, tokens so far) points."""
    if not counts:
        return None, None
    q = max(1, tokens // 4)
    first, last = counts[0], counts[-1]
    a = next((c for c in counts if c[1] >= first[1] + q), last)
    b = next((c for c in counts if c[1] >= last[1] - q), last)
    return _per_token(first, a), _per_token(b, last)


HELP = "a bounded loopback load generator against a real server process"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=SHIPPED_MODEL, help="default: the shipped model (from the repo root)")
    p.add_argument("--concurrency", type=int_list, default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level (at least the level)")
    p.add_argument("--max-tokens", type=int, default=None, help="per request (default 32; --vs-engine: 1000)")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--vs-engine",
        action="store_true",
        help="instead: ms/token of one stream through the server next to the offline engine's decode, side by side",
    )
    p.add_argument("--repeats", type=int, default=5, help="--vs-engine: rounds of the alternating arms")
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="leave the server's prefix cache on (off by default here: the levels send the same prompts, which would "
        "hit from the second level on)",
    )
    add_output(p)


def run(args: argparse.Namespace) -> int:
    if args.vs_engine:
        max_tokens = 1000 if args.max_tokens is None else args.max_tokens
        if max_tokens < 2 or args.prompt_len < 1:
            raise ValueError("--prompt-len must be positive and --max-tokens at least 2.")
        rows = serve_vs_engine_bench(args.model, max_tokens, args.repeats, args.prompt_len, args.dtype)
        print_rows(rows, args.output, VS_ENGINE_HEADERS)
        return 0
    max_tokens = 32 if args.max_tokens is None else args.max_tokens
    if max_tokens < 1 or args.prompt_len < 1:
        raise ValueError("--prompt-len and --max-tokens must be positive.")
    server_args = ["--dtype", args.dtype] + ([] if args.prefix_caching else ["--no-enable-prefix-caching"])
    rows = serve_bench(args.model, args.concurrency, args.requests, max_tokens, args.prompt_len, server_args)
    print_rows(rows, args.output, SERVE_HEADERS)
    return 0
