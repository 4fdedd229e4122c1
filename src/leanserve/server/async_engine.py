"""One engine loop for many clients, stepped on the server's own event loop: requests join the running batch
(continuous batching) and receive their tokens through per-request queues.

Why on the event loop and not on a thread of its own: the HTTP side's work per token is small, but from a
thread of its own each token cost a cross-thread wake-up, and every system call of the event loop (its
select, the socket writes) handed the GIL back and forth with the engine thread, each hand-off a context
switch and each competing with the engine's kernels for the cores, so streaming cost far more than the
engine's own step per token (`leanserve bench serve --vs-engine` compares the two). Here a step runs, then the event loop gets a few turns to carry its tokens to the
sockets and to take new requests and disconnects; then the next step. A client's socket never blocks a step
(writes are buffered); a step holds the HTTP side up for its length (a long prefill, or with pipeline
parallelism the wait for the other stages), as it held up the tokens anyway.

A request's tokens are handed on at most every `stream_interval` seconds (its first at once, its last with
the finish): when steps are faster than that, a delta carries several steps' tokens, so the cost of a chunk
(the response's generator, JSON, a socket write and the client's wake-up) is shared by the tokens in it.
A consumer that falls behind also gets its waiting deltas merged into one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from leanserve.engine.llm_engine import LLMEngine
from leanserve.engine.sequence import SampledToken
from leanserve.llm import prompt_logprob_entries
from leanserve.sampling_params import SamplingParams

logger = logging.getLogger("leanserve")


@dataclass
class Delta:
    """New tokens of one request; `finish_reason` is set on its last delta ("stop", "length" or "abort")."""

    tokens: list[SampledToken]
    finish_reason: str | None = None
    error: str | None = None
    prompt_logprobs: list | None = None  # on the first delta of a request that asked for them
    cached_tokens: int = 0  # prompt tokens the prefix cache gave the request


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    held: list[SampledToken] = field(default_factory=list)  # tokens not yet handed on
    scored: bool = False  # whether its prompt logprobs were handed on (when the request asked)
    sent_at: float | None = None  # when tokens were last handed on


class EngineStopped(RuntimeError):
    pass


class AsyncEngine:
    # Turns of the event loop after a step that handed tokens on: they go from the request's queue through a
    # few task hops (the choice, the response's generator, the socket write) before the next step starts.
    # After a step that did not, one turn takes new requests and disconnects.
    TURNS_PER_STEP = 4

    def __init__(self, engine: LLMEngine, on_step=None, on_dead=None, stream_interval: float = 0.01) -> None:
        self.engine = engine
        self.on_step = on_step  # called after every step (metrics)
        self.on_dead = on_dead  # called with the reason if the engine cannot go on
        self.stream_interval = stream_interval
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # messages from other threads ("stop")
        self._streams: dict[int, _Stream] = {}
        self._stopping = False
        self.dead: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._ended = threading.Event()  # set when the stepping task has ended

    # --- the requests -------------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[Delta]:
        """Yields the request's tokens as they come, in deltas of one or more tokens; aborts the request if
        the caller stops iterating (a client that went away), so its cache slot is freed at once. A bad
        request raises ValueError naming the problem."""
        if self.dead or self._stopping:
            raise EngineStopped(self.dead or "the server is shutting down")
        self._start()
        seq_id = self.engine.add_request(prompt_token_ids, params)
        stream = self._streams[seq_id] = _Stream()
        self._wake.set()
        finished = False
        try:
            while True:
                delta: Delta = await stream.queue.get()
                while delta.finish_reason is None and not stream.queue.empty():  # the caller is behind
                    more: Delta = stream.queue.get_nowait()
                    delta = Delta(
                        delta.tokens + more.tokens, more.finish_reason, more.error,
                        delta.prompt_logprobs or more.prompt_logprobs,
                    )  # fmt: skip
                if delta.error is not None:
                    raise EngineStopped(delta.error)
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        finally:
            if not finished and self._streams.pop(seq_id, None) is not None:
                self.engine.abort(seq_id)

    def stop(self) -> None:
        """Ends every request (finish_reason "abort"), stops stepping and the engine's stages. From any thread;
        from another one than the event loop's, it waits for the current step to end."""
        self._stopping = True
        task, loop = self._task, self._loop
        if task is not None and not task.done() and loop is not None and not loop.is_closed():
            if loop.is_running() and not _on_thread_of(loop):  # it ends the requests after its current step
                self._inbox.put(("stop",))
                with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                    loop.call_soon_threadsafe(self._wake.set)
                while not self._ended.wait(0.1) and loop.is_running():
                    pass
            else:  # the stepping task is not running (this code runs): end it here
                self._end_all("abort")
                task.cancel()
        self.engine.shutdown()

    # --- stepping -----------------------------------------------------------------------------------
    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done():
            if self._loop is not loop:
                raise RuntimeError("an AsyncEngine serves one event loop at a time")
            return
        self._loop, self._wake = loop, asyncio.Event()
        self._ended.clear()
        self._task = loop.create_task(self._run(), name="leanserve-engine")

    async def _run(self) -> None:
        try:
            while True:
                while not self._inbox.empty():
                    if self._inbox.get_nowait()[0] == "stop":
                        self._end_all("abort")
                        return
                if not self.engine.has_unfinished:  # idle: until a request arrives
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                handed_on = self._step()
                for _ in range(self.TURNS_PER_STEP if handed_on else 1):
                    await asyncio.sleep(0)
        except asyncio.CancelledError:  # the event loop is closing
            self._end_all("abort")
            raise
        except Exception as e:  # the engine cannot go on (e.g. a pipeline stage died): tell every request
            logger.exception("engine loop stopped")
            self.dead = f"the engine stopped: {e}"
            for stream in self._streams.values():
                stream.queue.put_nowait(Delta([], "abort", self.dead))
            self._streams.clear()
            if self.on_dead is not None:
                self.on_dead(self.dead)
        finally:
            self._ended.set()

    def _step(self) -> bool:
        """One engine step; hands on the tokens that are due. Whether it handed any on."""
        start = time.perf_counter()
        updates = self.engine.step()
        now = time.perf_counter()
        handed_on = False
        for update in updates:
            stream = self._streams.get(update.seq.seq_id)
            if stream is None:
                continue
            stream.held += update.new_tokens
            due = stream.held and (stream.sent_at is None or now - stream.sent_at >= self.stream_interval)
            if update.finished or due:
                prompt_lps = None
                if update.seq.params.prompt_logprobs is not None and not stream.scored:
                    prompt_lps, stream.scored = prompt_logprob_entries(update.seq, self.engine.tokenizer), True
                cached = update.seq.num_cached_tokens
                stream.queue.put_nowait(Delta(stream.held, update.finish_reason, None, prompt_lps, cached))
                stream.held, stream.sent_at, handed_on = [], now, True
            if update.finished:
                del self._streams[update.seq.seq_id]
        if self.on_step is not None:
            self.on_step(now - start)
        return handed_on

    def _end_all(self, reason: str) -> None:
        for seq_id, stream in list(self._streams.items()):
            self.engine.abort(seq_id)
            stream.queue.put_nowait(Delta(stream.held, reason))
        self._streams.clear()


def _on_thread_of(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
