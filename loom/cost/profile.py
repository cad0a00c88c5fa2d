"""The profiler (`loom profile`) and the cost model it feeds (entrain.md §3.1).

Entrain's hardware-calibrated cost model "profiles every layer separately ... using synthetic
inputs at representative sizes ... then fits the measurements to a ... quadratic model
``T(x) = a x^2 + b x + c`` via linear regression". `profile_model` does that for every layer of
every module of a `MultimodalModel` on the current device, per phase of the Zero-Bubble split
the cost contract uses (`loom.cost.model`):

- ``forward``: the layer's forward, with autograd recording;
- ``backward_input``: ``torch.autograd.grad`` w.r.t. the layer's *input* only (autograd then
  skips the weight-gradient kernels);
- ``backward_weight``: the full backward (w.r.t. the input *and* the parameters) minus the
  input-only one, i.e. the extra work the weight gradients add. For a first layer, whose input
  is read from the context (patch embedding, token embedding), the input part is 0 and the
  full backward is all weight work.

Each is the median of ``repeats`` timed calls after ``warmup`` untimed ones (``time.
perf_counter``, with ``torch.cuda.synchronize`` around each call on a GPU). A microbatch's
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

Besides layers the profile times, per module, the per-microbatch context build (positions,
masks, RoPE tables: the executor builds it on every stage before the first layer) and, for the
LLM, the loss (cross-entropy over the logits, forward and backward); the activation bytes each
layer saves for backward (counted with ``saved_tensors_hooks``); an AdamW step as a function of
parameter and tensor counts; the matmul FLOP/s of the device; and, on two local gloo processes,
the point-to-point time of loom's own communicator (header + payload, ping-pong) and a gradient
all-reduce (flatten, all-reduce, unflatten, as the executor does), each fitted as
``alpha + bytes * seconds_per_byte``.

A profile is tied to the model it measured: it stores the model's *signature* (per module, the
layer names and parameter shapes) and its hash, and `ProfiledCostModel` refuses a model whose
signature differs, naming the first difference and the fix (re-run ``loom profile``).
"""

from __future__ import annotations

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
    """``seconds = alpha + bytes * seconds_per_byte`` (communication), with the raw points."""

    alpha_s: float = 0.0
    seconds_per_byte: float = 0.0
    points: list[list[float]] = field(default_factory=list)  # [[bytes, seconds], ...]

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.seconds_per_byte

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> "LinearFit":
        sizes = np.array([p[0] for p in points], dtype=np.float64)
        secs = np.array([p[1] for p in points], dtype=np.float64)
        w = 1.0 / np.maximum(secs, 1e-9)
        a = np.stack([np.ones_like(sizes), sizes / max(sizes.max(), 1.0)], axis=1) * w[:, None]
        alpha, slope = nnls(a, secs * w)
        return cls(float(alpha), float(slope / max(sizes.max(), 1.0)), [[float(s), float(t)] for s, t in points])


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
    p2p: LinearFit | None = None  # one-way, loom's communicator (header + payload)
    all_reduce: LinearFit | None = None  # 2 processes, flatten + all-reduce + unflatten
    all_reduce_world: int = 2
    optimizer: dict[str, float] = field(default_factory=dict)  # fixed_s, per_param_s, per_tensor_s
    matmul_flops_per_s: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)
    path: str | None = None  # where it was loaded from (not saved)

    # ---- lookups ---------------------------------------------------------------------------
    def layer_counts(self) -> dict[str, int]:
        return {m: len(ls) for m, ls in self.layers.items()}

    def module_time(self, module: str, phase: str, work: Workload, start: int = 0, end: int | None = None) -> float:
        return sum(l.time(phase, work) for l in self.layers[module][start:end])

    # ---- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
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
            "p2p": asdict(self.p2p) if self.p2p else None,
            "all_reduce": asdict(self.all_reduce) if self.all_reduce else None,
            "all_reduce_world": self.all_reduce_world,
            "optimizer": self.optimizer,
            "matmul_flops_per_s": self.matmul_flops_per_s,
            "settings": self.settings,
        }
        return d

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
                p2p=LinearFit(**d["p2p"]) if d.get("p2p") else None,
                all_reduce=LinearFit(**d["all_reduce"]) if d.get("all_reduce") else None,
                all_reduce_world=int(d.get("all_reduce_world", 2)),
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
        if self.p2p:
            tail.append(f"p2p: {self.p2p.alpha_s * 1e6:.1f} us + {1 / max(self.p2p.seconds_per_byte, 1e-30) / 1e9:.2f} GB/s")
        if self.all_reduce:
            tail.append(f"all-reduce ({self.all_reduce_world} ranks): {self.all_reduce.alpha_s * 1e6:.1f} us + "
                        f"{1 / max(self.all_reduce.seconds_per_byte, 1e-30) / 1e9:.2f} GB/s")
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


@dataclass
class _Sample:
    work: Workload
    forward: float
    backward_input: float
    backward_full: float
    saved: int


def _time_layer(layer: Layer, x: Any, ctx: dict[str, Any], repeats: int, warmup: int,
                device: torch.device) -> tuple[_Sample | None, Any, int]:
    """Time one layer on input ``x``; returns the sample (work filled in by the caller), the
    output (detached, the next layer's input) and the output's last dimension."""
    params = list(layer.module.parameters())
    was = [p.requires_grad for p in params]
    for p in params:  # profile every layer as trainable: freezing is decided when costs are asked
        p.requires_grad_(True)
    x_in = x.detach().requires_grad_(True) if _float_tensor(x) else x
    has_input = _float_tensor(x_in)
    try:
        exclude = {p.untyped_storage().data_ptr() for p in params}
        saved, out = _saved_bytes(lambda: layer(x_in, ctx), exclude)
        grad_out = torch.randn_like(out)
        wrt_all = ([x_in] if has_input else []) + params
        fwd, full, inp = [], [], []
        for r in range(warmup + repeats):
            t, out = _timed(lambda: layer(x_in, ctx), device)
            tf, _ = _timed(lambda: torch.autograd.grad(out, wrt_all, grad_out, allow_unused=True), device)
            if r >= warmup:
                fwd.append(t)
                full.append(tf)
            if has_input:
                t2, out = _timed(lambda: layer(x_in, ctx), device)
                ti, _ = _timed(lambda: torch.autograd.grad(out, [x_in], grad_out, allow_unused=True), device)
                if r >= warmup:
                    fwd.append(t2)
                    inp.append(ti)
        sample = _Sample(Workload(), statistics.median(fwd), statistics.median(inp) if inp else 0.0,
                         statistics.median(full), saved)
        with torch.no_grad():
            nxt = layer(x_in, ctx)
    finally:
        for p, w in zip(params, was):
            p.requires_grad_(w)
    nxt = nxt.detach() if isinstance(nxt, torch.Tensor) else nxt
    return sample, nxt, int(out.shape[-1])


def _time_call(fn: Callable[[], Any], repeats: int, warmup: int, device: torch.device) -> float:
    times = []
    for r in range(warmup + repeats):
        t, _ = _timed(fn, device)
        if r >= warmup:
            times.append(t)
    return statistics.median(times)


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
def _profile_module(model: MultimodalModel, name: str, token_counts: Sequence[int], repeats: int, warmup: int,
                    device: torch.device, gen: torch.Generator, log: Callable[[str], None] | None):
    layers = model.module_layers(name)
    samples: list[list[_Sample]] = [[] for _ in layers]
    widths = [0] * len(layers)
    context: list[tuple[Workload, float]] = []
    loss: list[tuple[Workload, float, float]] = []
    configs: list[tuple[Batch, Workload]] = []
    dummy = torch.zeros(1, 1, dtype=torch.long, device=device)
    if name == LLM:
        for x in token_counts:
            for b, length in _llm_shapes(x):
                configs.append((_llm_batch(model, b, length, gen, device), Workload.padded([length] * b)))
    else:
        shapes = [[]] + [s for x in token_counts for s in _item_shapes(x)]
        for items in shapes:
            inputs = _encoder_inputs(model, name, items, gen, device)
            configs.append((Batch(input_ids=dummy, labels=dummy, modality_inputs={name: inputs}, sample_ids=[]),
                            Workload.of_lengths(items)))
    for batch, work in configs:
        gc.collect()
        context.append((work, _time_call(lambda: model.module_context(name, batch), repeats, warmup, device)))
        ctx = model.module_context(name, batch)
        x: Any = {} if name == LLM else None
        for i, layer in enumerate(layers):
            sample, x, widths[i] = _time_layer(layer, x, ctx, repeats, warmup, device)
            sample.work = work
            samples[i].append(sample)
        if name == LLM:
            logits = x.detach().requires_grad_(True)
            n = max(int((batch.labels != IGNORE_INDEX).sum()), 1)
            fwd = _time_call(lambda: loss_sum(logits, batch.labels) / n, repeats, warmup, device)
            g = torch.ones((), device=device)

            def loss_backward():
                out = loss_sum(logits, batch.labels) / n
                t, _ = _timed(lambda: torch.autograd.grad(out, [logits], g), device)
                return t

            bwd = statistics.median([loss_backward() for _ in range(warmup + repeats)][warmup:])
            loss.append((work, fwd, bwd))
        if log is not None:
            log(f"  {name}: tokens {work.tokens:6d} segments {work.segments:3d}: "
                f"F {sum(s[-1].forward for s in samples) * 1e3:8.3f} ms, "
                f"B {sum(s[-1].backward_full for s in samples) * 1e3:8.3f} ms")
    fitted = []
    for layer, ss, width in zip(layers, samples, widths):
        works = [s.work for s in ss]
        # backward_weight = fit(full) - fit(input only), coefficient by coefficient, so that
        # backward_input + backward_weight is exactly the fitted full backward (differences of
        # single noisy timings would be noisier than the difference of two fits)
        full = fit_cost(works, [s.backward_full for s in ss])
        inp = (fit_cost(works, [s.backward_input for s in ss]) if any(s.backward_input for s in ss)
               else [0.0] * len(FEATURES))
        fitted.append(LayerProfile(
            name=layer.name, kind=layer.kind, params=sum(p.numel() for p in layer.module.parameters()),
            out_width=width,
            forward=fit_cost(works, [s.forward for s in ss]),
            backward_input=inp,
            backward_weight=[f - i for f, i in zip(full, inp)],
            activation_bytes=fit_cost(works, [float(s.saved) for s in ss], relative=False),
        ))
    ctx_fit = fit_cost([w for w, _ in context], [t for _, t in context])
    loss_fit = {}
    if loss:
        loss_fit = {"forward": fit_cost([w for w, _, _ in loss], [f for _, f, _ in loss]),
                    "backward_input": fit_cost([w for w, _, _ in loss], [b for _, _, b in loss])}
    return fitted, ctx_fit, loss_fit


def measure_optimizer(repeats: int = 5, device: torch.device | str = "cpu") -> dict[str, float]:
    """Time ``AdamW.step`` + ``zero_grad`` (what the executor's optimizer_step runs) over
    parameter lists of several sizes and tensor counts; fit ``fixed + per_tensor * tensors +
    per_param * params``."""
    device = torch.device(device)
    shapes = [(1, 1_000), (1, 200_000), (1, 1_000_000), (16, 16_000), (16, 400_000), (64, 64_000), (64, 640_000)]
    rows, times = [], []
    for count, total in shapes:
        params = [torch.nn.Parameter(torch.randn(total // count, device=device)) for _ in range(count)]
        grads = [torch.randn_like(p) for p in params]
        opt = torch.optim.AdamW(params, lr=1e-3)
        ts = []
        for r in range(repeats + 2):
            for p, g in zip(params, grads):
                p.grad = g.clone()

            def step():
                opt.step()
                opt.zero_grad(set_to_none=True)

            t, _ = _timed(step, device)
            if r >= 2:
                ts.append(t)
        rows.append([1.0, count, total])
        times.append(statistics.median(ts))
    x = np.array(rows, dtype=np.float64)
    y = np.array(times)
    scale = x.max(axis=0)
    coef = nnls(x / scale / y[:, None], np.ones_like(y)) / scale
    return {"fixed_s": float(coef[0]), "per_tensor_s": float(coef[1]), "per_param_s": float(coef[2])}


def measure_matmul_flops(size: int = 512, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    device = torch.device(device)
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    t = _time_call(lambda: a @ b, repeats, 2, device)
    return 2.0 * size ** 3 / t


def _comm_worker(rank: int, world_size: int, sizes: list[int], repeats: int, out_path: str) -> None:
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    # the runtime's own communicator, so the fit includes its header message and bookkeeping
    from loom.runtime.comm import P2PCommunicator

    comm = P2PCommunicator(torch.device("cpu"))
    p2p, allreduce = [], []
    for nbytes in sizes:
        t = torch.randn(nbytes // 4)
        ts = []
        for r in range(repeats + 3):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                comm.send(t, 1, tag=1)
                comm.wait_sends()
                comm.recv(1, tag=2)
            else:
                got = comm.recv(0, tag=1)
                comm.send(got, 0, tag=2)
                comm.wait_sends()
            if r >= 3:
                ts.append((time.perf_counter() - t0) / 2)
        p2p.append([nbytes, statistics.median(ts)])
        # a gradient bucket as the executor syncs it: 4 tensors flattened, summed, unflattened
        grads = [torch.randn(max(nbytes // 16, 1)) for _ in range(4)]
        ts = []
        for r in range(repeats + 3):
            dist.barrier()
            t0 = time.perf_counter()
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            grads = list(_unflatten_dense_tensors(flat, grads))
            if r >= 3:
                ts.append(time.perf_counter() - t0)
        allreduce.append([sum(g.numel() for g in grads) * 4, statistics.median(ts)])
    if rank == 0:
        Path(out_path).write_text(json.dumps({"p2p": p2p, "all_reduce": allreduce}))


def measure_communication(sizes: Sequence[int] = (0, 4_096, 65_536, 262_144, 1_048_576, 4_194_304),
                          repeats: int = 9) -> tuple[LinearFit, LinearFit]:
    """Ping-pong and all-reduce on two local gloo processes (one thread each)."""
    from loom.runtime.local import run_local

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        run_local(_comm_worker, 2, list(sizes), repeats, out, threads=1)
        data = json.loads(Path(out).read_text())
    return LinearFit.fit(data["p2p"]), LinearFit.fit(data["all_reduce"])


def device_description(device: torch.device) -> dict[str, Any]:
    d = {"kind": device.type, "threads": torch.get_num_threads(), "torch": torch.__version__.split("+")[0],
         "machine": platform.machine(), "cpus": os.cpu_count()}
    if device.type == "cuda":
        d["name"] = torch.cuda.get_device_name(device)
    else:
        d["name"] = platform.processor() or platform.machine()
    return d


def profile_model(
    model: MultimodalModel,
    token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS,
    repeats: int = 5,
    warmup: int = 1,
    device: torch.device | str = "cpu",
    threads: int | None = 1,
    measure_comm: bool = True,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> Profile:
    """Profile every layer of every module of ``model`` on ``device`` (see the module
    docstring). ``threads`` sets torch's intra-op threads for the measurement (1: as each rank
    of a local CPU run; ``None`` keeps the current setting). ``measure_comm`` also runs the
    2-process communication measurements (a few seconds); without it the profile has no
    communication fits and the cost model charges no communication time."""
    device = torch.device(device)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    training = model.training
    model.to(device)
    try:
        layers, context, loss = {}, {}, {}
        for name in model.module_names:
            layers[name], context[name], lf = _profile_module(model, name, token_counts, repeats, warmup, device, gen, log)
            if lf:
                loss = lf
        optimizer = measure_optimizer(device=device)
        flops = measure_matmul_flops(device=device)
        desc = device_description(device)
    finally:
        model.train(training)
        if threads is not None:
            torch.set_num_threads(old_threads)
    p2p = all_reduce = None
    if measure_comm:
        p2p, all_reduce = measure_communication()
    sig = model_signature(model)
    return Profile(
        signature=sig, signature_hash=signature_hash(sig), device=desc, layers=layers, context=context, loss=loss,
        dtype_bytes=next(model.llm.parameters()).element_size(), p2p=p2p, all_reduce=all_reduce,
        optimizer=optimizer, matmul_flops_per_s=flops,
        settings={"token_counts": list(token_counts), "repeats": repeats, "warmup": warmup, "seed": seed,
                  "seconds": round(time.perf_counter() - started, 2),
                  "backward_weight": "full backward (input + parameters) minus input-only backward"},
    )


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
    - communication: the measured one-way time of loom's communicator for the activation's
      bytes (tokens x output width x dtype bytes); gradient sync from the 2-rank all-reduce fit,
      carried to ``n`` ranks as a ring (``(n-1) alpha + 2 (n-1)/n bytes / bandwidth``).
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

    def forward_time(self, module: str, stage: int, work: Workload) -> float:
        prof = self.profile
        t = evaluate(prof.context.get(module, [0.0] * len(FEATURES)), work)
        t += sum(prof.layers[module][i].time("forward", work) for i in self._layers(module, stage))
        if self._is_last_llm(module, stage) and prof.loss:
            t += evaluate(prof.loss["forward"], work)
        return max(t, 0.0)

    def backward_time(self, module: str, stage: int, work: Workload) -> float:
        if not self.stage_needs_backward(module, stage):
            return 0.0
        layers = self.profile.layers[module]
        t = 0.0
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
        return t / self._split(module)

    def activation_bytes(self, module: str, stage: int, work: Workload) -> float:
        """Bytes of the activation the stage sends on (its last layer's output)."""
        last = self.profile.layers[module][self._layers(module, stage)[-1]]
        return float(work.tokens) * last.out_width * self.profile.dtype_bytes

    def transfer_time(self, src_unit: int, dst_unit: int, module: str, stage: int, work: Workload) -> float:
        if src_unit == dst_unit or self.profile.p2p is None:
            return 0.0
        return self.profile.p2p.time(self.activation_bytes(module, stage, work) / self._split(module))

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
        fit = self.profile.all_reduce
        if n <= 1 or params == 0 or fit is None:
            return 0.0
        nbytes = params * self.profile.dtype_bytes / (spec.tensor_parallel)
        ref = self.profile.all_reduce_world  # measured on `ref` ranks: per-step latency and ring bytes scale
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
    `loom.cost.frozen.backward_needs`, applied to the profile's layer kinds and these flags."""
    from types import SimpleNamespace

    from loom.cost.frozen import backward_needs

    arch = SimpleNamespace(modules={
        m: SimpleNamespace(layers=[SimpleNamespace(kind=l.kind, trainable=f) for l, f in zip(ls, trainable[m])])
        for m, ls in profile.layers.items()
    })
    return {m: [n.input for n in needs] for m, needs in backward_needs(arch).items()}


def load_profile_for(path: str | Path, model: MultimodalModel) -> Profile:
    """Load a profile and check it was measured on ``model`` (`ProfileError` otherwise)."""
    prof = Profile.load(path)
    prof.check_matches(model)
    return prof
