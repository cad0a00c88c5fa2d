"""The profile file format: what `loom profile` measured (`Profile`), as JSON.

A profile holds, per module, each layer's fitted costs per phase of the Zero-Bubble split the
cost contract uses (`loom.cost.model`: ``forward``, ``backward_input``, ``backward_weight``; the
fit is `loom.cost.profile_fit`), the activation bytes each layer saves for backward, the
per-microbatch context build and, for the LLM, the loss; an AdamW step as a function of
parameter and tensor counts; the matmul FLOP/s of the device; the autograd engine's fixed
per-call cost; the measured message and all-reduce costs (`Communication`); and the
dispatcher's host work per step (``dispatch``, `loom.profile.dispatch`); and the CPU slowdown of
that work with the host's other ranks computing alongside (``contention``,
`loom.profile.contention`, priced by `loom.sim.sharing`).

A profile is tied to the model it measured: it stores the model's *signature* (per module, the
layer names and parameter shapes) and its hash, and a model whose signature differs is refused
(`Profile.check_matches`), naming the first difference and the fix (re-run ``loom profile``).
It is tied to the precision it measured too: ``dtype`` is the run's ``run.dtype`` the layers
ran under (fp32, or bf16 autocast; files written before the field existed are fp32, all the
profiler ran then), and `load_profile_for` refuses it for a run of another dtype
(`Profile.check_dtype`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from loom.cost.model import Workload
from loom.cost.profile_comm import Communication
from loom.cost.profile_fit import FEATURES, evaluate
from loom.model.multimodal import MultimodalModel
from loom.plan.plan import LLM

FORMAT = "loom-profile"
VERSION = 1
DTYPES = ("fp32", "bf16")  # run.dtype (loom.runtime.precision), what a profile's layers ran under
PHASES = ("forward", "backward_input", "backward_weight")

Signature = dict[str, list[list[Any]]]  # module -> [[layer name, [[param name, shape], ...]], ...]


class ProfileError(ValueError):
    """A profile file that cannot be used: unreadable, or measured on another model. The
    message names the file, what differs and the fix."""


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
    # seconds more its forward / full backward takes right after a cache eviction than warm (a
    # median of differences: about 0, either side, for a layer of little data; 0 in files
    # written before they were measured, and on a GPU)
    cold_forward_s: float = 0.0
    cold_backward_s: float = 0.0

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
    dtype: str = "fp32"  # the run.dtype the layers were timed under (module docstring)
    comm: Communication | None = None
    backward_call_s: float = 0.0  # one autograd engine call (taken off each layer, paid per stage)
    optimizer: dict[str, float] = field(default_factory=dict)  # fixed_s, per_param_s, per_tensor_s
    matmul_flops_per_s: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)
    # the dispatcher's host work per step (`loom.profile.dispatch`): per rank fixed_s and
    # per_sample_s, and the world size it was measured at; empty when not measured
    dispatch: dict[str, Any] = field(default_factory=dict)
    # the CPU slowdown of the layers' work with other ranks computing on the host
    # (`loom.profile.contention`): busy (ranks computing at once), cpu_ratio; empty when not measured
    contention: dict[str, Any] = field(default_factory=dict)
    path: str | None = None  # where it was loaded from (not saved)

    # ---- lookups ---------------------------------------------------------------------------
    def layer_counts(self) -> dict[str, int]:
        return {m: len(ls) for m, ls in self.layers.items()}

    def dispatch_host_seconds(self, batch_size: int, world_size: int) -> list[float] | None:
        """Each rank's dispatcher host work per step (CPU seconds, rank order) for a global batch
        of ``batch_size`` samples, or None when the profile has no dispatch fit or was measured
        at another world size (a rank's share of the work depends on it)."""
        if not self.dispatch or int(self.dispatch.get("world_size", 0)) != world_size:
            return None
        return [float(a) + float(c) * batch_size for a, c in zip(self.dispatch["fixed_s"], self.dispatch["per_sample_s"])]

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
            "dtype": self.dtype,
            "layers": {m: [asdict(l) for l in ls] for m, ls in self.layers.items()},
            "context": self.context,
            "loss": self.loss,
            "comm": self.comm.to_dict() if self.comm else None,
            "backward_call_s": self.backward_call_s,
            "optimizer": self.optimizer,
            "matmul_flops_per_s": self.matmul_flops_per_s,
            "settings": self.settings,
            "dispatch": self.dispatch,
            "contention": self.contention,
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
                dtype=str(d.get("dtype", "fp32")),
                comm=Communication.from_dict(d["comm"]) if d.get("comm") else None,
                backward_call_s=float(d.get("backward_call_s", 0.0)),
                optimizer={k: float(v) for k, v in d.get("optimizer", {}).items()},
                matmul_flops_per_s=float(d.get("matmul_flops_per_s", 0.0)),
                settings=dict(d.get("settings", {})),
                dispatch=dict(d.get("dispatch") or {}),
                contention=dict(d.get("contention") or {}),
            )
        except (KeyError, TypeError, IndexError) as e:
            raise ProfileError(f"{where} is malformed ({type(e).__name__}: {e}); re-run `loom profile`") from e
        if prof.dtype not in DTYPES:
            raise ProfileError(f"{where} has \"dtype\": {prof.dtype!r}, not one of {list(DTYPES)}; re-run "
                               f"`loom profile`")
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

    def check_dtype(self, dtype: str) -> None:
        """Raise `ProfileError` unless this profile's layers were timed under ``dtype``, the
        run's ``run.dtype``: bf16 layers run at other speeds than fp32 ones."""
        if dtype == self.dtype:
            return
        where = f"profile file {self.path!r}" if self.path else "the profile"
        raise ProfileError(
            f"{where} was measured with \"dtype\": {self.dtype!r} but the run has run.dtype = {dtype!r}: re-run "
            f"`loom profile` with run.dtype={dtype} (its layers are then timed under that precision), or set "
            f"run.dtype = {self.dtype!r}"
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
        head = (f"per-layer fits at {tokens} tokens (one sequence / item), {self.device.get('kind')} x "
                f"{self.device.get('threads')} thread(s), {self.dtype}")
        tail = []
        if self.comm:
            for what in ("send_post", "recv_ready", "latency", "recv_ready_idle", "latency_idle", "latency_full",
                         "all_reduce", "thread_send", "thread_recv"):
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


def load_profile_for(path: str | Path, model: MultimodalModel, dtype: str = "fp32") -> Profile:
    """Load a profile and check it was measured on ``model`` under the run's ``dtype``
    (``run.dtype``, whose default is fp32); `ProfileError` otherwise."""
    prof = Profile.load(path)
    prof.check_matches(model)
    prof.check_dtype(dtype)
    return prof
