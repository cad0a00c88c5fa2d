"""Measuring communication: message and all-reduce costs on two local gloo processes, with
the executor's own communicator (`loom.runtime.comm.P2PCommunicator`), so the fits
(`loom.cost.profile_comm.Communication`) include its header message and bookkeeping."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from loom.cost.profile_comm import Communication, fit_communication
from loom.profile.corun import CoRunners
from loom.runtime.comm import P2PCommunicator
from loom.runtime.local import host_cores, run_local


def compute_for(seconds: float) -> None:
    """Compute like a pipeline stage (small matmuls) for ``seconds``."""
    a, w = torch.randn(64, 128), torch.randn(128, 128)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ w


MESSAGE_SIZES = (0, 16_384, 262_144, 1_048_576, 4_194_304)


def early_receiver(comm: Any, rank: int, t: torch.Tensor, token: torch.Tensor, busy: bool) -> float:
    """Seconds from the end of rank 0's post of ``t`` to the end of rank 1's receive, which was
    already waiting: rank 1 waits in recv while rank 0 computes, then rank 0 posts and computes
    on (``busy``) or waits. Collective: both ranks call it, both get the figure."""
    dist.barrier()
    stamp = torch.zeros(2, dtype=torch.float64)
    if rank == 0:
        compute_for(0.002)
        comm.send(t, 1, tag=2)
        stamp[0] = time.perf_counter()  # CLOCK_MONOTONIC: one clock for both processes
        if busy:
            compute_for(0.006)
        comm.recv(1, tag=4)
        comm.wait_sends()
    elif rank == 1:
        comm.recv(0, tag=2)
        stamp[1] = time.perf_counter()
        comm.send(token, 0, tag=4)
        comm.wait_sends()
    dist.all_reduce(stamp)
    return float(stamp[1] - stamp[0])


def other_threads_cpu() -> float:
    """CPU seconds of this process outside the calling thread (gloo's loop thread)."""
    return time.process_time() - time.thread_time()


def thread_cpu_per_message(comm: Any, rank: int, t: torch.Tensor, count: int = 8) -> float:
    """The communicator threads' CPU seconds per message on this rank (rank 0 sending, rank 1
    receiving) over ``count`` messages of ``t``, sent one after another as a pipeline stage sends
    them (each send completed before the next; the closing barrier's share included).
    Collective: every rank of the group calls it."""
    dist.barrier()
    before = other_threads_cpu()
    for _ in range(count):
        if rank == 0:
            comm.send(t, 1, tag=5)
            comm.wait_sends()
        elif rank == 1:
            comm.recv(0, tag=5)
    dist.barrier()
    return (other_threads_cpu() - before) / count


def message_pass(comm: Any, rank: int, sizes: Sequence[int] = MESSAGE_SIZES, repeats: int = 2
                 ) -> dict[str, list[list[float]]]:
    """One measurement of every `Communication` quantity at every size, on ranks 0 and 1 of
    the default group, with ``comm`` the executor's `loom.runtime.comm.P2PCommunicator`.
    Returns ``{quantity: [[bytes, seconds], ...]}`` as this rank saw it (``latency`` and
    ``thread_send`` on rank 0, ``thread_recv`` on rank 1),
    ``repeats`` rows per size."""
    rows: dict[str, list[list[float]]] = {k: [] for k in ("send_post", "recv_ready", "latency", "recv_ready_idle",
                                                           "latency_idle", "all_reduce", "thread_send",
                                                           "thread_recv")}
    for nbytes in [n for n in sizes for _ in range(repeats)]:
        t = torch.randn(nbytes // 4)
        token = torch.zeros(1)
        for busy, suffix in ((True, ""), (False, "_idle")):
            # a late receiver: the sender posts, then computes on (``busy``, what a pipeline
            # stage does after a send) or waits for its next input; the receiver computes, then
            # receives
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                comm.send(t, 1, tag=1)
                if busy:
                    rows["send_post"].append([nbytes, time.perf_counter() - t0])
                    compute_for(0.004)
                comm.recv(1, tag=3)
                comm.wait_sends()
            elif rank == 1:
                compute_for(0.002)
                t0 = time.perf_counter()
                comm.recv(0, tag=1)
                rows["recv_ready" + suffix].append([nbytes, time.perf_counter() - t0])
                comm.send(token, 0, tag=3)
                comm.wait_sends()
            latency = early_receiver(comm, rank, t, token, busy)
            if rank == 0:
                rows["latency" + suffix].append([nbytes, latency])
        thread_s = thread_cpu_per_message(comm, rank, t)
        if rank in (0, 1):
            rows["thread_send" if rank == 0 else "thread_recv"].append([nbytes, thread_s])
        # a gradient bucket as the executor syncs it: 4 tensors flattened, summed, unflattened
        grads = [torch.randn(max(nbytes // 16, 1)) for _ in range(4)]
        dist.barrier()
        t0 = time.perf_counter()
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        _unflatten_dense_tensors(flat, grads)
        rows["all_reduce"].append([4 * max(nbytes // 16, 1) * 4, time.perf_counter() - t0])
    return rows


def full_host_pass(comm: Any, rank: int, sizes: Sequence[int] = MESSAGE_SIZES, repeats: int = 2
                   ) -> dict[str, list[list[float]]]:
    """``latency`` as `message_pass` measures it, under the name ``latency_full``: run while
    co-running processes keep the host's other cores computing (`measure_communication`)."""
    token = torch.zeros(1)
    rows: dict[str, list[list[float]]] = {"latency_full": []}
    for nbytes in [n for n in sizes for _ in range(repeats)]:
        latency = early_receiver(comm, rank, torch.randn(nbytes // 4), token, busy=True)
        if rank == 0:
            rows["latency_full"].append([nbytes, latency])
    return rows


def _comm_worker(rank: int, world_size: int, sizes: list[int], repeats: int, out_path: str,
                 full_host: bool = False) -> None:
    # the runtime's own communicator, so the fits include its header message and bookkeeping
    comm = P2PCommunicator(torch.device("cpu"))
    measure = full_host_pass if full_host else message_pass
    passes = [measure(comm, rank, sizes) for _ in range(repeats + 2)][2:]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, passes)
    if rank == 0:
        Path(out_path).write_text(json.dumps([p for g in gathered for p in g]))


def measure_communication(sizes: Sequence[int] = MESSAGE_SIZES, repeats: int = 9) -> Communication:
    """Message and all-reduce costs on two local gloo processes (one thread each), then the
    early receiver's latency again with the host's other cores computing; see
    `Communication`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        run_local(_comm_worker, 2, list(sizes), repeats, out, threads=1)
        passes = json.loads(Path(out).read_text())
        # the host full: the sender computes and co-runners keep every other core busy, so a
        # woken receiver waits for a core (`Communication.wake_delay`); on one core the sender
        # alone fills it, and ``latency`` already is that case
        co_runners = host_cores() - 1
        if co_runners > 0:
            with CoRunners(co_runners):
                run_local(_comm_worker, 2, list(sizes), repeats, out, True, threads=1)
            passes += json.loads(Path(out).read_text())
    return fit_communication(passes, world=2)

