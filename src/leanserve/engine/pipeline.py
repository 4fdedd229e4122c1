"""Pipeline parallelism: stage processes, the step's messages between them, and their launch.

Stage 0 lives in the user's process and owns the scheduler and tokenizer. To launch a micro-batch it posts
the StepPlan to every other stage, runs its own layers and posts the residual streams to stage 1; stage i
takes the streams from stage i-1 and posts its own to i+1; the last stage samples and posts the tokens back
to stage 0. With overlap up to N micro-batches (disjoint sets of requests) are in flight at once, and every
stage works on one while the next one's messages land (engine/channel.py): nothing a stage sends or receives
waits on its compute. Stages the driver spawned on this machine (CPU) talk over pipes it made for them;
under torchrun, or on GPUs, messages go over a process group of the engine's own, built from a TCP store.
Either way two engines in one process or on one machine never share state.

Launch: on one machine the driver starts a TCP store on a free port and spawns the other stages as
processes running this module's main(); under `torchrun` every rank runs the same program and rendezvous
is env:// (MASTER_ADDR/MASTER_PORT), rank r being stage r.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from leanserve.engine.channel import Channel, Links, PipeChannel
from leanserve.engine.config import EngineConfig
from leanserve.engine.runner import IntermediateStreams, SeqOutput, StageInfo, StageRunner, StepPlan
from leanserve.engine.topology import PipelineTopology
from leanserve.errors import StageFailure
from leanserve.model.config import ModelConfig

logger = logging.getLogger("leanserve")

# An idle server may wait a long time for its next step; the process group must not time out meanwhile.
_OP_TIMEOUT = datetime.timedelta(days=3650)
_START_TIMEOUT_S = 300.0  # for every stage process to start and reach the rendezvous
_PEER_LOST = 75  # a stage's exit code when it stops because another stage went away


@dataclass(frozen=True)
class LaunchSpec:
    """What the driver hands every other stage at start-up."""

    config: EngineConfig
    model_config: ModelConfig
    topology: PipelineTopology
    dtype: str
    max_model_len: int
    num_threads: int
    num_blocks: int | None = None  # the paged pools' blocks, the same on every stage (engine/kv_budget.py)


@dataclass(frozen=True)
class StageError:
    stage: int
    message: str


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Report:
    """Asks every stage for the seconds it has spent computing so far (answered through the store, under
    `key`/<rank>, once the stage has finished every micro-batch launched before it)."""

    key: str


def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ)


def stage_device(device: str, stage: int) -> str:
    """Stage r's device: the CPU, or its own GPU on CUDA (LOCAL_RANK under torchrun)."""
    if not device.startswith("cuda") or ":" in device:
        return device
    local = int(os.environ.get("LOCAL_RANK", stage))
    return f"cuda:{local % max(torch.cuda.device_count(), 1)}"


# --- the driver (stage 0) -----------------------------------------------------------------------------
class PipelineDriver:
    """Stage 0 of an N-stage pipeline, in the user's process."""

    def __init__(
        self,
        spec: LaunchSpec,
        progress: bool = True,
    ) -> None:
        self.spec, self.topology = spec, spec.topology
        self.num_stages = n = spec.topology.num_stages
        self.procs: dict[int, subprocess.Popen] = {}
        self.dead: str | None = None
        self._pipes: PipeChannel | None = None  # the channel over this process's pipe ends, when stages use pipes
        if in_torchrun():
            store, rank, world = _env_rendezvous()
            if world != n or rank != 0:
                raise StageFailure(f"torchrun started {world} processes but pipeline_parallel_size is {n}.")
            store.set("leanserve/launch", pickle.dumps(spec))
        else:
            store = dist.TCPStore(
                "127.0.0.1", 0, n, is_master=True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=_START_TIMEOUT_S),
            )  # fmt: skip
            store.set("leanserve/launch", pickle.dumps(spec))
            self._spawn(store.port, _uses_pipes(spec.config.device))
        self._finalizer = weakref.finalize(self, _terminate, list(self.procs.values()))
        try:
            self._wait_for_stages(store)
            device = stage_device(spec.config.device, 0)
            self.channel = self._pipes or Channel(store, 0, n, device, _OP_TIMEOUT)
            self.runner = StageRunner(
                spec.model_config, spec.config, self.topology.layout(0), getattr(torch, spec.dtype),
                spec.max_model_len, progress=progress, device=device, num_blocks=spec.num_blocks,
            )  # fmt: skip
            self.runner.warmup()
            self.infos = [self.runner.info()] + [self._expect_info(r) for r in range(1, n)]
        except BaseException:
            self.shutdown(graceful=False)
            raise
        self.store = store  # the TCP store (on stage 0, its server) lives as long as the engine
        # The last stage's tokens, in launch order, each one's receive posted before it is needed.
        self.mailbox = self.channel.mailbox(n - 1)
        self._reports = 0

    def _spawn(self, port: int, pipes: bool) -> None:
        links = Links.create(self.num_stages) if pipes else None
        try:
            self._spawn_stages(port, links)
        finally:
            for stage_links in (links or [])[1:]:  # (a stage's ends stay open in that stage alone: its death
                stage_links.close()  # is then the end of its pipes)
        self._pipes = PipeChannel(links[0]) if links else None

    def _spawn_stages(self, port: int, links: list[Links] | None) -> None:
        for rank in range(1, self.num_stages):
            # Run through -c, not -m, so this module is imported once under its own name (pickled classes match).
            entry = "import sys; from leanserve.engine.pipeline import main; sys.exit(main())"
            cmd = [sys.executable, "-c", entry, "--port", str(port), "--rank", str(rank)]
            cmd += ["--world-size", str(self.num_stages), "--parent-pid", str(os.getpid())]
            fds = () if links is None else links[rank].all_fds()
            if links is not None:
                cmd += ["--links", links[rank].encode()]
            self.procs[rank] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=fds)

    def _wait_for_stages(self, store: dist.Store) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        pending = set(range(1, self.num_stages))
        while pending:
            for rank in sorted(pending):
                if store.check([f"leanserve/hello/{rank}"]):
                    pending.discard(rank)
                elif rank in self.procs and self.procs[rank].poll() is not None:
                    raise StageFailure(
                        f"pipeline stage {rank} exited during start-up ({_describe_exit(self.procs[rank].returncode)})."
                    )
            if pending and time.monotonic() > deadline:
                raise StageFailure(
                    f"pipeline stage(s) {sorted(pending)} did not start within {_START_TIMEOUT_S:.0f} s."
                )
            if pending:
                time.sleep(0.01)

    def _expect_info(self, rank: int) -> StageInfo:
        try:
            msg = self.channel.recv_obj(rank)
        except RuntimeError as e:
            raise self._failed(rank, e) from None
        if isinstance(msg, StageError):
            raise StageFailure(f"pipeline stage {msg.stage} failed to start: {msg.message}")
        assert isinstance(msg, StageInfo)
        return msg

    # --- the step -----------------------------------------------------------------------------------
    def launch(self, plan: StepPlan) -> None:
        """Starts a micro-batch: posts the plan to every stage, runs stage 0's layers, posts the streams to
        stage 1, and returns without waiting for the other stages (`collect` returns its tokens)."""
        if self.dead:
            raise StageFailure(self.dead)
        try:
            try:
                self.channel.post_obj(plan, *range(1, self.num_stages))
            except RuntimeError as e:
                raise self._failed(1, e) from None
            out = self.runner.execute(plan)
            try:
                self.channel.post_streams(out.streams, 1)
            except RuntimeError as e:
                raise self._failed(1, e) from None
        except StageFailure:
            raise
        except BaseException as e:
            # Stage 0 failed or was interrupted mid-step: the other stages are mid-step too, so the pipeline
            # is out of step and cannot go on. Stop it rather than let a later step read a stale message.
            self.dead = f"pipeline stage 0 stopped mid-step ({type(e).__name__}: {e}); the engine has stopped."
            self.shutdown(graceful=False)
            raise

    def collect(self) -> dict[int, SeqOutput]:
        """The tokens of the oldest micro-batch in flight (waits for them)."""
        if self.dead:
            raise StageFailure(self.dead)
        try:
            out = self.mailbox.take()
        except RuntimeError as e:
            raise self._failed(self.num_stages - 1, e) from None
        except BaseException as e:  # interrupted while waiting: the pipeline is out of step
            self.dead = f"pipeline stage 0 stopped mid-step ({type(e).__name__}: {e}); the engine has stopped."
            self.shutdown(graceful=False)
            raise
        return out

    def stage_busy_s(self) -> list[float]:
        """Seconds each stage has spent computing so far, first to last (the others' once they have finished
        every micro-batch launched before this call)."""
        if self.dead:
            raise StageFailure(self.dead)
        self._reports += 1
        key = f"leanserve/busy/{self._reports}"
        try:
            self.channel.post_obj(Report(key), *range(1, self.num_stages))
        except RuntimeError as e:
            raise self._failed(1, e) from None
        others = []
        for r in range(1, self.num_stages):
            others.append(float(self.store.get(f"{key}/{r}")))
            self.store.delete_key(f"{key}/{r}")
        return [self.runner.busy_s, *others]

    def _failed(self, peer: int, error: Exception) -> StageFailure:
        """Names the stage that died (the first whose exit was not caused by another's), stops the rest."""
        culprit, how = peer, f"lost contact ({error})"
        deadline = time.monotonic() + 5.0
        while self.procs and time.monotonic() < deadline:
            codes = {r: p.poll() for r, p in self.procs.items()}
            first = [r for r, c in sorted(codes.items()) if c is not None and c != _PEER_LOST]
            if first:
                culprit, how = first[0], _describe_exit(codes[first[0]])
                break
            time.sleep(0.05)
        self.dead = f"pipeline stage {culprit} died ({how}); the engine has stopped."
        self.shutdown(graceful=False)
        return StageFailure(self.dead)

    def shutdown(self, graceful: bool = True) -> None:
        if graceful and not self.dead and hasattr(self, "channel"):
            with contextlib.suppress(RuntimeError):
                self.channel.send_obj(Stop(), *range(1, self.num_stages))
        _terminate(list(self.procs.values()), wait_s=10.0 if graceful else 0.0)
        self._finalizer.detach()
        if self._pipes is not None:
            self._pipes.close()


def _terminate(procs: list[subprocess.Popen], wait_s: float = 0.0) -> None:
    """Waits up to wait_s for the stage processes to exit, then kills what is left (no orphans)."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(deadline - time.monotonic(), 0.0))
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _env_rendezvous() -> tuple[dist.Store, int, int]:
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=_START_TIMEOUT_S)))
    return dist.PrefixStore(f"leanserve/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}", store), rank, world


# --- the other stages ---------------------------------------------------------------------------------
def _uses_pipes(device: str) -> bool:
    """Whether spawned stages talk over pipes: on the CPU (GPU stages' streams go over NCCL)."""
    return not device.startswith("cuda")


def run_stage(store: dist.Store, rank: int, world: int, links: Links | None = None) -> int:
    """Serves stage `rank` until stage 0 says stop (0) or goes away (_PEER_LOST); a failure of its own exits 1.
    `links`: its pipe ends, when the driver spawned it with pipes (else the stages build a gloo channel)."""
    spec: LaunchSpec = pickle.loads(store.get("leanserve/launch"))
    torch.set_num_threads(spec.num_threads)
    device = stage_device(spec.config.device, rank)
    store.set(f"leanserve/hello/{rank}", str(os.getpid()))
    channel = PipeChannel(links) if links is not None else Channel(store, rank, world, device, _OP_TIMEOUT)
    layout = spec.topology.layout(rank)
    try:
        runner = StageRunner(
            spec.model_config, spec.config, layout, getattr(torch, spec.dtype), spec.max_model_len,
            progress=False, device=device, num_blocks=spec.num_blocks,
        )  # fmt: skip
        runner.warmup()
    except Exception as e:
        channel.send_obj(StageError(rank, f"{type(e).__name__}: {e}"), 0)
        return 1
    # The next plan's receive is posted before this one computes (Mailbox); when it has arrived by then, its
    # streams' receive is posted too, into the other receive buffer (one per micro-batch in flight), so they
    # land while this stage works.
    buffers, count = spec.config.micro_batches, 0

    def next_step(plans):
        nonlocal count
        msg = plans.take()
        if isinstance(msg, Stop | Report):
            return msg
        into = runner.streams_buffer(count % buffers, msg.num_tokens)
        count += 1
        return msg, into, channel.recv_streams(into, rank - 1)

    try:
        channel.send_obj(runner.info(), 0)
        plans = channel.mailbox(0)
        ahead = None
        while True:
            msg, ahead = ahead or next_step(plans), None
            if isinstance(msg, Stop):
                return 0
            if isinstance(msg, Report):
                store.set(f"{msg.key}/{rank}", json.dumps(runner.busy_s))
                continue
            plan, streams, work = msg
            work.wait()
            if buffers > 1 and plans.ready():
                ahead = next_step(plans)
            out = runner.execute(plan, IntermediateStreams(streams))
            if layout.is_last:
                channel.post_obj(out, 0)
            else:  # (a fresh tensor: the receive buffer takes another micro-batch's streams next)
                channel.post_streams(out.streams, rank + 1)
    except RuntimeError as e:
        if "Connection closed" in str(e) or "Socket" in str(e) or "Connection reset" in str(e):
            print(f"leanserve: pipeline stage {rank}: another stage went away; stopping.", file=sys.stderr)
            return _PEER_LOST
        raise


def serve_torchrun_stage() -> int:
    """On a torchrun rank other than 0: serve that stage until stage 0 stops; returns the exit code."""
    store, rank, world = _env_rendezvous()
    return run_stage(store, rank, world)


def torchrun_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _watch_parent(parent_pid: int) -> None:
    # A stage spawned by the driver exits when the driver's process is gone, whatever state it is in.
    while True:
        if os.getppid() != parent_pid:
            os._exit(_PEER_LOST)
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one leanserve pipeline stage (started by the engine itself)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--links", default=None, help="this stage's pipe ends (kind:peer:fd,...), set by the driver")
    args = p.parse_args(argv)
    if args.parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    store = dist.TCPStore(
        args.host, args.port, args.world_size, is_master=False, timeout=datetime.timedelta(seconds=_START_TIMEOUT_S)
    )
    try:
        return run_stage(store, args.rank, args.world_size, Links.decode(args.links) if args.links else None)
    except Exception:
        traceback.print_exc()
        print(f"leanserve: pipeline stage {args.rank} failed.", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
