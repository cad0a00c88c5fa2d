"""Which samples each phase's microbatch slots hold in one iteration (the balancers' output).

A *phase* is a module of the plan (each encoder, and the LLM). One iteration has ``M``
microbatch *slots*; slot ``j`` of module ``m`` runs on replica ``j % dp_m`` (the plan's
round-robin rule), so a layout decides at once which data-parallel replica and which microbatch
of that replica's pipeline each sample goes to, per phase. Phases may disagree: a sample can
sit in encoder slot ``j`` and LLM slot ``k`` (OrchMLLM rearranges each phase on its own;
Entrain defers a sample's LLM work one microbatch). The routes between them are what the
schedule generator turns into activation edges and the executor into per-sample row exchanges.

Samples are named by their *position* in the global batch (``0..B-1``); the dispatcher maps
positions to dataset indices. `BatchLayout.check` is the "no sample dropped or duplicated"
guarantee every policy's output passes through.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from loom.plan.plan import LLM, Plan


class LayoutError(ValueError):
    """A layout that loses, duplicates or misroutes samples; the message names the phase."""


Slots = tuple[tuple[int, ...], ...]


class BatchLayout:
    """``slots[phase][j]``: positions (in the global batch) of the samples of slot ``j`` of
    ``phase``, in the order they are collated. ``policy`` records what produced it.

    Held as arrays per phase (``order``: the positions slot by slot; ``bounds``: slot ``j`` is
    ``order[bounds[j]:bounds[j + 1]]``) so the balancing policies build and check a layout of
    153,600 samples without a Python object per sample; ``slots`` materialises the tuples on
    first use. ``kept_given`` / ``predicted_gain`` say whether a policy kept the given (identity)
    layout because its predicted gain did not pay for the decision (`loom.balance.policy`);
    ``kept_why`` says why in words (empty when the policy's own layout is used)."""

    def __init__(self, slots: "dict[str, Slots] | None" = None, policy: dict[str, str] | None = None, *,
                 arrays: "dict[str, tuple[np.ndarray, np.ndarray]] | None" = None, kept_given: bool = False,
                 predicted_gain: dict[str, float] | None = None):
        if (slots is None) == (arrays is None):
            raise LayoutError("BatchLayout needs either slots or arrays (order, bounds) per phase")
        self.policy: dict[str, str] = dict(policy or {})
        self.kept_given = kept_given
        self.predicted_gain: dict[str, float] = dict(predicted_gain or {})
        self.kept_why = ""
        # extra microbatches the encoders forward before their first backward under this layout,
        # as its policy chose them (Entrain's eager forward); `build_schedule` deepens the warmup
        # to at least this
        self.eager_forward = 0
        # OrchMLLM's node-wise rearrangement (loom.balance.rearrange): per phase, the slot each
        # slot's samples had before the permutation, and the cross-node bytes before/after
        self.unpermuted_slot: dict[str, np.ndarray] = {}
        # every phase's order is 0..B-1 (`contiguous_layout`): slot ``j`` is positions
        # ``bounds[j]..bounds[j + 1] - 1``, so per-slot sums need no gather
        self.contiguous = False
        self.nodewise: dict[str, dict] = {}
        self._slots: dict[str, Slots] | None = None
        if slots is not None:
            self._slots = {p: tuple(tuple(int(s) for s in slot) for slot in v) for p, v in slots.items()}
            arrays = {}
            for p, v in self._slots.items():
                sizes = np.fromiter((len(slot) for slot in v), dtype=np.int64, count=len(v))
                order = np.fromiter((s for slot in v for s in slot), dtype=np.int64, count=int(sizes.sum()))
                arrays[p] = (order, np.concatenate(([0], np.cumsum(sizes))).astype(np.int64))
        # read-only views in a read-only mapping: the cached ``slots``, ``slot_index`` and ``key``
        # are derived from them once and cannot go stale
        views: dict[int, np.ndarray] = {}  # phases sharing an array share its view (checked once)
        ro = lambda a: views[id(a)] if id(a) in views else views.setdefault(id(a), _read_only(a))  # noqa: E731
        self._arrays: Mapping[str, tuple[np.ndarray, np.ndarray]] = MappingProxyType(
            {p: (ro(o), ro(b)) for p, (o, b) in arrays.items()})
        self._key: tuple[int, bytes] | None = None
        # per phase, each slot's cost as the policy that built the layout already knows it:
        # ``(costs, llm_padded, {phase: per-slot costs})``, read by `loom.balance.predict.slot_costs`
        # for that same costs object only
        self.known_slot_costs: tuple[object, bool, dict[str, np.ndarray]] | None = None

    @staticmethod
    def from_slot_index(slot_of: "dict[str, np.ndarray]", num_slots: int, policy: dict[str, str] | None = None,
                        **kwargs) -> "BatchLayout":
        """Per phase ``slot_of[phase][s]``: the slot of sample ``s``; samples keep ascending
        position order inside a slot."""
        arrays = {}
        for p, idx in slot_of.items():
            idx = np.asarray(idx, dtype=np.int64)
            order = np.argsort(idx, kind="stable")
            counts = np.bincount(idx, minlength=num_slots) if idx.size else np.zeros(num_slots, dtype=np.int64)
            arrays[p] = (order, np.concatenate(([0], np.cumsum(counts))))
        return BatchLayout(None, policy, arrays=arrays, **kwargs)

    @property
    def arrays(self) -> Mapping[str, tuple[np.ndarray, np.ndarray]]:
        """Per phase ``(order, bounds)``: read-only int64 arrays in a read-only mapping."""
        return self._arrays

    def key(self) -> tuple[int, bytes]:
        """A hashable key of the slots (which samples each slot of each phase holds, in order):
        equal for layouts with equal slots, whatever their policy. A 16-byte digest of the
        arrays' bytes, computed once (~1 ms per million samples): what a schedule cache keys on
        instead of tuples per sample."""
        if self._key is None:
            h = hashlib.blake2b(digest_size=16)
            for p in sorted(self._arrays):
                order, bounds = self._arrays[p]
                h.update(p.encode())
                h.update(np.int64(bounds.size).tobytes())
                h.update(bounds.tobytes())
                h.update(order.tobytes())
            self._key = (self.num_microbatches, h.digest())
        return self._key

    def set_slot_index(self, phase: str, index: np.ndarray) -> None:
        """Record ``index``, the slot of every sample in ``phase``, when the builder of the layout
        made the arrays from it (`loom.balance.orchmllm.slot_arrays`), so `slot_index` need not
        scatter it again. The builder vouches that it agrees with the arrays and that ``order``
        is a stable argsort of ``index`` (so a permutation of ``range(len(index))``): `check`
        then skips its range and duplicate passes for this phase."""
        order, bounds = self._arrays[phase]
        if np.shape(index) != order.shape:
            raise LayoutError(f"phase {phase!r}: a slot index of shape {np.shape(index)} for {order.size} samples")
        self.__dict__.setdefault("_slot_index", {})[phase] = (order, bounds, _read_only(index))
        self.__dict__.setdefault("_permutation", set()).add(phase)

    @property
    def slots(self) -> dict[str, Slots]:
        if self._slots is None:
            out = {}
            for p, (order, bounds) in self.arrays.items():
                flat = order.tolist()
                b = bounds.tolist()
                out[p] = tuple(tuple(flat[b[j]:b[j + 1]]) for j in range(len(b) - 1))
            self._slots = out
        return self._slots

    def slot(self, phase: str, j: int) -> tuple[int, ...]:
        """Positions of slot ``j`` of ``phase`` (without materialising every slot)."""
        order, bounds = self.arrays[phase]
        return tuple(order[bounds[j]:bounds[j + 1]].tolist())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BatchLayout):
            return NotImplemented
        return (self.policy == other.policy and self.arrays.keys() == other.arrays.keys()
                and all(np.array_equal(self.arrays[p][0], other.arrays[p][0])
                        and np.array_equal(self.arrays[p][1], other.arrays[p][1]) for p in self.arrays))

    def __repr__(self) -> str:
        return (f"BatchLayout({self.num_microbatches} slots over {sorted(self.arrays)}, policy={self.policy}, "
                f"kept_given={self.kept_given})")

    @property
    def num_microbatches(self) -> int:
        return len(self.arrays[LLM][1]) - 1

    @property
    def encoders(self) -> list[str]:
        return [p for p in self.arrays if p != LLM]

    def slot_index(self, phase: str) -> np.ndarray:
        """``index[s]``: the slot of ``phase`` holding sample ``s`` (an array over positions)."""
        order, bounds = self.arrays[phase]
        # the check, the never-slower prediction and the dispatcher all read it: computed once per
        # (order, bounds) pair (a phase given new arrays is recomputed), read-only as it is shared
        held = self.__dict__.setdefault("_slot_index", {}).get(phase)
        if held is not None and held[0] is order and held[1] is bounds:
            return held[2]
        index = np.empty(order.size, dtype=np.int64)
        index[order] = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
        index.flags.writeable = False
        self._slot_index[phase] = (order, bounds, index)
        return index

    def slot_of(self, phase: str) -> dict[int, int]:
        """position -> slot of ``phase``."""
        return dict(zip(self.arrays[phase][0].tolist(), self.slot_index(phase)[self.arrays[phase][0]].tolist()))

    def is_identity(self) -> bool:
        """Every encoder slot holds exactly its LLM slot's samples (then the routes are the
        plain ``j -> j`` edges)."""
        return all(self.shares_llm_slots(e) for e in self.encoders)

    def shares_llm_slots(self, encoder: str) -> bool:
        """Every slot of ``encoder`` holds exactly the LLM slot's samples, in order (computed once)."""
        held = self.__dict__.setdefault("_shares", {})
        if encoder not in held:
            o, b = self._arrays[LLM]
            eo, eb = self._arrays[encoder]
            held[encoder] = (eb is b or np.array_equal(eb, b)) and (eo is o or np.array_equal(eo, o))
        return held[encoder]

    # ---- routes between an encoder and the LLM -------------------------------------------
    def consumers(self, encoder: str, j: int) -> list[tuple[int, tuple[int, ...]]]:
        """LLM slots fed by encoder slot ``j``, ascending: ``(k, positions)`` with the positions
        in LLM slot ``k``'s order (the order the rows are sent in)."""
        return self.routes_out(encoder, LLM, j)

    def sources(self, encoder: str, k: int) -> list[tuple[int, tuple[int, ...]]]:
        """Encoder slots feeding LLM slot ``k``, ascending: ``(j, positions)``, the positions in
        LLM slot ``k``'s order (what `consumers` sends)."""
        return self.routes_in(encoder, LLM, k)

    def routes_out(self, src: str, dst: str, j: int) -> list[tuple[int, tuple[int, ...]]]:
        """Slots of phase ``dst`` fed by slot ``j`` of phase ``src``, ascending: ``(k, positions)``
        with the positions in ``dst`` slot ``k``'s order (an encoder into the LLM, the LLM into a
        generator)."""
        mine = set(self.slots[src][j])
        out = []
        for k, slot in enumerate(self.slots[dst]):
            part = tuple(s for s in slot if s in mine)
            if part:
                out.append((k, part))
        return out

    def routes_in(self, src: str, dst: str, k: int) -> list[tuple[int, tuple[int, ...]]]:
        """Slots of phase ``src`` feeding slot ``k`` of phase ``dst``, ascending: ``(j,
        positions)``, the positions in ``dst`` slot ``k``'s order (what `routes_out` sends)."""
        slot_of = self.slot_of(src)
        by_source: dict[int, list[int]] = {}
        for s in self.slots[dst][k]:
            by_source.setdefault(slot_of[s], []).append(s)
        return [(j, tuple(by_source[j])) for j in sorted(by_source)]

    # ---- checks --------------------------------------------------------------------------
    def check(self, batch_size: int, phases: list[str] | None = None) -> "BatchLayout":
        """Every phase's slots partition ``range(batch_size)`` into the same number of
        non-empty slots; raises `LayoutError` naming the phase, slot and sample otherwise.
        Vectorised: a few array passes per phase."""
        if LLM not in self.arrays:
            raise LayoutError(f"layout has no {LLM!r} phase; it has {sorted(self.arrays)}")
        if phases is not None and sorted(phases) != sorted(self.arrays):
            raise LayoutError(f"layout phases {sorted(self.arrays)} differ from the plan's modules {sorted(phases)}")
        m = self.num_microbatches
        checked: list[tuple[np.ndarray, np.ndarray]] = []
        for phase, (order, bounds) in self.arrays.items():
            if any(order is o and bounds is b for o, b in checked):
                continue  # phases sharing one (order, bounds) pair (DistTrain, Entrain): checked once
            checked.append((order, bounds))
            if len(bounds) - 1 != m:
                raise LayoutError(f"phase {phase!r} has {len(bounds) - 1} slots, the LLM {m}: every phase needs the same count")
            sizes = np.diff(bounds)
            if sizes.size and sizes.min() <= 0:
                raise LayoutError(f"phase {phase!r} slot {int(np.argmin(sizes))} is empty: every microbatch needs a sample")
            if order.size == batch_size and bounds[-1] == order.size and self._is_permutation(phase, order, bounds):
                continue  # an argsort of its slot index (`set_slot_index`): in range, no duplicates
            # two reductions first; the offending positions only on failure
            out_of_range = order.size and (order.min() < 0 or order.max() >= batch_size)
            bad = np.flatnonzero((order < 0) | (order >= batch_size)) if out_of_range else order[:0]
            if bad.size:
                j = int(np.searchsorted(bounds, bad[0], side="right") - 1)
                raise LayoutError(f"phase {phase!r} slot {j} names sample {int(order[bad[0]])}, outside 0..{batch_size - 1}")
            counts = np.bincount(order, minlength=batch_size)
            if counts.max(initial=0) > 1:
                s = int(np.argmax(counts > 1))
                where = np.searchsorted(bounds, np.flatnonzero(order == s), side="right") - 1
                raise LayoutError(f"phase {phase!r}: sample {s} is in slots {int(where[0])} and {int(where[1])} (duplicated)")
            if order.size != batch_size:
                missing = np.flatnonzero(counts == 0)
                raise LayoutError(f"phase {phase!r} drops samples {missing[:10].tolist()} (of {batch_size})")
        return self

    def _is_permutation(self, phase: str, order: np.ndarray, bounds: np.ndarray) -> bool:
        """Whether the builder vouched (`set_slot_index`) that ``order`` is an argsort."""
        held = self.__dict__.get("_slot_index", {}).get(phase)
        return (phase in self.__dict__.get("_permutation", ()) and held is not None
                and held[0] is order and held[1] is bounds)

    def check_routes(self, plan: Plan) -> None:
        """Every encoder-to-LLM route stays within a round or goes one round forward, every
        LLM-to-generator route within its round.

        A *round* is ``R = lcm(data-parallel degrees)`` consecutive slots: the same number of
        microbatches of every replica of every module. Routes inside a round keep each
        replica's t-th microbatch depending only on the others' t-th ones, so the 1F1B order
        cannot deadlock; one round forward is Entrain's one-hop deferral (entrain.md §3.5.2),
        which the encoder's 1F1B lookahead (>= one own microbatch) covers. The validator's
        deadlock play remains the proof; this check gives the clear message.

        An identity layout (every encoder slot equal to its LLM slot) needs no rounds: its
        routes are the plan's own ``j -> j`` edges, which any microbatch count runs."""
        if self.is_identity():
            return
        r = round_size(plan)
        if self.num_microbatches % r:
            raise LayoutError(
                f"layout has {self.num_microbatches} microbatches, not a multiple of the round size {r} "
                f"(the lcm of the modules' data_parallel degrees)"
            )
        if self.num_microbatches == r:
            return  # one round: every route stays in it
        llm_slot = self.slot_index(LLM)
        generators = set(plan.generator_names)
        for e in self.encoders:
            enc_slot = self.slot_index(e)
            if e in generators:  # the LLM feeds a generator inside the round (no deferral)
                bad = np.flatnonzero(enc_slot // r != llm_slot // r)
                if bad.size:
                    s = int(bad[0])
                    raise LayoutError(f"sample {s}: LLM slot {int(llm_slot[s])} feeds {e} slot {int(enc_slot[s])} in "
                                      f"another round of {r} slots; a generator's routes must stay in the round")
                continue
            hop = llm_slot // r - enc_slot // r
            bad = np.flatnonzero((hop != 0) & (hop != 1))
            if bad.size:
                s = int(bad[0])
                raise LayoutError(
                    f"sample {s}: {e} slot {int(enc_slot[s])} feeds LLM slot {int(llm_slot[s])}, {int(hop[s])} rounds "
                    f"of {r} slots away; routes must stay in the round or defer by one"
                )


def _read_only(values) -> np.ndarray:
    """An int64 read-only view of ``values`` (a copy only when the dtype differs)."""
    arr = np.asarray(values, dtype=np.int64).view()
    arr.flags.writeable = False
    return arr


def max_over_mean(values: list[float] | tuple[float, ...]) -> float:
    """``max / mean`` of loads; 1.0 (nothing to balance) for an empty or all-zero list. The
    balance figure of the run directory, ``loom simulate --policy`` and the benchmarks."""
    if not values:
        return 1.0
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def round_size(plan: Plan) -> int:
    return math.lcm(*(m.data_parallel for m in plan.modules))


def identity_layout(slots: list[list[int]] | Slots, phases: list[str], policy: str = "none") -> BatchLayout:
    """Every phase holds the same slots (the unbalanced layout, and DistTrain's)."""
    fixed = tuple(tuple(s) for s in slots)
    return BatchLayout({p: fixed for p in phases}, {p: policy for p in phases})


def contiguous_layout(batch_size: int, num_slots: int, phases: list[str], policy: str = "none",
                      sizes: np.ndarray | None = None) -> BatchLayout:
    """`identity_layout` of equal-count contiguous slots (``split_microbatches``'s split, sizes
    differing by at most one, larger first), built as arrays; ``sizes`` gives the slots' sample
    counts instead (`token_budget_sizes`)."""
    if sizes is None:
        base, extra = divmod(batch_size, num_slots)
        sizes = np.full(num_slots, base, dtype=np.int64)
        sizes[:extra] += 1
    # one pair of arrays shared by every phase: checked once, identity at a glance
    pair = (np.arange(batch_size, dtype=np.int64), np.concatenate(([0], np.cumsum(sizes))))
    layout = BatchLayout(None, {p: policy for p in phases}, arrays={p: pair for p in phases})
    layout.contiguous = True
    return layout


def token_budget_sizes(lengths: np.ndarray, budget: int, min_slots: int, multiple: int) -> np.ndarray:
    """Sample counts of contiguous microbatches holding at most ``budget`` LLM tokens each
    (``data.microbatch_tokens``: samples packed up to a token budget, as DistTrain and OrchMLLM
    cut their batches). A sample longer than the budget is a microbatch of its own, the one
    case a microbatch exceeds it. Samples are packed in order, greedily; then, for at least
    ``min_slots`` microbatches in a multiple of ``multiple`` (the plan's microbatch count and
    its round of data-parallel replicas), the fullest microbatch of two or more samples is
    halved by tokens until there are enough: cutting never overfills one. Raises ValueError
    when the batch has too few samples for that many microbatches."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    cuts, total = [0], 0
    for i, length in enumerate(lengths):
        if total and total + length > budget:
            cuts.append(i)
            total = 0
        total += length
    cuts.append(n)
    parts = [(cuts[k], cuts[k + 1]) for k in range(len(cuts) - 1)]
    want = max(min_slots, len(parts))
    want = -(-want // multiple) * multiple
    if want > n:
        raise ValueError(f"data.microbatch_tokens = {budget}: the batch's {n} samples make {len(parts)} microbatches, "
                         f"rounded up to {want} (at least plan.num_microbatches = {min_slots}, a multiple of {multiple} "
                         f"data-parallel replicas), more than its samples; raise data.microbatch_tokens or the batch")
    prefix = np.concatenate(([0], np.cumsum(lengths)))
    while len(parts) < want:
        k = max((k for k, (lo, hi) in enumerate(parts) if hi - lo > 1), key=lambda k: prefix[parts[k][1]] - prefix[parts[k][0]])
        lo, hi = parts[k]
        half = (prefix[lo] + prefix[hi]) / 2
        mid = int(np.clip(np.searchsorted(prefix, half), lo + 1, hi - 1))
        parts[k:k + 1] = [(lo, mid), (mid, hi)]
    return np.array([hi - lo for lo, hi in parts], dtype=np.int64)
