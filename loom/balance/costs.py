"""Per-sample costs of a batch, per phase, as NumPy arrays: what every policy balances.

A sample's cost in a module is the module's forward FLOPs for it (`loom.cost.flops`), linear in
the `Workload`'s ``tokens`` and ``attn_sq``, so two coefficients per module and the metadata-to-
workload rule over arrays (`loom.cost.workload.sample_tokens`) give every sample's cost without a
Python object per sample. The decisions only compare costs, so the hardware's rate cancels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from loom.balance.payload import sample_payload_bytes
from loom.cost.arch import ModelArch, ModuleArch
from loom.cost.flops import attention_flops, gemm_flops
from loom.cost.frozen import backward_needs
from loom.cost.model import Workload
from loom.cost.workload import MetadataArrays, sample_tokens
from loom.data.sample import SampleMeta
from loom.plan.plan import LLM


@dataclass(frozen=True)
class SampleCosts:
    """Per phase, each sample's forward FLOPs (float64 arrays); the LLM's token lengths (int64)
    and its per-token (``alpha``) and per-token² (``beta``) FLOPs, for padded microbatches,
    which cost ``count * (alpha * longest + beta * longest²)``."""

    work: dict[str, np.ndarray]
    llm_lengths: np.ndarray
    llm_alpha: float
    llm_beta: float
    # per phase, each sample's payload bytes as the dispatcher moves them (`loom.balance.payload`),
    # or the function that computes them: node-wise rearrangement needs them, the balancing
    # itself does not, so the hot path does not pay for them unless asked (`payload_bytes`)
    payload: "dict[str, np.ndarray] | Callable[[], dict[str, np.ndarray]] | None" = None
    # per phase, the batch's backward FLOPs over its forward FLOPs under the frozen-aware rule
    # (`loom.cost.frozen`): 2 for a trainable module, 0 for a frozen encoder nothing before it
    # trains, in between for a frozen module that only passes input gradients on; a phase not
    # named costs 2 (`backward_ratio_of`). What the never-slower prediction prices backward at.
    backward_ratio: dict[str, float] = field(default_factory=dict)

    def backward_ratio_of(self, phase: str) -> float:
        return float(self.backward_ratio.get(phase, 2.0))

    def __post_init__(self) -> None:
        # lists are accepted (tests, hand-built costs); the policies index arrays
        object.__setattr__(self, "work", {p: np.asarray(v, dtype=np.float64) for p, v in self.work.items()})
        object.__setattr__(self, "llm_lengths", np.asarray(self.llm_lengths, dtype=np.int64))

    @property
    def payload_bytes(self) -> dict[str, np.ndarray] | None:
        """Per phase, each sample's payload bytes (None when not known), computed once."""
        if callable(self.payload):
            object.__setattr__(self, "payload", self.payload())
        return self.payload

    @property
    def num_samples(self) -> int:
        return int(len(self.llm_lengths))

    def llm_padded_weight(self) -> np.ndarray:
        """Each sample's padded per-row cost ``alpha * l + beta * l²`` (a microbatch costs its
        row count times the largest of these); computed once (the policy and its never-slower
        check both read it)."""
        cached = self.__dict__.get("_padded_weight")
        if cached is None:
            l = np.asarray(self.llm_lengths, dtype=np.float64)
            cached = self.llm_alpha * l + self.llm_beta * l * l
            cached.flags.writeable = False
            object.__setattr__(self, "_padded_weight", cached)
        return cached


def module_coefficients(arch: ModelArch, name: str) -> tuple[float, float]:
    """Forward FLOPs of module ``name`` per token and per attention length² (both are linear
    in a `Workload`'s ``tokens`` and ``attn_sq``, so two evaluations give every sample's cost)."""
    # every step costs the same modules: keep each (frozen) module's coefficients, a walk over
    # every layer's FLOP formulas (~1 ms a module), keyed by the module object itself
    module = arch.module(name)
    held, coefficients = _COEFFICIENTS.get(id(module), (None, (0.0, 0.0)))
    if held is not module:
        if len(_COEFFICIENTS) > 64:
            _COEFFICIENTS.clear()
        coefficients = (sum(gemm_flops(l, Workload(tokens=1)).forward for l in module.layers),
                        sum(attention_flops(l, Workload(attn_sq=1)).forward for l in module.layers))
        _COEFFICIENTS[id(module)] = (module, coefficients)
    return coefficients


_COEFFICIENTS: dict[int, tuple[ModuleArch, tuple[float, float]]] = {}


def backward_coefficients(arch: ModelArch) -> dict[str, tuple[float, float]]:
    """Per module, its backward FLOPs per token and per attention length² under the frozen-aware
    rule (`loom.cost.frozen.backward_needs`, cornstarch.md §3.2.2: a layer runs its weight
    gradient iff trainable, its input gradient iff something at or before it trains), the parts
    `loom.cost.flops` prices. Depends on the whole model (a trainable encoder makes a frozen LLM
    pass input gradients), so kept per tuple of module objects."""
    modules = tuple(arch.modules.values())
    key = tuple(map(id, modules))
    held = _BACKWARD.get(key)
    if held is not None and all(a is b for a, b in zip(held[0], modules)):
        return held[1]
    needs = backward_needs(arch)
    out = {}
    for name in arch.module_names:
        layers = arch.module(name).layers
        out[name] = (sum(gemm_flops(l, Workload(tokens=1)).trained(n) - gemm_flops(l, Workload(tokens=1)).forward
                         for l, n in zip(layers, needs[name])),
                     sum(attention_flops(l, Workload(attn_sq=1)).trained(n)
                         - attention_flops(l, Workload(attn_sq=1)).forward for l, n in zip(layers, needs[name])))
    if len(_BACKWARD) > 16:
        _BACKWARD.clear()
    _BACKWARD[key] = (modules, out)
    return out


_BACKWARD: dict[tuple[int, ...], tuple[tuple[ModuleArch, ...], dict[str, tuple[float, float]]]] = {}


def sample_costs(arch: ModelArch, metas: MetadataArrays | Sequence[SampleMeta]) -> SampleCosts:
    """Costs of every sample of a batch, from metadata only (arrays, or `SampleMeta`s that are
    turned into arrays first)."""
    if not isinstance(metas, MetadataArrays):
        metas = MetadataArrays.from_metas(metas)
    tok = sample_tokens(arch, metas)
    work = {}
    ratio = {}
    backward = backward_coefficients(arch)
    for name in arch.module_names:
        a, b = module_coefficients(arch, name)
        # an int64 array times a Python float is float64 already: no converted copies, same values
        w = float(a) * tok.tokens[name]
        w += float(b) * tok.attn_sq[name]  # in place: one temporary fewer, the same sums
        work[name] = w
        # the batch's backward over forward FLOPs: exact per sample when the module's token and
        # attention parts have one ratio (trainable: 2, frozen before any trainable layer: 0)
        ba, bb = backward[name]
        if ba == 2.0 * a and bb == 2.0 * b:
            ratio[name] = 2.0
        else:
            t, q = float(tok.tokens[name].sum()), float(tok.attn_sq[name].sum())
            forward = a * t + b * q
            ratio[name] = (ba * t + bb * q) / forward if forward > 0 else 0.0
    alpha, beta = module_coefficients(arch, LLM)
    return SampleCosts(work, tok.tokens[LLM], alpha, beta, lambda: sample_payload_bytes(arch, metas), ratio)
