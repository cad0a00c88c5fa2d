"""Co-running processes: other cores kept busy while the profiler times layers, as the other
ranks of a local multi-process run keep them (on small VMs whose cores share physical ones, a
busy neighbour slows a process down)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp

# target(stop, running, ready, *args): a top-level function (spawned processes import it) that
# sets ``ready`` once started, then computes while ``running`` is set, until ``stop`` is set
CoRunTarget = Callable[..., None]


def decoder_co_runner(stop: Any, running: Any, ready: Any) -> None:
    """Keep one core busy, while ``running`` is set and until ``stop`` is set, with a small
    decoder's forward and backward. One thread."""
    from loom.model.zoo import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    llm = LlamaForCausalLM(LlamaConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                       intermediate_size=344))
    ids = torch.randint(0, 256, (4, 64))
    ready.set()
    while not stop.is_set():
        if running.wait(0.1):
            llm(input_ids=ids).float().mean().backward()


class CoRunners:
    """``count`` processes computing alongside the profiler, each running ``target(stop,
    running, ready, *args)`` (default: `decoder_co_runner`; the profiler passes one that runs
    its own passes on a copy of the profiled model, the closest stand-in for another rank of
    the same model). `pause` / `resume` idle them between passes."""

    def __init__(self, count: int, target: CoRunTarget = decoder_co_runner, args: Sequence[Any] = ()):
        if count < 0:
            raise ValueError(f"co_runners = {count}: use 0 or more processes")
        self.count, self.target, self.args = count, target, tuple(args)
        self.procs: list[Any] = []

    def __enter__(self) -> "CoRunners":
        if self.count > 0:
            ctx = mp.get_context("spawn")
            self.stop, self.running = ctx.Event(), ctx.Event()
            self.running.set()
            for _ in range(self.count):
                ready = ctx.Event()
                proc = ctx.Process(target=self.target, args=(self.stop, self.running, ready, *self.args), daemon=True)
                proc.start()
                if not ready.wait(300):
                    raise RuntimeError("a co-running process did not start within 300 s")
                self.procs.append(proc)
        return self

    def pause(self) -> None:
        if self.procs:
            self.running.clear()

    def resume(self) -> None:
        if self.procs:
            self.running.set()

    def __exit__(self, *exc: Any) -> None:
        if self.procs:
            self.stop.set()
            for proc in self.procs:
                proc.join(30)
                if proc.is_alive():
                    proc.terminate()
            self.procs = []
