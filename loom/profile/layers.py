"""Timing one layer on the device: forward, full backward and input-only backward, and the
bytes autograd saves for it (entrain.md §3.1: "profiles every layer separately").

Times are ``time.perf_counter`` with ``torch.cuda.synchronize`` around each call on a GPU.
Forwards run under the run's precision (``autocast``: `loom.runtime.precision.Precision.autocast`,
bf16 compute for ``run.dtype = "bf16"``), backwards outside it, as the runtime runs them.
``backward_input`` is ``torch.autograd.grad`` w.r.t. the layer's *input* only (autograd then
skips the weight-gradient kernels); the full backward is w.r.t. the input *and* the parameters,
and the profiler fits ``backward_weight`` as their difference. The autograd engine's fixed
per-call cost (`backward_call_overhead`) is measured so it can be taken off each layer's
backward: a stage runs one backward call for all its layers and the cost model adds it back
once.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from loom.cost.model import Workload
from loom.model.layers import Layer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Seconds ``fn`` takes on ``device`` (synchronised before and after), and its result."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def saved_bytes(fn: Callable[[], Any], exclude: set[int]) -> tuple[int, Any]:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs, except
    those in ``exclude`` (the layer's parameters)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            s = t.untyped_storage()
            if s.data_ptr() not in exclude:
                storages[s.data_ptr()] = s.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def backward_call_overhead(repeats: int = 50, device: torch.device | str = "cpu") -> float:
    """Seconds of one ``torch.autograd.grad`` call on a one-op graph: the engine's fixed cost,
    paid once per call. The profiler times each layer's backward as its own call, a stage runs
    one call for all its layers, so the profile subtracts it per layer and adds it per stage."""
    device = torch.device(device)
    x = torch.ones(1, device=device, requires_grad=True)
    g = torch.ones(1, device=device)
    times = []
    for r in range(repeats + 5):
        y = x * 2.0
        t, _ = timed(lambda: torch.autograd.grad(y, [x], g), device)
        if r >= 5:
            times.append(t)
    return statistics.median(times)


@dataclass
class LayerPoint:
    """One layer's measurement at one workload: lists of timed repeats, and fixed facts."""

    work: Workload
    saved: int = 0
    forward: list[float] = field(default_factory=list)
    backward_input: list[float] = field(default_factory=list)
    backward_full: list[float] = field(default_factory=list)
    # at the profiler's cold workload only: per pass, the seconds a call took more right after a
    # cache eviction than warm in the same pass (`loom.profile.profiler.Profiler._cold_pass`)
    cold_forward: list[float] = field(default_factory=list)
    cold_backward: list[float] = field(default_factory=list)


def measure_layer_once(layer: Layer, x_in: Any, ctx: dict[str, Any], params: list[torch.Tensor],
                       grad_out: torch.Tensor, device: torch.device,
                       autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                       ) -> tuple[float, float | None, float]:
    """One timed forward (on its own, warm, under ``autocast``), full backward (input and
    parameters) and input-only backward; the profiler keeps the two backwards."""
    has_input = is_float_tensor(x_in)
    wrt_all = ([x_in] if has_input else []) + params

    def forward() -> Any:
        with autocast():
            return layer(x_in, ctx)

    t_fwd, out = timed(forward, device)
    t_full, _ = timed(lambda: torch.autograd.grad(out, wrt_all, grad_out, allow_unused=True), device)
    t_inp = None
    if has_input:
        _, out = timed(forward, device)
        t_inp, _ = timed(lambda: torch.autograd.grad(out, [x_in], grad_out, allow_unused=True), device)
    return t_fwd, t_inp, t_full


def backward_by_layer(outputs: list[Any], run: Callable[[], Any]) -> list[float]:
    """Per layer of a chain whose layers' outputs are ``outputs`` (in order), the seconds of its
    part of one backward ``run`` through the chain: from the gradient of its output (the last
    layer: from the call) to that of its input (the first layer: to the return), read by hooks
    on the outputs. A layer whose input has no hook (not a float tensor) gets 0, its time going
    to the layer before it."""
    stamps: dict[int, float] = {}

    def stamp(i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:  # returns None: the gradient passes unchanged
            stamps.setdefault(i, time.perf_counter())
        return hook

    handles = [o.register_hook(stamp(i)) for i, o in enumerate(outputs[:-1]) if is_float_tensor(o) and o.requires_grad]
    t0 = time.perf_counter()
    run()
    t1 = time.perf_counter()
    for h in handles:
        h.remove()
    times, cursor = [0.0] * len(outputs), t0
    for i in reversed(range(len(outputs))):
        end = t1 if i == 0 else stamps.get(i - 1)
        if end is not None:
            times[i], cursor = end - cursor, end
    return times
