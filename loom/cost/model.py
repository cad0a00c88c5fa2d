"""The cost-model contract: what the simulator, the partitioner and the planners ask of a cost
model, and what an analytic (hardware specs) or profiled (measured) model must answer.

Everything is *per pipeline unit* (one stage replica, i.e. its TP x CP ranks together, see
`loom.plan.plan`) and in seconds or bytes *per rank*: TP and CP scaling and the communication
they add are inside the numbers. Costs are functions of a `Workload`, the token counts a
microbatch gives a module, which follow from sample metadata alone (docs/architecture.md principle 4).

Phases follow the Zero-Bubble split used by Cornstarch's frozen-aware rule (cornstarch.md
§3.2.2, eqs. 3.1-3.3): ``backward = backward_input + backward_weight``, where the weight part
exists only for trainable layers and the input part only when something trainable lies at or
before the layer (across modules: an LLM layer back-propagates when any encoder is trainable).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, Literal

from loom.plan.plan import Plan

Phase = Literal["forward", "backward_input", "backward_weight"]
# what a compute action of the schedule IR costs: a forward, a whole backward, or one part of
# ZB-H1's split backward (the phase names, `loom.schedule.ir.ActionKind` values)
StageKind = Literal["forward", "backward", "backward_input", "backward_weight"]


@dataclass(frozen=True)
class Workload:
    """What one microbatch asks of one module.

    - ``tokens``: tokens the module processes (after padding if the runtime pads);
    - ``attn_sq``: the sum over attention segments (images, clips, sequences) of length², which
      drives the quadratic part of attention;
    - ``segments``: how many segments (sequences or items).

    For one sequence of length ``x`` these are ``(x, x*x, 1)``, so a fitted
    ``a*attn_sq + b*tokens + c*segments`` is entrain.md §3.1's ``a x^2 + b x + c``.
    """

    tokens: int = 0
    attn_sq: int = 0
    segments: int = 0

    @staticmethod
    def of_lengths(lengths: Iterable[int]) -> "Workload":
        ls = [int(n) for n in lengths if n > 0]
        return Workload(sum(ls), sum(n * n for n in ls), len(ls))

    @staticmethod
    def padded(lengths: Iterable[int]) -> "Workload":
        """A right-padded batch: every sequence costs the longest one (what loom's runtime
        does for the LLM today)."""
        ls = [int(n) for n in lengths]
        if not ls:
            return Workload()
        longest = max(ls)
        return Workload(longest * len(ls), longest * longest * len(ls), len(ls))

    def __add__(self, other: "Workload") -> "Workload":
        return Workload(self.tokens + other.tokens, self.attn_sq + other.attn_sq, self.segments + other.segments)

    def share(self, n: int) -> "Workload":
        """One of ``n`` equal shares by segments (an encoder in lanes, `loom.plan.plan.Plan.lanes`),
        rounded up: the slowest lane's."""
        return self if n == 1 else Workload(-(-self.tokens // n), -(-self.attn_sq // n), -(-self.segments // n))


# A microbatch's workload per module: {"vision": Workload, "audio": ..., "llm": ...}.
MicrobatchWork = dict[str, Workload]


class CostModel(ABC):
    """Durations and memory of a plan's stages. Implementations: `loom.cost.analytic`
    (hardware specs) and `loom.cost.profiled` (fitted on the real device)."""

    plan: Plan

    # ---- compute ------------------------------------------------------------------------
    @abstractmethod
    def stage_time(self, module: str, stage: int, kind: StageKind, work: Workload) -> float:
        """Seconds one rank of the stage spends on a forward or a (frozen-aware) backward of a
        microbatch with this workload, including TP/CP communication inside the stage and, for
        ``backward`` with ``plan`` recompute on, the recomputed forward. ``backward_input`` and
        ``backward_weight`` are the two parts of the zero-bubble split (ZB-H1's actions), which
        sum to ``backward``: the input part covers the whole chain of input gradients through
        the stage (what the previous stage waits for), the weight part the parameter gradients."""

    def cold_start_time(self, module: str, stage: int, kind: StageKind) -> float:
        """Seconds a compute action of ``stage_time`` takes more when it starts with the caches
        holding none of its data, as on a CPU core shared with other ranks that ran in between
        (the simulator's core sharing charges it there, `loom.sim.sharing`). Default 0: a GPU's
        kernels do not start from the host's caches."""
        return 0.0

    # ---- communication ------------------------------------------------------------------
    @abstractmethod
    def transfer_time(self, src_unit: int, dst_unit: int, module: str, stage: int, work: Workload) -> float:
        """Seconds to move the output activation of ``(module, stage)`` for this workload (or,
        backwards, the gradient of the same shape) from pipeline unit ``src_unit`` to
        ``dst_unit``, over the link between them (same node or not)."""

    def transfer_cpu(self, src_unit: int, dst_unit: int, module: str, stage: int, work: Workload
                     ) -> tuple[float, float]:
        """CPU seconds that moving the message of `transfer_time` costs the sender's host and the
        receiver's host outside the ranks' own threads (a communication library's threads), which
        the simulator's core sharing charges to those hosts' cores. Default 0: on a GPU cluster
        NCCL moves data without host CPU."""
        return 0.0, 0.0

    def condition_transfer_time(self, src_unit: int, dst_unit: int, generator: str, work: Workload) -> float:
        """Seconds to move generator ``generator``'s conditioning states (the LLM's final states at
        its generation positions, disttrain.md §1), or their gradient, between the LLM's last
        stage and the generator's first, for the generator's ``work`` (one segment per item). A
        model that prices generators overrides it."""
        raise ValueError(f"{type(self).__name__} does not price generators (module {generator!r}): use the analytic "
                         f"cost model (loom simulate) for plans with a generator")

    @abstractmethod
    def grad_sync_time(self, module: str, stage: int) -> float:
        """Seconds of the stage's gradient synchronisation across its data-parallel replicas
        (all-reduce, or reduce-scatter under ZeRO-2/3); 0 with one replica or nothing trainable."""

    def clip_time(self) -> float:
        """Seconds of gradient clipping's global-norm all-reduce (one fp32 scalar over every
        rank, once per iteration when ``optim.max_grad_norm`` > 0); 0 unless a model prices it."""
        return 0.0

    @abstractmethod
    def optimizer_time(self, module: str, stage: int) -> float:
        """Seconds of the optimizer step of the stage's trainable parameters on one rank."""

    # ---- memory -------------------------------------------------------------------------
    @abstractmethod
    def static_memory(self, module: str, stage: int) -> float:
        """Bytes per rank held for the whole run: parameters, gradients and optimizer states
        (sharded by TP, and by DP under ZeRO)."""

    @abstractmethod
    def activation_memory(self, module: str, stage: int, work: Workload) -> float:
        """Bytes per rank a microbatch's forward keeps until its backward (only the stage's
        input per layer under recompute; nothing for a stage without backward)."""

    def transient_memory(self, module: str, stage: int, work: Workload) -> float:
        """Bytes live only *during* a backward on top of what is held (under recompute, one
        block's full activations while it is recomputed); 0 unless a model says otherwise."""
        return 0.0

    # ---- throughput ---------------------------------------------------------------------
    @abstractmethod
    def model_flops(self, work: MicrobatchWork) -> float:
        """Model FLOPs of a microbatch (forward + backward as trained: frozen-aware, without
        recomputation), over all modules; the numerator of MFU."""

    @abstractmethod
    def peak_flops_per_rank(self) -> float:
        """Peak dense FLOP/s of one rank's device; MFU = model FLOPs / (time x ranks x peak)."""
