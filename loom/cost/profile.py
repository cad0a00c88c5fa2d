"""The profiler (`loom profile`) and the cost model it feeds (entrain.md §3.1).

Entrain's hardware-calibrated cost model "profiles every layer separately ... using synthetic
inputs at representative sizes ... then fits the measurements to a ... quadratic model
``T(x) = a x^2 + b x + c`` via linear regression". `Profiler` / `profile_model` do that for
every layer of every module of a `MultimodalModel` on the current device, per phase of the
Zero-Bubble split the cost contract uses (`loom.cost.model`):

- ``forward``: the layer's forward, with autograd recording;
- ``backward_input``: ``torch.autograd.grad`` w.r.t. the layer's *input* only (autograd then
  skips the weight-gradient kernels);
- ``backward_weight``: the full backward (w.r.t. the input *and* the parameters) minus the
  input-only one, i.e. the extra work the weight gradients add (the difference of the two
  fits). For a first layer, whose input is read from the context (patch embedding, token
  embedding), the input part is 0 and the full backward is all weight work.

Every layer is measured on its real input at each synthetic workload (the module's context and
the layers before it are run once to produce it). Measurements are taken in *passes* (every
workload and layer timed once per pass; ``time.perf_counter``, with ``torch.cuda.synchronize``
around each call on a GPU) and a point is the median over passes, so a burst of load elsewhere
on the machine hits one pass of every layer rather than every repeat of one layer. The
autograd engine's fixed per-call cost is measured and taken off each layer's backward (a stage
runs one backward call for all its layers; the cost model adds it back once). A microbatch's
work is a `Workload` and each layer and phase is fitted as

    t = a * attn_sq + a2 * tokens^2 + b * tokens + d * segments + c

by non-negative least squares on relative error (rows weighted by ``1 / t``, so the small
microbatches that dominate pipelines of tiny models are fitted as well as the large ones). For
one sequence of length ``x`` this is entrain's ``a x^2 + b x + c``; the two extra terms are
what loom's layers actually do and the profile should see: ``tokens^2`` is attention over a
*packed* sequence with a dense block-diagonal mask (the zoo encoders score all ``N x N`` pairs
and mask them, whatever the item sizes), ``segments`` is per-item work (the audio front-end
runs its convolutions clip by clip). The synthetic inputs vary all of them independently:
encoders see 0, 1 or many items of several sizes, the LLM sees batches of 1 to 16 sequences.

Besides layers the profile holds, per module, the per-microbatch context build (positions,
masks, RoPE tables: the executor builds it on every stage before the first layer) and, for the
LLM, the loss (cross-entropy over the logits, forward and backward); the activation bytes each
layer saves for backward (counted with ``saved_tensors_hooks``); an AdamW step as a function of
parameter and tensor counts; the matmul FLOP/s of the device; and, measured on two local gloo
processes with the executor's own communicator, the per-message costs and a gradient
all-reduce (`Communication`). ``co_runners`` processes can keep the machine's other cores busy
while layers are timed, as the other ranks of a local run do (`CoRunners`).

A profile is tied to the model it measured: it stores the model's *signature* (per module, the
layer names and parameter shapes) and its hash, and `ProfiledCostModel` refuses a model whose
signature differs, naming the first difference and the fix (re-run ``loom profile``).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import hashlib
import json
import math
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from loom.cost.model import CostModel, MicrobatchWork, StageKind, Workload
from loom.data.sample import Batch
from loom.model.layers import Layer
from loom.model.multimodal import IGNORE_INDEX, MultimodalModel, loss_sum
from loom.plan.plan import LLM, Plan

FORMAT = "loom-profile"
VERSION = 1
PHASES = ("forward", "backward_input", "backward_weight")
FEATURES = ("attn_sq", "tokens_sq", "tokens", "segments", "one")
DEFAULT_TOKEN_COUNTS = (64, 128, 256, 512, 1024)

Signature = dict[str, list[list[Any]]]  # module -> [[layer name, [[param name, shape], ...]], ...]


class ProfileError(ValueError):
    """A profile file that cannot be used: unreadable, or measured on another model. The
    message names the file, what differs and the fix."""


# ==== fitting ===================================================================================
def features(work: Workload) -> np.ndarray:
    """The regressors of a workload, in `FEATURES` order."""
    return np.array([work.attn_sq, float(work.tokens) ** 2, work.tokens, work.segments, 1.0], dtype=np.float64)


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares ``min |a x - b|, x >= 0`` (Lawson-Hanson active set)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    tol = 10 * np.finfo(float).eps * max(1.0, np.linalg.norm(a, 1)) * max(m, n)
    for _ in range(max_iter or 3 * n):
        if passive.all() or (w[~passive] <= tol).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # step back to the boundary and drop the coefficients that hit zero
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def fit_cost(works: Sequence[Workload], values: Sequence[float], relative: bool = True) -> list[float]:
    """Fit ``value = coef . features(work)`` with non-negative coefficients.

    ``relative`` weights each row by ``1 / value`` so the fit minimises relative error (times
    spanning two orders of magnitude are all fitted well); columns are scaled to unit maximum
    so the solver sees comparable magnitudes. Columns that never vary from 0 get 0."""
    x = np.array([features(w) for w in works], dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    if len(y) == 0:
        return [0.0] * len(FEATURES)
    if relative:
        floor = max(float(np.median(np.abs(y))) * 1e-3, 1e-12)
        weights = 1.0 / np.maximum(np.abs(y), floor)
    else:
        weights = np.ones_like(y)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    coef = nnls((x / scale) * weights[:, None], y * weights) / scale
    return [float(c) for c in coef]


def evaluate(coef: Sequence[float], work: Workload) -> float:
    return float(np.dot(np.asarray(coef, dtype=np.float64), features(work)))


@dataclass
class LinearFit:
    """Seconds as a function of bytes (communication), from measured ``points`` ``[[bytes,
    seconds], ...]``: interpolated linearly between them (gloo's costs are not linear in the
    size: small messages and scheduling make steps), the first point's value below them, and
    ``alpha + bytes * seconds_per_byte`` (the least-squares line through them) fitted to the
    last point above them."""

    alpha_s: float = 0.0
    seconds_per_byte: float = 0.0
    points: list[list[float]] = field(default_factory=list)

    def time(self, nbytes: float) -> float:
        pts = self.points
        if not pts:
            return self.alpha_s + nbytes * self.seconds_per_byte
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / max(b1 - b0, 1e-12)
        return pts[-1][1] + (nbytes - pts[-1][0]) * self.seconds_per_byte

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> "LinearFit":
        pts = sorted((float(b), float(t)) for b, t in points)
        sizes = np.array([p[0] for p in pts], dtype=np.float64)
        secs = np.array([p[1] for p in pts], dtype=np.float64)
        top = max(sizes.max(), 1.0)
        w = 1.0 / np.maximum(secs, 1e-9)
        a = np.stack([np.ones_like(sizes), sizes / top], axis=1) * w[:, None]
        alpha, slope = nnls(a, secs * w)
        return cls(float(alpha), float(slope / top), [[b, t] for b, t in pts])


@dataclass
class Communication:
    """Message and collective costs measured on two local processes of this machine, as the
    executor's communicator (`loom.runtime.comm`: a header, then the payload) sees them:

    - ``send_post``: the sender's time in ``send`` (posting both messages);
    - ``recv_ready``: the receiver's time in ``recv`` for a message posted before, the sender
      computing meanwhile (a pipeline stage goes on to its next forward or backward after a
      send). gloo moves a message only once its receive is posted, and on a machine with as
      many cores as ranks the sender's communication thread then has to win a core from the
      sender's compute: this is a whole transfer plus that wait, paid by the receiver;
    - ``latency``: from the end of the sender's post to the end of a receive that was already
      waiting, the sender computing on meanwhile;
    - ``recv_ready_idle``, ``latency_idle``: the same with the sender waiting instead of
      computing (for comparison; the cost model uses the two above);
    - ``all_reduce``: a gradient bucket's flatten + all-reduce + unflatten on ``world`` ranks.
    """

    send_post: LinearFit
    recv_ready: LinearFit
    latency: LinearFit
    all_reduce: LinearFit
    world: int = 2
    recv_ready_idle: LinearFit | None = None
    latency_idle: LinearFit | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: (asdict(v) if isinstance(v, LinearFit) else v) for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Communication":
        return cls(**{k: (LinearFit(**v) if isinstance(v, dict) else v) for k, v in d.items()})


# ==== the profile ===============================================================================
@dataclass
class LayerProfile:
    """One layer's fits: coefficients per phase (in `FEATURES` order) and of saved bytes."""

    name: str
    kind: str
    params: int
    out_width: int  # last dimension of the layer's output (the activation a stage boundary sends)
    forward: list[float]
    backward_input: list[float]
    backward_weight: list[float]
    activation_bytes: list[float]

    def time(self, phase: str, work: Workload) -> float:
        return max(evaluate(getattr(self, phase), work), 0.0)


@dataclass
class Profile:
    """What `profile_model` measured: see the module docstring. JSON on disk, never pickle."""

    signature: Signature
    signature_hash: str
    device: dict[str, Any]
    layers: dict[str, list[LayerProfile]]
    context: dict[str, list[float]]  # module -> forward coefficients of its context build
    loss: dict[str, list[float]]  # "forward" / "backward_input" coefficients of the LLM loss
    dtype_bytes: int = 4
    comm: Communication | None = None
    backward_call_s: float = 0.0  # one autograd engine call (taken off each layer, paid per stage)
    optimizer: dict[str, float] = field(default_factory=dict)  # fixed_s, per_param_s, per_tensor_s
    matmul_flops_per_s: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)
    path: str | None = None  # where it was loaded from (not saved)

    # ---- lookups ---------------------------------------------------------------------------
    def layer_counts(self) -> dict[str, int]:
        return {m: len(ls) for m, ls in self.layers.items()}

    def module_time(self, module: str, phase: str, work: Workload, start: int = 0, end: int | None = None) -> float:
        return sum(l.time(phase, work) for l in self.layers[module][start:end])

    def subset(self, modules: Iterable[str]) -> "Profile":
        """The profile of some of its modules, for a model made of just those (an LLM-only
        model from a multimodal model's profile): a module's layers cost what they cost
        whatever else the model holds. The signature is that of the subset."""
        keep = [m for m in self.layers if m in set(modules)]
        missing = sorted(set(modules) - set(keep))
        if missing:
            raise ProfileError(f"the profile has no module(s) {missing}; it has {list(self.layers)}")
        sig = {m: self.signature[m] for m in keep}
        return dataclasses.replace(
            self, signature=sig, signature_hash=signature_hash(sig), layers={m: self.layers[m] for m in keep},
            context={m: self.context[m] for m in keep if m in self.context},
            loss=self.loss if LLM in keep else {}, path=None,
        )

    # ---- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (nothing in it is shared with the profile)."""
        d = {
            "format": FORMAT,
            "version": VERSION,
            "features": list(FEATURES),
            "signature_hash": self.signature_hash,
            "signature": self.signature,
            "device": self.device,
            "dtype_bytes": self.dtype_bytes,
            "layers": {m: [asdict(l) for l in ls] for m, ls in self.layers.items()},
            "context": self.context,
            "loss": self.loss,
            "comm": self.comm.to_dict() if self.comm else None,
            "backward_call_s": self.backward_call_s,
            "optimizer": self.optimizer,
            "matmul_flops_per_s": self.matmul_flops_per_s,
            "settings": self.settings,
        }
        return copy.deepcopy(d)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return p

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "profile") -> "Profile":
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            raise ProfileError(f"{where} is not a loom profile (no \"format\": \"{FORMAT}\"); write one with `loom profile`")
        if d.get("version") != VERSION:
            raise ProfileError(f"{where} has profile version {d.get('version')!r}, this loom reads version {VERSION}; "
                               f"re-run `loom profile`")
        if list(d.get("features", [])) != list(FEATURES):
            raise ProfileError(f"{where} was fitted on features {d.get('features')}, this loom uses {list(FEATURES)}; "
                               f"re-run `loom profile`")
        try:
            sig = {m: [[l[0], [[p[0], list(p[1])] for p in l[1]]] for l in ls] for m, ls in d["signature"].items()}
            layers = {m: [LayerProfile(**l) for l in ls] for m, ls in d["layers"].items()}
            prof = cls(
                signature=sig,
                signature_hash=str(d["signature_hash"]),
                device=dict(d["device"]),
                layers=layers,
                context={m: list(c) for m, c in d["context"].items()},
                loss={k: list(c) for k, c in d["loss"].items()},
                dtype_bytes=int(d.get("dtype_bytes", 4)),
                comm=Communication.from_dict(d["comm"]) if d.get("comm") else None,
                backward_call_s=float(d.get("backward_call_s", 0.0)),
                optimizer={k: float(v) for k, v in d.get("optimizer", {}).items()},
                matmul_flops_per_s=float(d.get("matmul_flops_per_s", 0.0)),
                settings=dict(d.get("settings", {})),
            )
        except (KeyError, TypeError, IndexError) as e:
            raise ProfileError(f"{where} is malformed ({type(e).__name__}: {e}); re-run `loom profile`") from e
        if signature_hash(sig) != prof.signature_hash:
            raise ProfileError(f"{where}: the stored signature does not match its hash {prof.signature_hash} "
                               f"(edited by hand?); re-run `loom profile`")
        if set(sig) != set(layers) or any(len(sig[m]) != len(layers[m]) for m in sig):
            raise ProfileError(f"{where}: its layer fits do not match its signature; re-run `loom profile`")
        return prof

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        p = Path(path)
        if not p.is_file():
            raise ProfileError(f"profile file {str(p)!r} does not exist; write one with `loom profile --out {p}`")
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ProfileError(f"profile file {str(p)!r} is not JSON ({e}); re-run `loom profile`") from e
        prof = cls.from_dict(data, where=f"profile file {str(p)!r}")
        prof.path = str(p)
        return prof

    # ---- the model check -------------------------------------------------------------------
    def check_matches(self, model: MultimodalModel | Signature) -> None:
        """Raise `ProfileError` unless ``model`` has exactly the layers and parameter shapes
        this profile measured; the message names the profile, the first difference and the fix."""
        sig = model if isinstance(model, dict) else model_signature(model)
        if signature_hash(sig) == self.signature_hash:
            return
        where = f"profile file {self.path!r}" if self.path else "the profile"
        raise ProfileError(
            f"{where} was measured on another model (signature {self.signature_hash}, this model's is "
            f"{signature_hash(sig)}): {first_difference(self.signature, sig)}. Re-run `loom profile` with "
            f"this model's config to measure it"
        )

    # ---- printing --------------------------------------------------------------------------
    def table(self, tokens: int = 256) -> str:
        """Per layer, the fitted milliseconds of each phase for one sequence of ``tokens`` tokens."""
        work = Workload(tokens, tokens * tokens, 1)
        rows = [["module", "layer", "params", "F ms", "Bi ms", "Bw ms"]]
        for m, ls in self.layers.items():
            rows.append([m, "(context)", "", f"{evaluate(self.context.get(m, [0] * 5), work) * 1e3:.3f}", "", ""])
            for l in ls:
                rows.append([m, l.name.split(".", 2)[-1] if m != LLM else l.name[len("llm."):], str(l.params),
                             *(f"{l.time(ph, work) * 1e3:.3f}" for ph in PHASES)])
        if self.loss:
            rows.append([LLM, "(loss)", "", f"{evaluate(self.loss['forward'], work) * 1e3:.3f}",
                         f"{evaluate(self.loss['backward_input'], work) * 1e3:.3f}", ""])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        head = f"per-layer fits at {tokens} tokens (one sequence / item), {self.device.get('kind')} x {self.device.get('threads')} thread(s)"
        tail = []
        if self.comm:
            for what in ("send_post", "recv_ready", "latency", "recv_ready_idle", "latency_idle", "all_reduce"):
                f = getattr(self.comm, what)
                if f is None:
                    continue
                tail.append(f"{what}: {f.alpha_s * 1e6:.1f} us + {f.seconds_per_byte * 1e9:.3f} ns/byte")
        tail.append(f"autograd call: {self.backward_call_s * 1e6:.1f} us")
        if self.optimizer:
            tail.append(f"AdamW: {self.optimizer['fixed_s'] * 1e6:.1f} us + {self.optimizer['per_tensor_s'] * 1e6:.2f} us/tensor "
                        f"+ {self.optimizer['per_param_s'] * 1e9:.3f} ns/param")
        if self.matmul_flops_per_s:
            tail.append(f"matmul: {self.matmul_flops_per_s / 1e9:.1f} GFLOP/s")
        return "\n".join([head, *lines, *tail])


# ==== signatures ================================================================================
def model_signature(model: MultimodalModel) -> Signature:
    """Per module, ``[layer name, [[parameter name, shape], ...]]`` in layer order."""
    return {
        name: [[layer.name, [[pn, list(p.shape)] for pn, p in layer.module.named_parameters()]]
               for layer in model.module_layers(name)]
        for name in model.module_names
    }


def signature_hash(sig: Signature) -> str:
    text = json.dumps(sig, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def first_difference(profiled: Signature, model: Signature) -> str:
    """The first place two signatures differ, in words."""
    for m in list(profiled) + [m for m in model if m not in profiled]:
        if m not in model:
            return f"the profile has module {m!r}, the model has not (its modules: {list(model)})"
        if m not in profiled:
            return f"the model has module {m!r}, the profile has not (its modules: {list(profiled)})"
        a, b = profiled[m], model[m]
        for i, (la, lb) in enumerate(zip(a, b)):
            if la[0] != lb[0]:
                return f"module {m!r} layer {i} is {la[0]!r} in the profile but {lb[0]!r} in the model"
            pa, pb = {p[0]: list(p[1]) for p in la[1]}, {p[0]: list(p[1]) for p in lb[1]}
            for pn in list(pa) + [p for p in pb if p not in pa]:
                if pn not in pb:
                    return f"module {m!r} layer {la[0]!r}: parameter {pn!r} is in the profile but not in the model"
                if pn not in pa:
                    return f"module {m!r} layer {la[0]!r}: parameter {pn!r} is in the model but not in the profile"
                if pa[pn] != pb[pn]:
                    return (f"module {m!r} layer {la[0]!r}: parameter {pn!r} has shape {pa[pn]} in the profile "
                            f"but {pb[pn]} in the model")
        if len(a) != len(b):
            return f"module {m!r} has {len(a)} layers in the profile but {len(b)} in the model"
    return "the signatures differ"


# ==== timing ====================================================================================
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _saved_bytes(fn: Callable[[], Any], exclude: set[int]) -> tuple[int, Any]:
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
        t, _ = _timed(lambda: torch.autograd.grad(y, [x], g), device)
        if r >= 5:
            times.append(t)
    return statistics.median(times)


@dataclass
class _Point:
    """One layer's measurement at one workload: lists of timed repeats, and fixed facts."""

    work: Workload
    saved: int = 0
    forward: list[float] = field(default_factory=list)
    backward_input: list[float] = field(default_factory=list)
    backward_full: list[float] = field(default_factory=list)


def _measure_layer_once(layer: Layer, x_in: Any, ctx: dict[str, Any], params: list[torch.Tensor],
                        grad_out: torch.Tensor, device: torch.device) -> tuple[float, float | None, float]:
    """One timed forward (on its own, warm), full backward (input and parameters) and
    input-only backward; the profiler keeps the two backwards."""
    has_input = _float_tensor(x_in)
    wrt_all = ([x_in] if has_input else []) + params
    t_fwd, out = _timed(lambda: layer(x_in, ctx), device)
    t_full, _ = _timed(lambda: torch.autograd.grad(out, wrt_all, grad_out, allow_unused=True), device)
    t_inp = None
    if has_input:
        t2, out = _timed(lambda: layer(x_in, ctx), device)
        t_inp, _ = _timed(lambda: torch.autograd.grad(out, [x_in], grad_out, allow_unused=True), device)
    return t_fwd, t_inp, t_full


# ==== synthetic inputs ==========================================================================
def _grid(tokens: int) -> tuple[int, int]:
    """A patch grid with ``tokens`` cells, as square as possible."""
    h = int(math.isqrt(tokens))
    while tokens % h:
        h -= 1
    return h, tokens // h


def _item_shapes(target: int, sizes: Iterable[int] = (None, 64, 16)) -> list[list[int]]:
    """Per target token count, several ways to make it from items: one item of all of it, and
    many items of 64 and of 16 tokens (so tokens, tokens^2, sum of squares and item count vary
    independently)."""
    out = []
    for s in sizes:
        s = target if s is None else s
        if s <= target and [s] * (target // s) not in out:
            out.append([s] * (target // s))
    return out


def _encoder_inputs(model: MultimodalModel, name: str, item_tokens: list[int], gen: torch.Generator,
                    device: torch.device) -> dict[str, list[torch.Tensor]]:
    from loom.model.zoo import AudioEncoder, VisionEncoder

    enc = model.encoders[name].encoder
    if isinstance(enc, VisionEncoder):
        p, c = enc.config.patch_size, enc.config.in_channels
        images = []
        for n in item_tokens:
            gh, gw = _grid(n)
            images.append(torch.rand(c, gh * p, gw * p, generator=gen).to(device))
        return {"images": images}
    if isinstance(enc, AudioEncoder):
        hop = enc.config.hop_length
        # tokens = ((1 + samples // hop) - 1) // 2 + 1, so 2 (n - 1) hops give exactly n tokens
        clips = [(torch.rand(max(2 * (n - 1) * hop, 1), generator=gen) * 2 - 1).to(device) for n in item_tokens]
        return {"waveforms": clips}
    raise TypeError(
        f"loom profile has no synthetic-input builder for encoder {name!r} ({type(enc).__name__}); "
        f"it profiles the zoo's VisionEncoder and AudioEncoder"
    )


def _llm_vocab(model: MultimodalModel) -> int:
    llm = model.llm
    emb = llm.get_input_embeddings() if hasattr(llm, "get_input_embeddings") else None
    return int(emb.num_embeddings) if emb is not None else int(llm.config.vocab_size)


def _llm_batch(model: MultimodalModel, batch_size: int, length: int, gen: torch.Generator,
               device: torch.device) -> Batch:
    vocab = _llm_vocab(model)
    reserved = set(model.placeholder_ids.values())
    allowed = torch.tensor([i for i in range(vocab) if i not in reserved], dtype=torch.long)
    ids = allowed[torch.randint(0, len(allowed), (batch_size, length), generator=gen)]
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[torch.rand(batch_size, length, generator=gen) < 0.1] = IGNORE_INDEX
    return Batch(input_ids=ids.to(device), labels=labels.to(device), modality_inputs={}, sample_ids=[])


def _llm_shapes(target: int) -> list[tuple[int, int]]:
    """(batch, length) pairs of about ``target`` tokens: 1, 4 and 16 sequences."""
    out = []
    for b in (1, 4, 16):
        length = target // b
        if length >= 4 and (b, length) not in out:
            out.append((b, length))
    return out


# ==== profiling =================================================================================
def _module_configs(model: MultimodalModel, name: str, token_counts: Sequence[int], gen: torch.Generator,
                    device: torch.device) -> list[tuple[Batch, Workload]]:
    """Synthetic microbatches of module ``name`` and their workloads: for the LLM, right-padded
    batches of 1, 4 and 16 sequences; for an encoder, no item at all (a microbatch without its
    modality still runs the module) and packs of one, of 64-token and of 16-token items."""
    configs: list[tuple[Batch, Workload]] = []
    dummy = torch.zeros(1, 1, dtype=torch.long, device=device)
    if name == LLM:
        for x in token_counts:
            for b, length in _llm_shapes(x):
                configs.append((_llm_batch(model, b, length, gen, device), Workload.padded([length] * b)))
        return configs
    shapes = [[]] + [s for x in token_counts for s in _item_shapes(x)]
    for items in shapes:
        inputs = _encoder_inputs(model, name, items, gen, device)
        configs.append((Batch(input_ids=dummy, labels=dummy, modality_inputs={name: inputs}, sample_ids=[]),
                        Workload.of_lengths(items)))
    return configs


OPTIMIZER_SHAPES = ((1, 1_000), (1, 200_000), (1, 1_000_000), (16, 16_000), (16, 400_000), (64, 64_000),
                    (64, 640_000))  # (tensors, parameters)


class _OptimizerBench:
    """``AdamW.step`` + ``zero_grad`` (what the executor's optimizer_step runs) over parameter
    lists of several sizes and tensor counts, one timed step per list and pass: synthetic lists
    and, given ``shape_groups``, copies of a model's own parameters (whole modules, halves and
    single layers, whose mix of large matrices and small norms and biases a stage holds)."""

    def __init__(self, device: torch.device, shape_groups: Sequence[Sequence[Sequence[int]]] = ()):
        self.device = device
        groups = [[(total // count,)] * count for count, total in OPTIMIZER_SHAPES] + [list(g) for g in shape_groups]
        self.cases = []
        for shapes in groups:
            params = [torch.nn.Parameter(torch.randn(*shape, device=device)) for shape in shapes]
            grads = [torch.randn_like(p) for p in params]
            self.cases.append((len(params), sum(p.numel() for p in params), params, grads,
                               torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95))))
        self.times: list[list[float]] = [[] for _ in self.cases]

    def run_pass(self, keep: bool) -> None:
        for k, (_, _, params, grads, opt) in enumerate(self.cases):
            for p, g in zip(params, grads):
                p.grad = g.clone()

            def step():
                opt.step()
                opt.zero_grad(set_to_none=True)

            t, _ = _timed(step, self.device)
            if keep:
                self.times[k].append(t)

    def fit(self) -> dict[str, float]:
        """``fixed + per_tensor * tensors + per_param * params``, relative least squares."""
        x = np.array([[1.0, c[0], c[1]] for c in self.cases], dtype=np.float64)
        y = np.array([statistics.median(t) for t in self.times])
        scale = x.max(axis=0)
        coef = nnls(x / scale / y[:, None], np.ones_like(y)) / scale
        return {"fixed_s": float(coef[0]), "per_tensor_s": float(coef[1]), "per_param_s": float(coef[2])}


def _parameter_shape_groups(model: MultimodalModel) -> list[list[tuple[int, ...]]]:
    """Per module: all its parameters, its first half of layers, and its first block."""
    groups = []
    for name in model.module_names:
        layers = model.module_layers(name)
        shapes = [[tuple(p.shape) for p in l.module.parameters()] for l in layers]
        groups.append([s for ls in shapes for s in ls])
        groups.append([s for ls in shapes[: max(len(shapes) // 2, 1)] for s in ls])
        block = next((ls for l, ls in zip(layers, shapes) if l.kind == "block"), None)
        if block:
            groups.append(block)
    return [g for g in groups if g]


def _busy(seconds: float) -> None:
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
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

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
                    _busy(0.004)
                comm.recv(1, tag=3)
                comm.wait_sends()
            elif rank == 1:
                _busy(0.002)
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
                _busy(0.002)
                comm.send(t, 1, tag=2)
                stamp[0] = time.perf_counter()  # CLOCK_MONOTONIC: one clock for both processes
                if busy:
                    _busy(0.006)
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


def fit_communication(passes: Sequence[Mapping[str, Sequence[Sequence[float]]]], world: int = 2) -> Communication:
    """`Communication` from the rows of several `message_pass` calls (any ranks): the median
    per quantity and size, then a linear fit per quantity."""
    points: dict[str, dict[float, list[float]]] = {}
    for rows in passes:
        for key, pts in rows.items():
            for nbytes, secs in pts:
                points.setdefault(key, {}).setdefault(float(nbytes), []).append(float(secs))
    fits = {key: LinearFit.fit([(b, statistics.median(v)) for b, v in sorted(per.items())])
            for key, per in points.items()}
    return Communication(**fits, world=world)


def _comm_worker(rank: int, world_size: int, sizes: list[int], repeats: int, out_path: str) -> None:
    import torch.distributed as dist

    # the runtime's own communicator, so the fits include its header message and bookkeeping
    from loom.runtime.comm import P2PCommunicator

    comm = P2PCommunicator(torch.device("cpu"))
    passes = [message_pass(comm, rank, sizes) for _ in range(repeats + 2)][2:]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, passes)
    if rank == 0:
        Path(out_path).write_text(json.dumps([p for g in gathered for p in g]))


def measure_communication(sizes: Sequence[int] = MESSAGE_SIZES, repeats: int = 9) -> Communication:
    """Message and all-reduce costs on two local gloo processes (one thread each); see
    `Communication`."""
    from loom.runtime.local import run_local

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        run_local(_comm_worker, 2, list(sizes), repeats, out, threads=1)
        passes = json.loads(Path(out).read_text())
    return fit_communication(passes, world=2)


def _co_runner(stop: Any, running: Any, ready: Any, model: Any, token_counts: Sequence[int]) -> None:
    """Keep one core busy, while ``running`` is set and until ``stop`` is set, with the work a
    rank does: the profiler's own passes over a copy of ``model`` (results discarded), or, with
    no model, a small decoder's forward and backward. One thread."""
    torch.set_num_threads(1)
    if model is None:
        from loom.model.zoo import LlamaConfig, LlamaForCausalLM

        llm = LlamaForCausalLM(LlamaConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                           intermediate_size=344))
        ids = torch.randint(0, 256, (4, 64))
        work = lambda: llm(input_ids=ids).float().mean().backward()
        ready.set()
        while not stop.is_set():
            if running.wait(0.1):
                work()
        return
    model = copy.deepcopy(model)  # private weights, as another rank has (not the parent's shared pages)
    with Profiler(model, token_counts, threads=1, co_runners=0, seed=1) as prof:
        ready.set()
        while not stop.is_set():
            if running.wait(0.1):
                prof.run_pass(keep=False, until=lambda: not running.is_set() or stop.is_set())


class CoRunners:
    """``count`` processes computing alongside the profiler, so layers are timed as a rank of a
    local multi-process run sees them: sharing the machine with the other ranks' compute (on
    small VMs whose cores share physical ones, a busy neighbour slows a process down). Given
    the profiled ``model``, each runs the profiler's own passes on a copy of it, the closest
    stand-in for another rank of the same model. `pause` / `resume` idle them between passes."""

    def __init__(self, count: int, model: Any = None, token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS):
        self.count, self.model, self.token_counts = count, model, tuple(token_counts)
        self.procs: list[Any] = []

    def __enter__(self) -> "CoRunners":
        if self.count > 0:
            import torch.multiprocessing as mp

            ctx = mp.get_context("spawn")
            self.stop, self.running = ctx.Event(), ctx.Event()
            self.running.set()
            for _ in range(self.count):
                ready = ctx.Event()
                proc = ctx.Process(target=_co_runner, args=(self.stop, self.running, ready, self.model,
                                                            self.token_counts), daemon=True)
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
    points: list[list[_Point]]
    widths: list[int]
    ctx_times: list[list[float]]
    loss_times: list[tuple[list[float], list[float]]]


class Profiler:
    """Measures a model pass by pass, so the passes can be spread over time (a benchmark runs
    them between its real runs, and both then sample the same machine).

        with Profiler(model, co_runners=1) as prof:
            for r in range(6):
                prof.run_pass(keep=r > 0)
            profile = prof.profile()

    Each pass times every (module, workload, layer) once (forward, full backward, input-only
    backward), the context builds, the LLM loss, the autograd call cost, an AdamW step per
    shape and a matmul; `profile` fits the medians over the kept passes. Inside the ``with``
    block torch runs on ``threads`` threads, every layer's parameters require grad (restored on
    exit) and ``co_runners`` processes compute during passes (`CoRunners`)."""

    def __init__(self, model: MultimodalModel, token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS,
                 device: torch.device | str = "cpu", threads: int | None = 1, co_runners: int = 0, seed: int = 0,
                 log: Callable[[str], None] | None = None):
        self.model, self.token_counts = model, tuple(token_counts)
        self.device = torch.device(device)
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
        self.optimizer = _OptimizerBench(self.device, _parameter_shape_groups(self.model))
        self.call_times: list[float] = []
        self.matmul_times: list[float] = []
        self._mm = (torch.randn(512, 512, device=self.device), torch.randn(512, 512, device=self.device))
        self.runners = CoRunners(self.co_runners, self.model, self.token_counts).__enter__()
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
        configs = _module_configs(model, name, self.token_counts, gen, self.device)
        points = [[_Point(work) for _, work in configs] for _ in layers]
        widths = [0] * len(layers)
        prepared = []
        for ci, (batch, work) in enumerate(configs):
            ctx = model.module_context(name, batch)
            x: Any = {} if name == LLM else None
            inputs, grads = [], []
            for i, layer in enumerate(layers):
                x_in = x.detach().requires_grad_(True) if _float_tensor(x) else x
                exclude = {p.untyped_storage().data_ptr() for p in params[i]}
                points[i][ci].saved, out = _saved_bytes(lambda: layer(x_in, ctx), exclude)
                widths[i] = int(out.shape[-1])
                inputs.append(x_in)
                grads.append(torch.randn_like(out))
                x = out.detach()
            logits = x.requires_grad_(True) if name == LLM else None
            prepared.append((batch, ctx, inputs, grads, logits))
        return _ModuleState(name, layers, params, [w for _, w in configs], prepared, points, widths,
                            [[] for _ in configs], [([], []) for _ in configs])

    # ---- measuring -----------------------------------------------------------------------
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
            t, _ = _timed(lambda: self._mm[0] @ self._mm[1], self.device)
            if keep:
                self.matmul_times.append(t)
        finally:
            self.runners.pause()
            gc.collect()
        self.passes += int(keep)
        self.seconds += time.perf_counter() - started

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
            t, _ = _timed(lambda: model.module_context(st.name, batch), device)
            if keep:
                st.ctx_times[ci].append(t)
            x: Any = {} if st.name == LLM else None
            forward = []
            for layer in st.layers:
                t, x = _timed(lambda: layer(x, ctx), device)
                forward.append(t)
            if logits is not None:
                n = max(int((batch.labels != IGNORE_INDEX).sum()), 1)
                t_loss, loss = _timed(lambda: loss_sum(x, batch.labels) / n, device)
                loss.backward()  # untimed: frees the graph
            else:
                t_loss = 0.0
                x.backward(grads[-1])
            for ps in st.params:
                for p in ps:
                    p.grad = None
            for i, layer in enumerate(st.layers):
                _, bi, full = _measure_layer_once(layer, inputs[i], ctx, st.params[i], grads[i], device)
                if keep:
                    pt = st.points[i][ci]
                    pt.forward.append(forward[i])
                    pt.backward_full.append(full)
                    pt.backward_input.append(bi if bi is not None else None)
            if logits is not None:
                tf, loss = _timed(lambda: loss_sum(logits, batch.labels) / n, device)
                tb, _ = _timed(lambda: torch.autograd.grad(loss, [logits]), device)
                if keep:
                    st.loss_times[ci][0].append(t_loss)
                    st.loss_times[ci][1].append(tb)
        return False

    # ---- fitting -------------------------------------------------------------------------
    def profile(self, comm: "Communication | None" = None) -> Profile:
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
            loss=loss, dtype_bytes=next(self.model.llm.parameters()).element_size(), comm=comm,
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
) -> Profile:
    """Profile every layer of every module of ``model`` on ``device`` (see the module
    docstring): ``warmup`` untimed and ``repeats`` timed passes of a `Profiler`, back to back.
    ``threads`` sets torch's intra-op threads for the measurement (1: as each rank of a local
    CPU run; ``None`` keeps the current setting). ``measure_comm`` also runs the 2-process
    communication measurements (a few seconds); without it the profile has no communication
    fits and the cost model charges no communication time. ``co_runners`` processes keep other
    cores busy while the layers are timed (`CoRunners`): pass the number of *other* ranks that
    will share this machine with each rank (world size - 1 for a local run)."""
    training = model.training
    try:
        with Profiler(model, token_counts, device, threads, co_runners, seed, log) as prof:
            for r in range(warmup + repeats):
                prof.run_pass(keep=r >= warmup)
            comm = measure_communication() if measure_comm else None
            return prof.profile(comm)
    finally:
        model.train(training)


# ==== the cost model ============================================================================
TrainableSpec = Mapping[str, "bool | Sequence[bool]"]


class ProfiledCostModel(CostModel):
    """The `CostModel` contract answered from a `Profile` (measured, not specified).

    - ``model``: what the costs are for: a `MultimodalModel` (its signature must match the
      profile's, else `ProfileError`; its ``requires_grad`` flags say what is trainable), or a
      `loom.cost.arch.ModelArch` (same module names, layer names and parameter counts as the
      profile; its ``trainable`` flags count), or ``None`` with ``trainable`` (module -> bool or
      per-layer bools; default: everything trainable).
    - compute: the sum of the stage's fitted layers, frozen-aware by Cornstarch's rule as
      `loom.cost.frozen.backward_needs` states it (``backward_weight`` for trainable layers,
      ``backward_input`` from the first trainable layer on, for the LLM also when an encoder is
      trainable); every stage's forward adds its context build (the executor builds it on every
      stage), the LLM's last stage its loss. Recompute adds the forward to the backward. TP/CP
      were not profiled: such stages are charged the TP=CP=1 time divided by ``TP x CP`` (ideal
      scaling, no collective cost; use the analytic model to plan TP/CP).
    - messages (`Communication`, for the activation's bytes: tokens x output width x dtype
      bytes): the simulator's sends and receives take no time on their rank, but in the
      executor each costs CPU time, so a forward or backward is charged its messages' costs
      (posting its sends, completing its receives: `_messages`), and ``transfer_time`` is the
      latency a waiting receiver sees beyond its own receive cost. Gradient sync comes from the
      2-rank all-reduce, carried to ``n`` ranks as a ring (``(n-1) alpha + 2 (n-1)/n bytes /
      bandwidth``).
    - optimizer: the measured AdamW fit for the stage's trainable parameters and tensors.
    - memory: parameters, gradients and AdamW states from parameter counts; activations from
      the fitted bytes autograd saved per layer.
    - FLOPs: ``2 x params x tokens`` per matmul phase (embeddings excluded); peak is the
      measured matmul FLOP/s.
    """

    def __init__(self, profile: Profile, model: Any = None, plan: Plan | None = None,
                 trainable: TrainableSpec | None = None):
        from loom.cost.arch import ModelArch

        self.profile = profile
        self._tensor_counts = {m: [len(layer[1]) for layer in ls] for m, ls in profile.signature.items()}
        if isinstance(model, MultimodalModel):
            profile.check_matches(model)
            trainable = {m: [any(p.requires_grad for p in l.module.parameters()) for l in model.module_layers(m)]
                         for m in model.module_names}
        elif isinstance(model, ModelArch):
            _check_arch(profile, model)
            trainable = {m: [l.trainable for l in mod.layers] for m, mod in model.modules.items()}
        elif model is not None:
            raise TypeError(f"model must be a MultimodalModel, a ModelArch or None, not {type(model).__name__}")
        self._trainable = self._trainable_flags(trainable)
        self._needs_input = _input_needs(profile, self._trainable)
        if plan is None:
            raise ValueError("ProfiledCostModel needs the plan whose stages it costs")
        self.plan = plan.resolve(profile.layer_counts())

    def _trainable_flags(self, trainable: TrainableSpec | None) -> dict[str, list[bool]]:
        counts = self.profile.layer_counts()
        out = {m: [True] * n for m, n in counts.items()}
        for m, v in (trainable or {}).items():
            if m not in counts:
                raise ValueError(f"trainable names module {m!r}; the profile has {list(counts)}")
            if isinstance(v, bool):
                out[m] = [v] * counts[m]
            else:
                v = [bool(f) for f in v]
                if len(v) != counts[m]:
                    raise ValueError(f"trainable[{m!r}] has {len(v)} flags; the module has {counts[m]} layers")
                out[m] = v
        return out

    # ---- helpers ---------------------------------------------------------------------------
    def _layers(self, module: str, stage: int) -> range:
        start, end = self.plan.layers_of(module, stage)
        return range(start, end)

    def _is_last_llm(self, module: str, stage: int) -> bool:
        return module == LLM and stage == self.plan.spec(LLM).num_stages - 1

    def stage_needs_backward(self, module: str, stage: int) -> bool:
        return any(self._needs_input[module][i] or self._trainable[module][i] for i in self._layers(module, stage))

    def _split(self, module: str) -> int:
        spec = self.plan.spec(module)
        return spec.tensor_parallel * spec.context_parallel

    def _wants_gradient_before(self, module: str, stage: int) -> bool:
        """Whether the stage's input requires grad (something trainable upstream of it)."""
        start = self.plan.layers_of(module, stage)[0]
        if any(self._trainable[module][:start]):
            return True
        return module == LLM and any(any(f) for m, f in self._trainable.items() if m != LLM)

    def _messages(self, module: str, stage: int, kind: StageKind, work: Workload) -> float:
        """CPU time of the messages around this compute action on its rank: posting its sends
        and completing its receives (`Communication`). The simulator's sends and receives take
        no time on their rank, so the executor's per-message cost is charged here, to the
        forward or backward the messages belong to. An encoder's tokens in the LLM's first
        stage have no size in the LLM's workload: those messages are charged their fixed part."""
        comm = self.profile.comm
        if comm is None:
            return 0.0
        spec = self.plan.spec(module)
        first, last = stage == 0, stage == spec.num_stages - 1
        out_bytes = self.activation_bytes(module, stage, work) / self._split(module)
        in_bytes = self.activation_bytes(module, stage - 1, work) / self._split(module) if not first else 0.0
        if not first:
            predecessors = [module]
        else:
            predecessors = self.plan.encoder_names if module == LLM else []  # encoders feed the LLM
        sends_on = not (module == LLM and last)
        if kind == "forward":
            t = sum(comm.recv_ready.time(in_bytes) for _ in predecessors)
            if sends_on:
                t += comm.send_post.time(out_bytes)
            return t
        if not self.stage_needs_backward(module, stage):
            return 0.0
        t = comm.recv_ready.time(out_bytes) if sends_on else 0.0
        for p in predecessors:
            if p == module:
                if self._wants_gradient_before(module, stage):
                    t += comm.send_post.time(in_bytes)
            elif any(self._trainable[p]):
                t += comm.send_post.time(0.0)
        return t

    def forward_time(self, module: str, stage: int, work: Workload) -> float:
        """Seconds of the stage's forward on one unit (TP = CP = 1), without messages."""
        prof = self.profile
        t = evaluate(prof.context.get(module, [0.0] * len(FEATURES)), work)
        t += sum(prof.layers[module][i].time("forward", work) for i in self._layers(module, stage))
        if self._is_last_llm(module, stage) and prof.loss:
            t += evaluate(prof.loss["forward"], work)
        return max(t, 0.0)

    def backward_time(self, module: str, stage: int, work: Workload) -> float:
        """Seconds of the stage's frozen-aware backward (TP = CP = 1), without messages: one
        autograd call through its layers."""
        if not self.stage_needs_backward(module, stage):
            return 0.0
        layers = self.profile.layers[module]
        t = self.profile.backward_call_s
        for i in self._layers(module, stage):
            if self._needs_input[module][i]:
                t += layers[i].time("backward_input", work)
            if self._trainable[module][i]:
                t += layers[i].time("backward_weight", work)
        if self._is_last_llm(module, stage) and self.profile.loss:
            t += evaluate(self.profile.loss["backward_input"], work)
        if self.plan.spec(module).recompute:
            t += sum(layers[i].time("forward", work) for i in self._layers(module, stage))
        return max(t, 0.0)

    # ---- the contract ----------------------------------------------------------------------
    def stage_time(self, module: str, stage: int, kind: StageKind, work: Workload) -> float:
        t = self.forward_time(module, stage, work) if kind == "forward" else self.backward_time(module, stage, work)
        return t / self._split(module) + self._messages(module, stage, kind, work)

    def activation_bytes(self, module: str, stage: int, work: Workload) -> float:
        """Bytes of the activation the stage sends on (its last layer's output)."""
        last = self.profile.layers[module][self._layers(module, stage)[-1]]
        return float(work.tokens) * last.out_width * self.profile.dtype_bytes

    def transfer_time(self, src_unit: int, dst_unit: int, module: str, stage: int, work: Workload) -> float:
        """From the sender's post to the message being usable by a receiver already waiting,
        less the receive cost the receiver's compute action is charged (`_messages`)."""
        comm = self.profile.comm
        if src_unit == dst_unit or comm is None:
            return 0.0
        nbytes = self.activation_bytes(module, stage, work) / self._split(module)
        return max(comm.latency.time(nbytes) - comm.recv_ready.time(nbytes), 0.0)

    def _trainable_params(self, module: str, stage: int) -> tuple[int, int]:
        params = tensors = 0
        for i in self._layers(module, stage):
            if self._trainable[module][i]:
                params += self.profile.layers[module][i].params
                tensors += self._tensor_counts[module][i]
        return params, tensors

    def grad_sync_time(self, module: str, stage: int) -> float:
        spec = self.plan.spec(module)
        n = spec.data_parallel
        params, _ = self._trainable_params(module, stage)
        if n <= 1 or params == 0 or self.profile.comm is None:
            return 0.0
        fit = self.profile.comm.all_reduce
        nbytes = params * self.profile.dtype_bytes / (spec.tensor_parallel)
        ref = self.profile.comm.world  # measured on `ref` ranks: per-step latency and ring bytes scale
        ring = (2 * (n - 1) / n) / (2 * (ref - 1) / ref)
        t = fit.alpha_s * (n - 1) / (ref - 1) + nbytes * fit.seconds_per_byte * ring
        return t / 2 if spec.zero_stage >= 2 else t  # a reduce-scatter is half an all-reduce

    def optimizer_time(self, module: str, stage: int) -> float:
        params, tensors = self._trainable_params(module, stage)
        if params == 0 or not self.profile.optimizer:
            return 0.0
        spec = self.plan.spec(module)
        shard = spec.tensor_parallel * (spec.data_parallel if spec.zero_stage >= 1 else 1)
        o = self.profile.optimizer
        return o["fixed_s"] + o["per_tensor_s"] * tensors + o["per_param_s"] * params / shard

    def static_memory(self, module: str, stage: int) -> float:
        spec = self.plan.spec(module)
        b = self.profile.dtype_bytes
        params = sum(self.profile.layers[module][i].params for i in self._layers(module, stage))
        trainable, _ = self._trainable_params(module, stage)
        dp = spec.data_parallel
        weights = params * b / (dp if spec.zero_stage >= 3 else 1)
        grads = trainable * b / (dp if spec.zero_stage >= 2 else 1)
        states = trainable * 8 / (dp if spec.zero_stage >= 1 else 1)  # AdamW: two fp32 moments
        return (weights + grads + states) / spec.tensor_parallel

    def activation_memory(self, module: str, stage: int, work: Workload) -> float:
        if not self.stage_needs_backward(module, stage):
            return 0.0
        layers = self.profile.layers[module]
        idx = self._layers(module, stage)
        if self.plan.spec(module).recompute:  # only each layer's input is kept
            widths = [layers[i - 1].out_width if i > 0 else 0 for i in idx]
            total = sum(float(work.tokens) * w * self.profile.dtype_bytes for w in widths)
        else:
            total = sum(max(evaluate(layers[i].activation_bytes, work), 0.0) for i in idx)
        return total / self._split(module)

    def model_flops(self, work: MicrobatchWork) -> float:
        total = 0.0
        for module, w in work.items():
            if module not in self.profile.layers:
                continue
            for i, layer in enumerate(self.profile.layers[module]):
                if layer.kind == "embedding":
                    continue
                per_pass = 2.0 * layer.params * w.tokens
                total += per_pass
                total += per_pass * (self._needs_input[module][i] + self._trainable[module][i])
        return total

    def peak_flops_per_rank(self) -> float:
        return self.profile.matmul_flops_per_s



def _check_arch(profile: Profile, arch: Any) -> None:
    """A `ModelArch` has no parameter shapes: compare modules, layer names and parameter counts."""
    where = f"profile file {profile.path!r}" if profile.path else "the profile"
    for m in list(profile.layers) + [m for m in arch.modules if m not in profile.layers]:
        if m not in arch.modules or m not in profile.layers:
            side = "profile" if m in profile.layers else "architecture"
            raise ProfileError(f"{where} does not fit this architecture: module {m!r} is only in the {side}; "
                               f"re-run `loom profile` on this model")
        ours, theirs = profile.layers[m], arch.modules[m].layers
        for a, b in zip(ours, theirs):
            if a.name != b.name or a.params != b.params:
                raise ProfileError(f"{where} does not fit this architecture: module {m!r} layer {a.name!r} "
                                   f"({a.params} parameters) is {b.name!r} ({b.params} parameters) there; "
                                   f"re-run `loom profile` on this model")
        if len(ours) != len(theirs):
            raise ProfileError(f"{where} does not fit this architecture: module {m!r} has {len(ours)} layers in "
                               f"the profile, {len(theirs)} there; re-run `loom profile` on this model")


def _input_needs(profile: Profile, trainable: dict[str, list[bool]]) -> dict[str, list[bool]]:
    """Per layer, whether its backward computes the input-gradient part: the rule of
    `loom.cost.frozen`, applied to the profile's layer kinds and these flags."""
    from loom.cost.frozen import INPUT_KINDS, needs_from_flags

    reads_data = {m: [l.kind in INPUT_KINDS for l in ls] for m, ls in profile.layers.items()}
    needs = needs_from_flags({m: trainable[m] for m in profile.layers}, reads_data)
    return {m: [n.input for n in ns] for m, ns in needs.items()}


def load_profile_for(path: str | Path, model: MultimodalModel) -> Profile:
    """Load a profile and check it was measured on ``model`` (`ProfileError` otherwise)."""
    prof = Profile.load(path)
    prof.check_matches(model)
    return prof
