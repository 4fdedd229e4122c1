"""Point-to-point messages between pipeline stages, none of which waits on a stage's compute.

Two transports with one interface (`post_obj`, `post_streams`, `send_obj`, `recv_obj`, `recv_streams`,
`mailbox`): `PipeChannel` for stages on one machine that the engine spawned itself, `Channel` (gloo) for
stages on other machines (torchrun) or on GPUs.

`PipeChannel`: one OS pipe per direction and kind of message (control objects; streams), created by the
driver before it spawns the stages, each process holding only its own ends. A send is a write into the pipe's
kernel buffer (1 MiB where the system allows): it returns at once without any other thread having to run,
which matters when every core is busy computing (a gloo transfer needs the sender's I/O thread to be scheduled
once the receiver has posted its receive: a millisecond or more on a busy core); what a full pipe does not
take waits for a thread of the sender's own (`PipeSender`), so no send ever waits for its receiver. A receive
reads the bytes straight into its tensor. A peer that died closes its ends: reads see end-of-file, writes a
broken pipe, both raised as RuntimeError("Connection closed ...").

`Channel`: a process group of the engine's own (gloo; streams over nccl on CUDA). Gloo completes a send
only once the peer has posted the matching receive, so every send here is posted without waiting (`Outbox`
keeps each send's tensors alive until it completes), and a stage posts the receive of its next message
before it computes the current one (`Mailbox`), so the message lands while it works. A control object
travels in a frame of fixed size (its length, then its pickled bytes; the rest of a larger one follows in a
second message of exact size). Messages between two stages on one tag arrive in the order they were sent.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import select
import struct
import threading
import time
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


# --- one machine: OS pipes ---------------------------------------------------------------------------------
PIPE_BYTES = 1 << 20  # each pipe's kernel buffer, where the system allows it (Linux's default is 64 KiB)


class Links:
    """The pipe ends one process holds: obj_in / obj_out / data_in / data_out, each peer rank -> fd. Made by
    `Links.create` in the driver for every stage; a stage gets its own as a string (`encode` / `decode`)."""

    KINDS = ("obj_in", "obj_out", "data_in", "data_out")

    def __init__(self, fds: dict[str, dict[int, int]] | None = None) -> None:
        self.fds = fds or {k: {} for k in self.KINDS}

    @classmethod
    def create(cls, num_stages: int) -> list[Links]:
        """Every stage's ends: control objects between stage 0 and each other stage both ways, streams from each
        stage to the next."""
        links = [cls() for _ in range(num_stages)]

        def pipe(kind: str, src: int, dst: int) -> None:
            r, w = os.pipe()
            for fd in (r, w):
                _grow(fd)
            links[dst].fds[f"{kind}_in"][src] = r
            links[src].fds[f"{kind}_out"][dst] = w

        for rank in range(1, num_stages):
            pipe("obj", 0, rank)
            pipe("obj", rank, 0)
        for rank in range(num_stages - 1):
            pipe("data", rank, rank + 1)
        return links

    def all_fds(self) -> list[int]:
        return [fd for kind in self.KINDS for fd in self.fds[kind].values()]

    def close(self) -> None:
        for fd in self.all_fds():
            os.close(fd)
        self.fds = {k: {} for k in self.KINDS}

    def encode(self) -> str:
        return ",".join(f"{kind}:{peer}:{fd}" for kind in self.KINDS for peer, fd in self.fds[kind].items())

    @classmethod
    def decode(cls, text: str) -> Links:
        links = cls()
        for item in filter(None, text.split(",")):
            kind, peer, fd = item.split(":")
            links.fds[kind][int(peer)] = int(fd)
        return links


def _grow(fd: int) -> None:
    if hasattr(fcntl, "F_SETPIPE_SZ"):
        with contextlib.suppress(OSError):  # (above the system's pipe-max-size: keep the default)
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)


class PipeChannel:
    """Control objects and stream tensors over this process's pipe ends (`Links`)."""

    def __init__(self, links: Links) -> None:
        self.links = links
        self._senders: dict[int, PipeSender] = {}

    def _fd(self, kind: str, peer: int) -> int:
        try:
            return self.links.fds[kind][peer]
        except KeyError:
            raise RuntimeError(f"no {kind} pipe with stage {peer}") from None

    def close(self, wait_s: float = 1.0) -> None:
        """Closes this process's ends, once each sender's thread has finished (its reader is gone or has read
        everything; a thread left writing to a closed fd could write into whatever file takes its number)."""
        for sender in self._senders.values():
            sender.join(wait_s)
        self.links.close()

    def _sender(self, kind: str, peer: int) -> PipeSender:
        fd = self._fd(kind, peer)
        sender = self._senders.get(fd)
        if sender is None:
            sender = self._senders[fd] = PipeSender(fd, peer)
        return sender

    # --- sends: never wait for the receiver -------------------------------------------------------------
    def post_obj(self, obj: object, *dsts: int) -> None:
        payload = pickle.dumps(obj)
        message = memoryview(struct.pack("<q", len(payload)) + payload)
        for dst in dsts:
            self._sender("obj_out", dst).send(message)

    def post_streams(self, streams: torch.Tensor, dst: int) -> None:
        data = memoryview(_as_bytes(streams.contiguous()).numpy()).cast("B")
        self._sender("data_out", dst).send(memoryview(struct.pack("<q", data.nbytes)), data)

    def send_obj(self, obj: object, *dsts: int) -> None:
        """Posts and waits until it is all in the pipes (start-up and stop messages)."""
        self.post_obj(obj, *dsts)
        for dst in dsts:
            self._sender("obj_out", dst).flush()

    # --- receives ---------------------------------------------------------------------------------------
    def mailbox(self, src: int) -> PipeMailbox:
        return PipeMailbox(self._fd("obj_in", src), src)

    def recv_obj(self, src: int) -> object:
        return self.mailbox(src).take()

    def recv_streams(self, into: torch.Tensor, src: int) -> StreamsRead:
        return StreamsRead(self._fd("data_in", src), into, src)


class PipeSender:
    """Writes to one pipe without ever blocking its caller: what the pipe's buffer takes is written at once (the
    usual case: no other thread runs); the rest waits, in order, for a thread of this sender's own that writes it
    as the reader drains the pipe. So two stages that each send the other more than a pipe holds before reading
    cannot wait on each other. A broken pipe (the reader went away) is raised by the next send."""

    def __init__(self, fd: int, peer: int) -> None:
        os.set_blocking(fd, False)
        self.fd, self.peer = fd, peer
        self._pending: deque[memoryview] = deque()  # (only the thread takes from it, only send adds to it)
        self._cond = threading.Condition()
        self._error: RuntimeError | None = None
        self._thread: threading.Thread | None = None

    def send(self, *parts: memoryview) -> None:
        with self._cond:
            if self._error is not None:
                raise self._error
            rest = list(parts)
            while rest and not self._pending:
                try:
                    written = os.write(self.fd, rest[0])
                except BlockingIOError:
                    break
                except (BrokenPipeError, ConnectionResetError):
                    raise self._broken() from None
                rest[0] = rest[0][written:]
                if not rest[0].nbytes:
                    rest.pop(0)
            if not rest:
                return
            self._pending.extend(rest)
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name=f"leanserve-pipe-{self.peer}", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self) -> None:
        """Waits until everything sent is in the pipe."""
        with self._cond:
            while self._pending and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error

    def join(self, wait_s: float) -> None:
        """Waits up to wait_s for the thread (if any) to finish what is pending; stops it either way."""
        with self._cond:
            deadline = time.monotonic() + wait_s
            while self._pending and self._error is None and time.monotonic() < deadline:
                self._cond.wait(max(deadline - time.monotonic(), 0.0))
            self._error = self._error or RuntimeError(f"the pipe to stage {self.peer} is closed")
            self._pending.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(wait_s)

    def _broken(self) -> RuntimeError:
        return RuntimeError(f"Connection closed by stage {self.peer} (its pipe is broken)")

    def _drain(self) -> None:
        while True:
            with self._cond:
                while not self._pending and self._error is None:
                    self._cond.wait()
                if self._error is not None:
                    return
            with contextlib.suppress(OSError):  # (a closed fd: the next check ends the thread)
                select.select([], [self.fd], [], 0.1)
            with self._cond:  # (the write itself never blocks: under the lock, join cannot close in between)
                if self._error is not None:
                    return
                part = self._pending[0]
                try:
                    written = os.write(self.fd, part)
                except BlockingIOError:
                    continue
                except OSError:
                    self._error = self._broken()
                    self._pending.clear()
                    self._cond.notify_all()
                    return
                if written < part.nbytes:
                    self._pending[0] = part[written:]
                else:
                    self._pending.popleft()
                    self._cond.notify_all()


class PipeMailbox:
    """The next control object from one peer: `take()` reads it (waiting if it has not come), `ready()` says
    whether it has begun to arrive."""

    def __init__(self, fd: int, src: int) -> None:
        self.fd, self.src = fd, src

    def ready(self) -> bool:
        return bool(select.select([self.fd], [], [], 0)[0])

    def take(self, post_next: bool = True) -> object:  # (post_next: Mailbox's; a pipe needs no posted receive)
        size = struct.unpack("<q", _read(self.fd, 8, self.src))[0]
        return pickle.loads(_read(self.fd, size, self.src))


class StreamsRead:
    """A step's streams, read into `into` on `wait()` (until then they wait in the pipe)."""

    def __init__(self, fd: int, into: torch.Tensor, src: int) -> None:
        self.fd, self.into, self.src = fd, into, src

    def wait(self) -> None:
        size = struct.unpack("<q", _read(self.fd, 8, self.src))[0]
        view = memoryview(_as_bytes(self.into).numpy()).cast("B")
        if size != view.nbytes:
            raise RuntimeError(f"stage {self.src} sent {size} bytes of streams where {view.nbytes} were expected")
        _read_into(self.fd, view, self.src)


def _read(fd: int, size: int, peer: int) -> bytes:
    buf = bytearray(size)
    _read_into(fd, memoryview(buf), peer)
    return bytes(buf)


def _read_into(fd: int, view: memoryview, peer: int) -> None:
    while view.nbytes:
        n = os.readv(fd, [view])
        if n == 0:
            raise RuntimeError(f"Connection closed by stage {peer} (end of its pipe)")
        view = view[n:]
