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
from loom.runtime.comm import P2PCommunicator
from loom.runtime.local import run_local


def compute_for(seconds: float) -> None:
    """Compute like a pipeline stage (small matmuls) for ``seconds``."""
    a, w = torch.randn(64, 128), torch.randn(128, 128)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ w


MESSAGE_SIZES = (0, 16_384, 262_144, 1_048_576, 4_194_304)


def message_pass(comm: Any, rank: int, sizes: Sequence[int] = MESSAGE_SIZES, repeats: int = 2
                 ) -> dict[str, list[list[float]]]:
    """One measurement of every `Communication` quantity at every size, on ranks 0 and 1 of
    the default group, with ``comm`` the executor's `loom.runtime.comm.P2PCommunicator`.
    Returns ``{quantity: [[bytes, seconds], ...]}`` as this rank saw it (``latency`` on rank 0),
    ``repeats`` rows per size."""
    rows: dict[str, list[list[float]]] = {k: [] for k in ("send_post", "recv_ready", "latency", "recv_ready_idle",
                                                           "latency_idle", "all_reduce")}
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
            # an early receiver: it waits in recv while the sender computes, then posts and
            # computes on or waits
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
            if rank == 0:
                rows["latency" + suffix].append([nbytes, float(stamp[1] - stamp[0])])
        # a gradient bucket as the executor syncs it: 4 tensors flattened, summed, unflattened
        grads = [torch.randn(max(nbytes // 16, 1)) for _ in range(4)]
        dist.barrier()
        t0 = time.perf_counter()
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        _unflatten_dense_tensors(flat, grads)
        rows["all_reduce"].append([4 * max(nbytes // 16, 1) * 4, time.perf_counter() - t0])
    return rows


def _comm_worker(rank: int, world_size: int, sizes: list[int], repeats: int, out_path: str) -> None:
    # the runtime's own communicator, so the fits include its header message and bookkeeping
    comm = P2PCommunicator(torch.device("cpu"))
    passes = [message_pass(comm, rank, sizes) for _ in range(repeats + 2)][2:]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, passes)
    if rank == 0:
        Path(out_path).write_text(json.dumps([p for g in gathered for p in g]))


def measure_communication(sizes: Sequence[int] = MESSAGE_SIZES, repeats: int = 9) -> Communication:
    """Message and all-reduce costs on two local gloo processes (one thread each); see
    `Communication`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        run_local(_comm_worker, 2, list(sizes), repeats, out, threads=1)
        passes = json.loads(Path(out).read_text())
    return fit_communication(passes, world=2)
