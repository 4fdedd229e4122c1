"""`leanserve bench serve`: a bounded loopback load generator against a real `leanserve serve` process:
requests/s, output tokens/s, time to first token and inter-token latency at each concurrency level."""

from __future__ import annotations

import time
from dataclasses import dataclass

from leanserve.bench.common import code_prompts


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
    tokens/s, time to first token and inter-token latency (p50, p99). Everything is bounded in count."""
    try:
        import httpx
    except ImportError:
        raise ValueError("bench serve needs httpx (pip install httpx).") from None
    import asyncio
    import subprocess
    import sys

    from leanserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model)
    if tokenizer is None:
        raise ValueError(f"{model} has no tokenizer.json; bench serve prompts with held-out code text.")
    most = max(max(concurrencies), requests_per_level)
    prompts = code_prompts(tokenizer, min(most, 64), prompt_tokens)
    cmd = [sys.executable, "-m", "leanserve.cli", "--log-level", "warning", "serve", "--model", model, "--port", "0"]
    cmd += ["--max-num-seqs", str(max(concurrencies)), *(server_args or [])]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        url = None
        for line in proc.stderr:
            if "serving" in line:
                url = line.strip().rsplit(" ", 1)[1]  # http://127.0.0.1:PORT/v1
                break
        if url is None:
            raise ValueError(f"the server did not start (exit code {proc.poll()})")
        name = model

        async def one(client, prompt, ttfts, itls) -> int:
            body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            start = last = time.perf_counter()
            tokens = 0
            async with client.stream("POST", url + "/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    if tokens == 0:
                        ttfts.append(now - start)
                    else:
                        itls.append(now - last)
                    last = now
                    tokens += 1
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
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
