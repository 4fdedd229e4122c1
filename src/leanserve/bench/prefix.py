"""`leanserve bench prefix`: what the prefix cache saves a client, through two real servers side by side.

Two `leanserve serve` processes of the same model, one with the prefix cache (the default) and one with
`--no-enable-prefix-caching`, get the same requests from the official `openai` client, streaming, alternating
which server goes first:
  - a prompt of about `--prompt-tokens` tokens of text sent again and again: its time to first token (to the first
    streamed chunk of the answer; the first send, which fills the cache, is not counted);
  - a chat of `--turns` turns replayed: each turn sends the whole conversation so far (the earlier questions and
    the model's answers, as chat clients do) with a new question; per turn, its prompt tokens, the tokens the
    cache gave (the usage's `prompt_tokens_details.cached_tokens`), and the time to first token of both servers.
Reported: medians and off/on ratios, and whether both servers' texts agree (greedy).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import socket
import statistics
import time
from dataclasses import dataclass

from leanserve.bench.common import print_rows
from leanserve.bench.options import SHIPPED_MODEL, add_output, require_positive
from leanserve.bench.serve import _server


@dataclass
class PrefixRow:
    request: str
    prompt_tokens: int
    cached_tokens: int
    ttft_on_ms: float
    ttft_off_ms: float
    off_over_on: float
    same_text: bool


HEADERS = {
    "request": "request",
    "prompt_tokens": "prompt tokens",
    "cached_tokens": "cached (on)",
    "ttft_on_ms": "TTFT on ms",
    "ttft_off_ms": "TTFT off ms",
    "off_over_on": "off/on",
    "same_text": "same text",
}

WORDS = [
    "the",
    "cache",
    "keeps",
    "every",
    "prefix",
    "a",
    "request",
    "computed",
    "so",
    "that",
    "the",
    "next",
    "turn",
    "of",
    "a",
    "conversation",
    "only",
    "reads",
    "what",
    "is",
    "new",
    "in",
    "it",
    "while",
    "the",
    "server",
    "answers",
    "many",
    "users",
    "who",
    "send",
    "long",
    "documents",
    "and",
    "short",
    "questions",
    "about",
    "them",
]


def _question(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "?"


def _timed(fn) -> tuple[float, str, int, int]:
    """(seconds to the first streamed text of the answer, its text, prompt tokens, cached tokens) of one streaming
    request (a chat stream's first chunk, the role alone, does not count)."""
    start, first, text, usage = time.perf_counter(), None, [], None
    for chunk in fn():
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = getattr(c, "text", None) or getattr(getattr(c, "delta", None), "content", None) or ""
            if piece and first is None:
                first = time.perf_counter() - start
            text.append(piece)
    details = getattr(usage, "prompt_tokens_details", None)
    cached = (details.cached_tokens or 0) if details is not None else 0
    return first if first is not None else time.perf_counter() - start, "".join(text), usage.prompt_tokens, cached


def bench_prefix(
    model: str, prompt_tokens: int, repeats: int, turns: int, max_tokens: int, seed: int
) -> list[PrefixRow]:
    try:
        import httpx
        import openai
    except ImportError:
        raise ValueError("bench prefix needs the openai client (pip install 'openai>=1.40').") from None
    from leanserve.tokenizer import Tokenizer

    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(4 * prompt_tokens))
    tokenizer = Tokenizer.from_dir(model)
    prompt = tokenizer.decode(tokenizer.encode(text)[:prompt_tokens])  # (about prompt_tokens tokens of text)
    with contextlib.ExitStack() as stack:
        urls = {
            True: stack.enter_context(_server(model, [])),
            False: stack.enter_context(_server(model, ["--no-enable-prefix-caching"])),
        }
        # (TCP_NODELAY: httpx leaves Nagle's algorithm on, and on loopback a request's body then waits for the
        # server's delayed ACK, 40 ms, which would swamp what is measured)
        nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        clients = {
            k: openai.OpenAI(
                base_url=u,
                api_key="none",
                http_client=httpx.Client(transport=httpx.HTTPTransport(socket_options=nodelay)),
            )
            for k, u in urls.items()
        }
        name = clients[True].models.list().data[0].id

        def send(client):
            return client.completions.create(
                model=name, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip

        rows = []
        first = {k: _timed(lambda c=c: send(c)) for k, c in clients.items()}  # (fills the cache)
        times: dict[bool, list[float]] = {True: [], False: []}
        same = True
        for r in range(repeats):
            for on in (True, False) if r % 2 == 0 else (False, True):
                t, text, n, cached = _timed(lambda on=on: send(clients[on]))
                times[on].append(t)
                same &= text == first[on][1]
                if on:
                    hit = cached
        on_ms, off_ms = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
        rows.append(PrefixRow("re-sent prompt", n, hit, round(on_ms, 1), round(off_ms, 1), round(off_ms / on_ms, 1),
                              same and first[True][1] == first[False][1]))  # fmt: skip
        history = {True: [], False: []}
        questions = [_question(rng, rng.randint(40, 120)) for _ in range(turns)]
        for turn, q in enumerate(questions, 1):
            got = {}
            for on in (True, False) if turn % 2 else (False, True):
                messages = [*history[on], {"role": "user", "content": q}]
                got[on] = _timed(
                    lambda on=on, m=messages: clients[on].chat.completions.create(
                        model=name, messages=m, max_tokens=max_tokens, temperature=0, stream=True,
                        stream_options={"include_usage": True},
                    )
                )  # fmt: skip
                history[on] = [*messages, {"role": "assistant", "content": got[on][1]}]
            (t_on, text_on, n, cached), (t_off, text_off, _, _) = got[True], got[False]
            rows.append(PrefixRow(f"chat turn {turn}", n, cached, round(t_on * 1e3, 1), round(t_off * 1e3, 1),
                                  round(t_off / t_on, 1), text_on == text_off))  # fmt: skip
    return rows


HELP = "the prefix cache on vs off through two servers: a re-sent prompt's TTFT and a chat replayed turn by turn"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=SHIPPED_MODEL)
    p.add_argument("--prompt-tokens", type=int, default=2000, help="the re-sent prompt's length")
    p.add_argument("--repeats", type=int, default=6, help="sends of the prompt per server (after the first)")
    p.add_argument("--turns", type=int, default=6, help="turns of the chat")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens each answer takes")
    p.add_argument("--seed", type=int, default=0)
    add_output(p)


def run(args: argparse.Namespace) -> int:
    require_positive(args, "prompt_tokens", "turns", "max_tokens")
    rows = bench_prefix(args.model, args.prompt_tokens, args.repeats, args.turns, args.max_tokens, args.seed)
    print_rows(rows, args.output, HEADERS)
    return 0
