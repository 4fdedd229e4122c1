"""Point-to-point messages between pipeline stages, none of which waits on a stage's compute.

A `Channel` is a process group of the engine's own (gloo; streams over nccl on CUDA). Gloo completes a send
only once the peer has posted the matching receive, so every send here is posted without waiting (`Outbox`
keeps each send's tensors alive until it completes), and a stage posts the receive of its next message
before it computes the current one (`Mailbox`), so the message lands while it works. A control object
travels in a frame of fixed size (its length, then its pickled bytes; the rest of a larger one follows in a
second message of exact size). Messages between two stages on one tag arrive in the order they were sent.
"""

from __future__ import annotations

import pickle
from collections import deque

import torch
import torch.distributed as dist

_OBJ_TAG, _DATA_TAG = 1, 2


FRAME_BYTES = 1 << 16  # a control object's first message: 8 bytes of length, then up to this much pickle


class Channel:
    """Pickled control objects and stream tensors on a process group."""

    def __init__(self, store: dist.Store, rank: int, world: int, device: str, timeout) -> None:
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("leanserve/gloo", store), rank, world, timeout)
        self.data_pg = self.pg
        if device.startswith("cuda"):  # pragma: no cover - needs GPUs
            self.data_pg = dist.ProcessGroupNCCL(dist.PrefixStore("leanserve/nccl", store), rank, world)
        self.outbox = Outbox()

    # --- sends: posted, not waited for -------------------------------------------------------------------
    def post_obj(self, obj: object, *dsts: int) -> None:
        payload = pickle.dumps(obj)
        frame = torch.empty(FRAME_BYTES + 8, dtype=torch.uint8)  # (bytes past the payload are not read)
        frame[:8].view(torch.int64)[0] = len(payload)
        head = min(len(payload), FRAME_BYTES)
        frame[8 : 8 + head] = torch.frombuffer(bytearray(payload[:head]), dtype=torch.uint8)
        tail = torch.frombuffer(bytearray(payload[head:]), dtype=torch.uint8) if len(payload) > head else None
        for dst in dsts:
            self.outbox.add(self.pg.send([frame], dst, _OBJ_TAG), frame)
            if tail is not None:
                self.outbox.add(self.pg.send([tail], dst, _OBJ_TAG), tail)

    def post_streams(self, streams: torch.Tensor, dst: int) -> None:
        data = _as_bytes(streams.contiguous())
        self.outbox.add(self.data_pg.send([data], dst, _DATA_TAG), data)

    def send_obj(self, obj: object, *dsts: int) -> None:
        """Posts and waits until every peer has taken it (start-up and stop messages)."""
        self.post_obj(obj, *dsts)
        self.outbox.flush()

    # --- receives -------------------------------------------------------------------------------------
    def mailbox(self, src: int) -> Mailbox:
        return Mailbox(self, src)

    def recv_obj(self, src: int) -> object:
        """One control object, waited for (start-up)."""
        return self.mailbox(src).take(post_next=False)

    def recv_streams(self, into: torch.Tensor, src: int):
        """Posts the receive of a step's streams into `into`; `.wait()` on the result waits for them."""
        return self.data_pg.recv([_as_bytes(into)], src, _DATA_TAG)


class Mailbox:
    """The next control object from one peer, its receive posted ahead: `take()` waits for it and posts the
    receive of the one after. A failed receive (the peer went away) raises RuntimeError."""

    def __init__(self, channel: Channel, src: int) -> None:
        self.channel, self.src = channel, src
        self._post()

    def _post(self) -> None:
        self._frame = torch.empty(FRAME_BYTES + 8, dtype=torch.uint8)
        self._work = self.channel.pg.recv([self._frame], self.src, _OBJ_TAG)

    def ready(self) -> bool:
        """Whether the next object has arrived (take() would not wait for it)."""
        return self._work.is_completed()

    def take(self, post_next: bool = True) -> object:
        self._work.wait()
        frame = self._frame
        size = int(frame[:8].view(torch.int64)[0])
        payload = frame[8 : 8 + min(size, FRAME_BYTES)].numpy().tobytes()
        if size > FRAME_BYTES:
            tail = torch.empty(size - FRAME_BYTES, dtype=torch.uint8)
            self.channel.pg.recv([tail], self.src, _OBJ_TAG).wait()
            payload += tail.numpy().tobytes()
        if post_next:
            self._post()
        return pickle.loads(payload)


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
