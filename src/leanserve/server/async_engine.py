"""One engine loop for many clients: LLMEngine steps run on a dedicated thread; requests from the asyncio
side join the running batch (continuous batching) and receive their tokens through per-request queues.

The loop never waits on a reader: it hands each step's tokens to the event loop with call_soon_threadsafe
and goes on. The HTTP side never blocks the loop: adding and aborting requests are messages it picks up
between steps.
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
from leanserve.sampling_params import SamplingParams

logger = logging.getLogger("leanserve")


@dataclass
class Delta:
    """New tokens of one request; `finish_reason` is set on its last delta ("stop", "length" or "abort")."""

    tokens: list[SampledToken]
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq_id: int | None = None  # set by the loop thread when the request is added


class EngineStopped(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step=None, on_dead=None) -> None:
        self.engine = engine
        self.on_step = on_step  # called on the loop thread after every step (metrics)
        self.on_dead = on_dead  # called on the loop thread with the reason if the engine cannot go on
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}
        self._stopping = False
        self.dead: str | None = None
        self._thread = threading.Thread(target=self._run, name="leanserve-engine", daemon=True)
        self._thread.start()

    # --- the asyncio side ---------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[Delta]:
        """Yields the request's tokens as they come; aborts the request if the caller stops iterating
        (a client that went away), so its cache slot is freed at once."""
        if self.dead or self._stopping:
            raise EngineStopped(self.dead or "the server is shutting down")
        # A bad request comes back from add_request as a ValueError naming the problem.
        stream = _Stream(asyncio.get_running_loop())
        reply: asyncio.Future = stream.loop.create_future()
        self._inbox.put(("add", prompt_token_ids, params, stream, reply))
        try:
            seq_id = await reply
        except asyncio.CancelledError:  # the client left before the loop took the request: undo the add
            self._inbox.put(("abort_stream", stream))
            raise
        if isinstance(seq_id, Exception):
            raise seq_id
        finished = False
        try:
            while True:
                delta: Delta = await stream.queue.get()
                if delta.error is not None:
                    raise EngineStopped(delta.error)
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        finally:
            if not finished:
                self._inbox.put(("abort", seq_id))

    def stop(self) -> None:
        """Ends every request (finish_reason "abort"), stops the loop thread and the engine's stages."""
        self._stopping = True
        self._inbox.put(("stop",))
        self._thread.join()  # the loop ends after its current step; the executor is not shared meanwhile
        self.engine.shutdown()

    # --- the loop thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                # Idle: block until a message arrives. Busy: take what has arrived and step.
                block = not self.engine.has_unfinished
                while True:
                    try:
                        msg = self._inbox.get(block=block, timeout=None if block else 0)
                    except queue.Empty:
                        break
                    if msg[0] == "stop":
                        self._end_all("abort")
                        self._refuse_pending("the server is shutting down")
                        return
                    self._handle(msg)
                    block = False
                if self.engine.has_unfinished:
                    self._step()
        except Exception as e:  # the engine cannot go on (e.g. a pipeline stage died): tell every request
            logger.exception("engine loop stopped")
            self.dead = f"the engine stopped: {e}"
            for stream in list(self._streams.values()):
                _post(stream.loop, stream.queue.put_nowait, Delta([], "abort", self.dead))
            self._streams.clear()
            self._refuse_pending(self.dead)
            if self.on_dead is not None:
                self.on_dead(self.dead)

    def _refuse_pending(self, reason: str) -> None:
        # Requests still in the inbox get an answer (EngineStopped) rather than waiting for ever.
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                stream, reply = msg[3], msg[4]
                _post(stream.loop, _resolve, reply, EngineStopped(reason))

    def _handle(self, msg) -> None:
        if msg[0] == "add":
            _, ids, params, stream, reply = msg
            try:
                seq_id = self.engine.add_request(ids, params)
            except ValueError as e:
                _post(stream.loop, _resolve, reply, e)
                return
            self._streams[seq_id] = stream
            stream.seq_id = seq_id
            _post(stream.loop, _resolve, reply, seq_id)
        elif msg[0] in ("abort", "abort_stream"):
            seq_id = msg[1] if msg[0] == "abort" else msg[1].seq_id
            if seq_id is not None and self._streams.pop(seq_id, None) is not None:
                self.engine.abort(seq_id)

    def _step(self) -> None:
        start = time.perf_counter()
        for update in self.engine.step():
            seq_id = update.seq.seq_id
            stream = self._streams.get(seq_id)
            if stream is None:
                continue
            _post(stream.loop, stream.queue.put_nowait, Delta(list(update.new_tokens), update.finish_reason))
            if update.finished:
                del self._streams[seq_id]
        if self.on_step is not None:
            self.on_step(time.perf_counter() - start)

    def _end_all(self, reason: str) -> None:
        for seq_id, stream in list(self._streams.items()):
            self.engine.abort(seq_id)
            _post(stream.loop, stream.queue.put_nowait, Delta([], reason))
        self._streams.clear()


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    # Hands a callback to the caller's event loop; a loop that has closed meanwhile has nobody to tell.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
