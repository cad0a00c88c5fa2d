"""The simulator's inputs: every microbatch's workload by index (`work_table`) and the
workload of a sample subset (`PartWork`: a routed message, one part of a split backward)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from loom.cost.model import MicrobatchWork, Workload

EMPTY = Workload()  # a module a microbatch does not touch (no audio in it) costs its empty workload


class PartWork:
    """The workload of a subset of samples of one module (a routed message, a backward part):
    the sum of the samples' workloads in ``sample_work``, memoised per ``(module, samples)``."""

    def __init__(self, sample_work: Sequence[MicrobatchWork] | Mapping[int, MicrobatchWork] | None, any_work: bool):
        self.table = sample_work
        self.any_work = any_work
        self.cache: dict[tuple[str, tuple[int, ...]], Workload] = {}

    def __call__(self, module: str, samples: tuple[int, ...]) -> Workload:
        key = (module, samples)
        w = self.cache.get(key)
        if w is not None:
            return w
        if self.table is None:
            if self.any_work:
                raise ValueError(
                    f"the schedule names sample subsets (routed edges or a split backward, e.g. {module} samples "
                    f"{list(samples)[:8]}) but no sample_work was given: pass the per-sample workloads "
                    f"(sample_work[position]) so a part costs its own samples"
                )
            w = EMPTY
        else:
            w = EMPTY
            for s in samples:
                try:
                    row = self.table[s]
                except (IndexError, KeyError):
                    raise KeyError(f"sample_work has no entry for sample {s} (named by a {module} part)") from None
                w = w + row.get(module, EMPTY)
        self.cache[key] = w
        return w


def work_table(work: Sequence[MicrobatchWork] | Mapping[int, MicrobatchWork] | None, count: int) -> list[MicrobatchWork]:
    """Every microbatch's workload by index; ``None`` gives every microbatch an empty one (for
    cost models that ignore the workload, such as `UniformCostModel`)."""
    if work is None:
        return [{} for _ in range(count)]
    if isinstance(work, Mapping):
        missing = [j for j in range(count) if j not in work]
        if missing:
            raise KeyError(f"work has no entry for microbatches {missing}; the schedule has {count}")
        return [work[j] for j in range(count)]
    if len(work) < count:
        raise ValueError(f"work lists {len(work)} microbatches; the schedule has {count}")
    return list(work[:count])
