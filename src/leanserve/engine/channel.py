"""Point-to-point messages between pipeline stages, none of which blocks a stage's compute.

A `Channel` is a process group of the engine's own (gloo; streams over nccl on CUDA). Gloo completes a send
only once the peer has posted the matching receive, so every send here is posted without waiting (`Outbox`
keeps each send's tensors alive until it completes) and every stage receives on a thread of its own
(`Inbox`), which posts the next receive as soon as the previous one lands, while the stage computes.
Messages between two stages on one tag arrive in the order they were sent.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

_OBJ_TAG, _DATA_TAG = 1, 2


class Channel:
    """Pickled control objects and stream tensors on a process group."""

    def __init__(self, store: dist.Store, rank: int, world: int, device: str, timeout) -> None:
        self.rank, self.world = rank, world
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("leanserve/gloo", store), rank, world, timeout)
        self.data_pg = self.pg
        if device.startswith("cuda"):  # pragma: no cover - needs GPUs
            self.data_pg = dist.ProcessGroupNCCL(dist.PrefixStore("leanserve/nccl", store), rank, world)
        self.outbox = Outbox()

    # --- sends: posted, not waited for -------------------------------------------------------------------
    def post_obj(self, obj: object, *dsts: int) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        for dst in dsts:
            self.outbox.add(self.pg.send([size], dst, _OBJ_TAG), size)
            self.outbox.add(self.pg.send([payload], dst, _OBJ_TAG), payload)

    def post_streams(self, streams: torch.Tensor, dst: int) -> None:
        data = _as_bytes(streams.contiguous())
        self.outbox.add(self.data_pg.send([data], dst, _DATA_TAG), data)

    def send_obj(self, obj: object, *dsts: int) -> None:
        """Posts and waits until every peer has taken it (start-up and stop messages)."""
        self.post_obj(obj, *dsts)
        self.outbox.flush()

    # --- receives: blocking (an Inbox thread calls them) ------------------------------------------------
    def recv_obj(self, src: int) -> object:
        size = torch.empty(1, dtype=torch.int64)
        self.pg.recv([size], src, _OBJ_TAG).wait()
        payload = torch.empty(int(size), dtype=torch.uint8)
        self.pg.recv([payload], src, _OBJ_TAG).wait()
        return pickle.loads(payload.numpy().tobytes())

    def recv_streams(self, into: torch.Tensor, src: int) -> torch.Tensor:
        self.data_pg.recv([_as_bytes(into)], src, _DATA_TAG).wait()
        return into


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # Gloo moves bytes; viewing as uint8 lets any dtype (bf16 included) travel unchanged.
    return t if t.is_cuda else t.view(torch.uint8)


class Outbox:
    """Posted sends whose peers have not taken them yet, each with the tensors it reads. Completed ones are
    dropped as new ones come; `flush` waits for all. A send that failed raises RuntimeError from here."""

    def __init__(self) -> None:
        self._pending: deque[tuple[object, torch.Tensor]] = deque()

    def add(self, work, tensor: torch.Tensor) -> None:
        self._pending.append((work, tensor))
        while self._pending and self._pending[0][0].is_completed():
            work, _ = self._pending.popleft()
            work.wait()  # (returns at once; raises if the send failed)

    def flush(self) -> None:
        while self._pending:
            work, _ = self._pending.popleft()
            work.wait()

    def __len__(self) -> int:
        return len(self._pending)


class Inbox:
    """A thread that receives messages one after another (`receive()` returns the next one, or raises to end
    the thread) and queues them; `get` hands them over in order, raising what the thread raised when the
    connection failed. `end(item)` returns True for the message after which the thread stops."""

    def __init__(self, receive: Callable[[], object], end: Callable[[object], bool], name: str) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._receive, self._end = receive, end
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                item = self._receive()
            except BaseException as e:  # the peer went away (or the receive failed): the reader re-raises it
                self._queue.put(_Failed(e))
                return
            self._queue.put(item)
            if self._end(item):
                return

    def get(self) -> object:
        item = self._queue.get()
        if isinstance(item, _Failed):
            self._queue.put(item)  # every later get raises too
            raise item.error
        return item

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error
