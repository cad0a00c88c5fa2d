"""The profiler's measuring run (`loom profile`; entrain.md §3.1): `Profiler` and
`profile_model`.

Every layer is measured on its real input at each synthetic workload (`loom.profile.inputs`;
the module's context and the layers before it are run once to produce it). Measurements are
taken in *passes* (every workload and layer timed once per pass, `loom.profile.layers`) and a
point is the median over passes, so a burst of load elsewhere on the machine hits one pass of
every layer rather than every repeat of one layer. `Profiler.profile` fits the points
(`loom.cost.profile_fit`) into the file `loom.cost` reads (`loom.cost.profile_file.Profile`).

Precision: ``dtype`` is the run's ``run.dtype``; under ``"bf16"`` every forward (layers, loss)
runs under the runtime's autocast (`loom.runtime.precision.Precision`: bf16 GEMMs on fp32
master weights) and the matmul rate is measured in bf16, so a bf16 run is priced from bf16
layers; the profile records its ``dtype`` and `loom.cost.profile_file.load_profile_for`
refuses it for a run of another.
"""

from __future__ import annotations

import copy
import gc
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from loom.cost.model import Workload
from loom.cost.profile_comm import Communication
from loom.cost.profile_file import LayerProfile, Profile, model_signature, signature_hash
from loom.cost.profile_fit import FEATURES, fit_cost
from loom.data.sample import Batch
from loom.model.layers import Layer
from loom.model.multimodal import IGNORE_INDEX, MultimodalModel, loss_sum
from loom.plan.plan import LLM
from loom.profile.comm import measure_communication
from loom.profile.corun import CoRunners
from loom.profile.inputs import module_workloads
from loom.profile.layers import (
    LayerPoint,
    backward_call_overhead,
    backward_by_layer,
    is_float_tensor,
    measure_layer_once,
    saved_bytes,
    timed,
)
from loom.profile.optimizer import OptimizerBench, evict_caches, eviction_buffer, parameter_shape_groups
from loom.runtime.precision import DTYPES, Precision

DEFAULT_TOKEN_COUNTS = (64, 128, 256, 512, 1024)
MIN_TOKENS = 4


def check_settings(token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS, repeats: int = 1, warmup: int = 0,
                   device: torch.device | str = "cpu", threads: int | None = 1, co_runners: int = 0,
                   dtype: str = "fp32") -> None:
    """Raise `ValueError` naming the first argument of `profile_model` outside its valid range
    (see there) and the fix; nothing is measured or built."""
    def whole(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    counts = list(token_counts) if not isinstance(token_counts, (str, bytes)) else None
    if not counts or not all(whole(t) for t in counts):
        raise ValueError(f"token_counts = {token_counts!r}: give one or more whole token counts, e.g. (64, 256, 1024)")
    small = [t for t in counts if t < MIN_TOKENS]
    if small:
        raise ValueError(f"token_counts = {list(counts)}: {small} below {MIN_TOKENS}; use token counts of at least "
                         f"{MIN_TOKENS}")
    if not whole(repeats) or repeats < 1:
        raise ValueError(f"repeats = {repeats!r}: use 1 or more timed passes")
    if not whole(warmup) or warmup < 0:
        raise ValueError(f"warmup = {warmup!r}: use 0 or more untimed passes")
    if threads is not None and (not whole(threads) or threads < 1):
        raise ValueError(f"threads = {threads!r}: use 1 or more threads (or None to keep torch's setting)")
    if not whole(co_runners) or co_runners < 0:
        raise ValueError(f"co_runners = {co_runners!r}: use 0 or more co-running processes")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device = {device!r}: the profiler runs on 'cpu' or 'cuda'") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device = {device!r}: the profiler runs on 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device = {device!r}, but CUDA is not available on this machine; use 'cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device = {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                         f"use an index below that")
    if dtype not in DTYPES:
        raise ValueError(f"dtype = {dtype!r}: the run's precision (run.dtype) is one of {list(DTYPES)}")
    try:
        Precision(dtype, dev.type)  # bf16 on a CUDA device without it
    except ValueError as e:
        raise ValueError(f"dtype = {dtype!r}: {e}") from None


def profiler_co_runner(stop: Any, running: Any, ready: Any, model: MultimodalModel,
                       token_counts: Sequence[int], dtype: str = "fp32") -> None:
    """A `CoRunners` target: the profiler's own passes over a copy of ``model`` (results
    discarded), the work another rank of the same model does, one thread."""
    torch.set_num_threads(1)
    model = copy.deepcopy(model)  # private weights, as another rank has (not the parent's shared pages)
    with Profiler(model, token_counts, threads=1, co_runners=0, seed=1, dtype=dtype) as prof:
        ready.set()
        while not stop.is_set():
            if running.wait(0.1):
                prof.run_pass(keep=False, until=lambda: not running.is_set() or stop.is_set())


def device_description(device: torch.device) -> dict[str, Any]:
    d = {"kind": device.type, "threads": torch.get_num_threads(), "torch": torch.__version__.split("+")[0],
         "machine": platform.machine(), "cpus": os.cpu_count()}
    if device.type == "cuda":
        d["name"] = torch.cuda.get_device_name(device)
    else:
        d["name"] = platform.processor() or platform.machine()
    return d


@dataclass
class _ModuleState:
    name: str
    layers: list[Layer]
    params: list[list[torch.Tensor]]
    works: list[Workload]
    prepared: list[tuple[Batch, dict[str, Any], list[Any], list[torch.Tensor], torch.Tensor | None]]
    points: list[list[LayerPoint]]
    widths: list[int]
    ctx_times: list[list[float]]
    loss_times: list[tuple[list[float], list[float]]]


def label_count(batch: Batch) -> int:
    """The tokens the LLM loss averages over (at least 1)."""
    return max(int((batch.labels != IGNORE_INDEX).sum()), 1)


def cold_at(works: Sequence[Workload]) -> int:
    """The workload the cold start is timed at: the middle one (the extra is mostly the layer's
    weights coming in, which do not depend on the workload)."""
    return len(works) // 2


class Profiler:
    """Measures a model pass by pass, so the passes can be spread over time (a benchmark runs
    them between its real runs, and both then sample the same machine).

        with Profiler(model, co_runners=1) as prof:
            for r in range(6):
                prof.run_pass(keep=r > 0)
            profile = prof.profile()

    Each pass times every (module, workload, layer) once (forward, full backward, input-only
    backward), the context builds, the LLM loss, the autograd call cost, an AdamW step per
    shape and a matmul, and on a CPU each layer's cold start at one workload (`_cold_pass`);
    `profile` fits the medians over the kept passes. Inside the ``with``
    block torch runs on ``threads`` threads, every layer's parameters require grad (restored on
    exit) and ``co_runners`` processes compute during passes (`CoRunners`)."""

    def __init__(self, model: MultimodalModel, token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS,
                 device: torch.device | str = "cpu", threads: int | None = 1, co_runners: int = 0, seed: int = 0,
                 log: Callable[[str], None] | None = None, dtype: str = "fp32"):
        check_settings(token_counts=token_counts, device=device, threads=threads, co_runners=co_runners,
                       dtype=dtype)
        self.model, self.token_counts = model, tuple(int(t) for t in token_counts)
        self.device = torch.device(device)
        self.dtype = dtype
        self.autocast = Precision(dtype, self.device.type).autocast  # every forward, as the runtime
        self.threads, self.co_runners, self.seed, self.log = threads, co_runners, seed, log
        self.passes = 0
        self.seconds = 0.0

    # ---- setup ---------------------------------------------------------------------------
    def __enter__(self) -> "Profiler":
        self._old_threads = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        self.model.to(self.device)
        gen = torch.Generator().manual_seed(self.seed)
        self.modules = [self._prepare(name, gen) for name in self.model.module_names]
        self.optimizer = OptimizerBench(self.device, parameter_shape_groups(self.model))
        self._evict = eviction_buffer(self.device)  # the cold start is a CPU's (`_cold_pass`)
        self.call_times: list[float] = []
        self.matmul_times: list[float] = []
        compute = DTYPES[self.dtype]  # the GEMMs' operand type under the run's autocast
        self._mm = (torch.randn(512, 512, device=self.device, dtype=compute),
                    torch.randn(512, 512, device=self.device, dtype=compute))
        self.runners = CoRunners(self.co_runners, profiler_co_runner,
                                 (self.model, self.token_counts, self.dtype)).__enter__()
        self.runners.pause()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.runners.__exit__(*exc)
        for st in self.modules:
            for ps, flags in zip(st.params, self._was[st.name]):
                for p, w in zip(ps, flags):
                    p.requires_grad_(w)
        if self.threads is not None:
            torch.set_num_threads(self._old_threads)

    def _prepare(self, name: str, gen: torch.Generator) -> _ModuleState:
        """Synthetic microbatches, and each layer's real input at each (run once, no timing)."""
        model = self.model
        layers = model.module_layers(name)
        params = [list(l.module.parameters()) for l in layers]
        self._was = getattr(self, "_was", {})
        self._was[name] = [[p.requires_grad for p in ps] for ps in params]
        for ps in params:  # profile every layer as trainable: freezing is decided when costs are asked
            for p in ps:
                p.requires_grad_(True)
        configs = module_workloads(model, name, self.token_counts, gen, self.device)
        points = [[LayerPoint(work) for _, work in configs] for _ in layers]
        widths = [0] * len(layers)
        prepared = []
        for ci, (batch, work) in enumerate(configs):
            ctx = model.module_context(name, batch)
            x: Any = {} if name == LLM else None
            inputs, grads = [], []
            for i, layer in enumerate(layers):
                x_in = x.detach().requires_grad_(True) if is_float_tensor(x) else x
                exclude = {p.untyped_storage().data_ptr() for p in params[i]}
                points[i][ci].saved, out = saved_bytes(lambda: self._forward(layer, x_in, ctx), exclude)
                widths[i] = int(out.shape[-1])
                inputs.append(x_in)
                grads.append(torch.randn_like(out))
                x = out.detach()
            logits = x.requires_grad_(True) if name == LLM else None
            prepared.append((batch, ctx, inputs, grads, logits))
        return _ModuleState(name, layers, params, [w for _, w in configs], prepared, points, widths,
                            [[] for _ in configs], [([], []) for _ in configs])

    # ---- measuring -----------------------------------------------------------------------
    def _forward(self, layer: Layer, x: Any, ctx: dict[str, Any]) -> Any:
        with self.autocast():
            return layer(x, ctx)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, n: int) -> torch.Tensor:
        with self.autocast():
            return loss_sum(logits, labels) / n

    def run_pass(self, keep: bool = True, until: Callable[[], bool] | None = None) -> None:
        """One timed pass over everything; ``keep=False`` for a warmup pass. ``until`` may cut
        an untimed pass short (checked between workloads)."""
        started = time.perf_counter()
        self.runners.resume()
        try:
            call = backward_call_overhead(repeats=20, device=self.device)
            if keep:
                self.call_times.append(call)
            for st in self.modules:
                if self._module_pass(st, keep, until):
                    return
            self.optimizer.run_pass(keep)
            t, _ = timed(lambda: self._mm[0] @ self._mm[1], self.device)
            if keep:
                self.matmul_times.append(t)
        finally:
            self.runners.pause()
            gc.collect()
        self.passes += int(keep)
        self.seconds += time.perf_counter() - started

    def module_pass_cpu(self) -> float:
        """CPU seconds (``time.thread_time``, this thread) of one untimed pass over every
        module's layers: the work `loom.profile.contention` times alone and beside co-runners."""
        t0 = time.thread_time()
        for st in self.modules:
            self._module_pass(st, keep=False)
        return time.thread_time() - t0

    def _module_pass(self, st: _ModuleState, keep: bool, until: Callable[[], bool] | None = None) -> bool:
        """Per workload: the context build; the forward of every layer *chained*, as a stage
        runs them (each layer right after the previous one, so its weights come in cold as they
        do in a run; a layer re-timed on its own runs warm and ~20% faster on small inputs);
        then each layer's two backwards on its own (a chained backward would not separate the
        input and weight parts; the per-call engine cost is taken off in `profile`)."""
        model, device = self.model, self.device
        for ci, (batch, ctx, inputs, grads, logits) in enumerate(st.prepared):
            if until is not None and until():
                return True
            t, _ = timed(lambda: model.module_context(st.name, batch), device)
            if keep:
                st.ctx_times[ci].append(t)
            cold = keep and ci == cold_at(st.works) and self._evict is not None
            forward, outputs = self._chain(st, ctx)
            x = outputs[-1]
            if logits is not None:
                n = label_count(batch)
                t_loss, loss = timed(lambda: self._loss(x, batch.labels, n), device)
                run = loss.backward
            else:
                t_loss = 0.0
                run = lambda: x.backward(grads[-1])
            # untimed (it frees the graph) but at the cold workload, the warm side of `_cold_pass`
            warm_backward = backward_by_layer(outputs, run) if cold else run()
            outputs.clear()
            for ps in st.params:
                for p in ps:
                    p.grad = None
            for i, layer in enumerate(st.layers):
                _, bi, full = measure_layer_once(layer, inputs[i], ctx, st.params[i], grads[i], device,
                                                 self.autocast)
                if keep:
                    pt = st.points[i][ci]
                    pt.forward.append(forward[i])
                    pt.backward_full.append(full)
                    pt.backward_input.append(bi if bi is not None else None)
            if logits is not None:
                tf, loss = timed(lambda: self._loss(logits, batch.labels, n), device)
                tb, _ = timed(lambda: torch.autograd.grad(loss, [logits]), device)
                if keep:
                    st.loss_times[ci][0].append(t_loss)
                    st.loss_times[ci][1].append(tb)
            if cold:
                self._cold_pass(st, ci, forward, warm_backward)
        return False

    def _chain(self, st: _ModuleState, ctx: dict[str, Any]) -> tuple[list[float], list[Any]]:
        """The module's layers chained as a stage runs them: each one's forward seconds and output."""
        x: Any = {} if st.name == LLM else None
        times, outputs = [], []
        for layer in st.layers:
            t, x = timed(lambda: self._forward(layer, x, ctx), self.device)
            times.append(t)
            outputs.append(x)
        return times, outputs

    def _cold_pass(self, st: _ModuleState, ci: int, warm_forward: list[float], warm_backward: list[float]) -> None:
        """The cold start at workload ``ci``: the module's chained forward right after a cache
        eviction, then its backward right after another, per layer less the warm forward and
        backward of this pass. Inside a run whose ranks share a core every action starts with
        the caches the others left: on the demo, most of the extra a forward pays there
        (docs/simulator.md)."""
        batch, ctx, _, grads, logits = st.prepared[ci]
        evict_caches(self._evict)
        forward, outputs = self._chain(st, ctx)
        x = outputs[-1]
        if logits is not None:
            run = self._loss(x, batch.labels, label_count(batch)).backward
        else:
            run = lambda: x.backward(grads[-1])
        evict_caches(self._evict)
        backward = backward_by_layer(outputs, run)
        for ps in st.params:
            for p in ps:
                p.grad = None
        for i, pt in enumerate(points[ci] for points in st.points):
            pt.cold_forward.append(forward[i] - warm_forward[i])
            pt.cold_backward.append(backward[i] - warm_backward[i])

    # ---- fitting -------------------------------------------------------------------------
    def profile(self, comm: Communication | None = None) -> Profile:
        """Fit the medians of the kept passes (at least one) into a `Profile`.

        Backward timings have the autograd engine's per-call cost taken off: the profiler
        calls the engine once per layer, a stage once for all its layers (the cost model adds
        it back per stage)."""
        if self.passes < 1:
            raise RuntimeError("Profiler.profile: no kept pass yet; call run_pass(keep=True) first")
        med = statistics.median
        call = med(self.call_times)
        less_call = lambda ts: max(med(ts) - call, 0.0)
        layers, context, loss = {}, {}, {}
        for st in self.modules:
            fitted = []
            for layer, pts, width, ps in zip(st.layers, st.points, st.widths, st.params):
                works = st.works
                # backward_weight = fit(full) - fit(input only), coefficient by coefficient, so
                # that backward_input + backward_weight is the fitted full backward (steadier than
                # a fit of differences of single noisy timings)
                full = fit_cost(works, [less_call(p.backward_full) for p in pts])
                has_input = all(p.backward_input and p.backward_input[0] is not None for p in pts)
                inp = (fit_cost(works, [less_call(p.backward_input) for p in pts]) if has_input
                       else [0.0] * len(FEATURES))
                fitted.append(LayerProfile(
                    name=layer.name, kind=layer.kind, params=sum(p.numel() for p in ps), out_width=width,
                    forward=fit_cost(works, [med(p.forward) for p in pts]),
                    backward_input=inp,
                    backward_weight=[f - i for f, i in zip(full, inp)],
                    activation_bytes=fit_cost(works, [float(p.saved) for p in pts], relative=False),
                    cold_forward_s=med(pts[cold_at(works)].cold_forward or [0.0]),
                    cold_backward_s=med(pts[cold_at(works)].cold_backward or [0.0]),
                ))
            layers[st.name] = fitted
            context[st.name] = fit_cost(st.works, [med(t) for t in st.ctx_times])
            if st.name == LLM:
                loss = {"forward": fit_cost(st.works, [med(f) for f, _ in st.loss_times]),
                        "backward_input": fit_cost(st.works, [less_call(b) for _, b in st.loss_times])}
            if self.log is not None:
                for ci, work in enumerate(st.works):
                    fwd = sum(med(st.points[i][ci].forward) for i in range(len(st.layers)))
                    bwd = sum(med(st.points[i][ci].backward_full) for i in range(len(st.layers)))
                    self.log(f"  {st.name}: tokens {work.tokens:6d} segments {work.segments:3d}: "
                             f"F {fwd * 1e3:8.3f} ms, B {bwd * 1e3:8.3f} ms")
        sig = model_signature(self.model)
        desc = device_description(self.device)
        desc["threads"] = self.threads if self.threads is not None else torch.get_num_threads()
        return Profile(
            signature=sig, signature_hash=signature_hash(sig), device=desc, layers=layers, context=context,
            loss=loss, dtype_bytes=next(self.model.llm.parameters()).element_size(), dtype=self.dtype, comm=comm,
            backward_call_s=call, optimizer=self.optimizer.fit(),
            matmul_flops_per_s=2.0 * 512 ** 3 / med(self.matmul_times),
            settings={"token_counts": list(self.token_counts), "passes": self.passes, "seed": self.seed,
                      "co_runners": self.co_runners, "seconds": round(self.seconds, 2),
                      "backward_weight": "full backward (input + parameters) minus input-only backward"},
        )


def profile_model(
    model: MultimodalModel,
    token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS,
    repeats: int = 5,
    warmup: int = 1,
    device: torch.device | str = "cpu",
    threads: int | None = 1,
    measure_comm: bool = True,
    co_runners: int = 0,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    dtype: str = "fp32",
) -> Profile:
    """Profile every layer of every module of ``model`` on ``device`` (see the package
    docstring): ``warmup`` untimed and ``repeats`` timed passes of a `Profiler`, back to back,
    then the fits (`Profiler.profile`).

    Arguments and their valid values (`check_settings` checks them all before anything runs and
    raises `ValueError` naming the argument):

    - ``token_counts``: the synthetic workload sizes, one or more integers, each at least
      `MIN_TOKENS` (the LLM is measured on 1, 4 and 16 sequences of ``count / batch`` tokens of
      at least 4 each); three or more spread over the sizes the run will see fit best.
    - ``repeats``: timed passes, at least 1 (a point is the median over them); ``warmup``:
      untimed passes first, 0 or more.
    - ``device``: ``"cpu"`` or ``"cuda"`` / ``"cuda:N"`` (CUDA must be available).
    - ``threads``: torch's intra-op threads while measuring, at least 1 (1: as each rank of a
      local CPU run), or ``None`` to keep the current setting.
    - ``measure_comm``: also run the 2-process gloo communication measurements (a few
      seconds); without them the profile has no communication fits and the cost model charges
      no communication time.
    - ``co_runners``: 0 or more processes kept busy while the layers are timed (`CoRunners`):
      pass the number of *other* ranks that will share this machine with each rank (world
      size - 1 for a local run).
    - ``seed``: seeds the synthetic inputs.
    - ``dtype``: the run's precision, ``run.dtype``: ``"fp32"`` or ``"bf16"`` (forwards under
      the runtime's bf16 autocast; CUDA must support bf16); the profile records it.
    """
    check_settings(token_counts=token_counts, repeats=repeats, warmup=warmup, device=device, threads=threads,
                   co_runners=co_runners, dtype=dtype)
    training = model.training
    try:
        with Profiler(model, token_counts, device, threads, co_runners, seed, log, dtype) as prof:
            for r in range(warmup + repeats):
                prof.run_pass(keep=r >= warmup)
            comm = measure_communication() if measure_comm else None
            return prof.profile(comm)
    finally:
        model.train(training)
