"""Per-sample costs of a batch, per phase, as NumPy arrays: what every policy balances.

A sample's cost in a module is the module's forward FLOPs for it (`loom.cost.flops`), linear in
the `Workload`'s ``tokens`` and ``attn_sq``, so two coefficients per module and the metadata-to-
workload rule over arrays (`loom.cost.workload.sample_tokens`) give every sample's cost without a
Python object per sample. The decisions only compare costs, so the hardware's rate cancels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from loom.balance.payload import sample_payload_bytes
from loom.cost.arch import ModelArch, ModuleArch
from loom.cost.flops import attention_flops, gemm_flops
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


def sample_costs(arch: ModelArch, metas: MetadataArrays | Sequence[SampleMeta]) -> SampleCosts:
    """Costs of every sample of a batch, from metadata only (arrays, or `SampleMeta`s that are
    turned into arrays first)."""
    if not isinstance(metas, MetadataArrays):
        metas = MetadataArrays.from_metas(metas)
    tok = sample_tokens(arch, metas)
    work = {}
    for name in arch.module_names:
        a, b = module_coefficients(arch, name)
        # an int64 array times a Python float is float64 already: no converted copies, same values
        work[name] = float(a) * tok.tokens[name] + float(b) * tok.attn_sq[name]
    alpha, beta = module_coefficients(arch, LLM)
    return SampleCosts(work, tok.tokens[LLM], alpha, beta, lambda: sample_payload_bytes(arch, metas))
