"""Run a function on several local gloo processes: for tests, benchmarks and notebooks.

Production runs start with ``torchrun`` (`loom train`); this is the in-Python equivalent on
one machine, used wherever a parent process must compare what the ranks computed (the
reference-semantics tests) or drive several process groups at once (benchmarks). Each worker
runs ``fn(rank, world_size, *args)`` after the gloo group is up, with ``threads`` intra-op
threads (one by default, as on a 2-core machine shared by several ranks).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def host_cores() -> int:
    """The cores this process (and the local ranks it starts) may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, threads: int, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_local(fn: Callable, world_size: int, *args: Any, threads: int = 1) -> None:
    """Run ``fn`` on ``world_size`` fresh spawned gloo processes and wait; raises if any fails."""
    mp.spawn(_entry, args=(world_size, free_port(), threads, fn, args), nprocs=world_size, join=True)


def start_local(fn: Callable, world_size: int, *args: Any, threads: int = 1) -> list[mp.Process]:
    """Start ``fn`` on ``world_size`` spawned gloo processes with a port and group of their own,
    without waiting, so several groups can take turns (driven through spawn-context queues)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(rank, world_size, port, threads, fn, args), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    return procs
