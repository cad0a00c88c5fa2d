"""The metadata-to-workload rule: what each module computes for a set of samples, from their
metadata alone (DESIGN.md principle 4). Token counts per encoder item come from the module's
architecture; the LLM's sequence is the text plus every encoder's merged tokens.

The simulator, the balancing policies and the partitioner all cost samples through this rule,
so a layout decided on metadata is priced exactly as the simulator plays it.
"""

from __future__ import annotations

from loom.cost.arch import ModelArch
from loom.cost.model import MicrobatchWork, Workload
from loom.data.sample import SampleMeta
from loom.plan.plan import LLM

# which metadata field holds an encoder's items, by the encoder architecture's kind
ITEM_FIELDS = {"vision": "images", "audio": "audios"}


class WorkloadError(ValueError):
    """Metadata the model cannot cost (a modality without an encoder, an unknown batching)."""


def sample_work(arch: ModelArch, metas: list[SampleMeta], llm_batching: str = "packed") -> MicrobatchWork:
    """Per-module `Workload` of a microbatch of samples, from metadata only."""
    work: MicrobatchWork = {}
    kinds = {arch.module(n).kind for n in arch.encoder_names}
    for kind, field_name in ITEM_FIELDS.items():
        if kind not in kinds and any(getattr(m, field_name) for m in metas):
            raise WorkloadError(
                f"the data has {field_name} but the model has no {kind} encoder: add one under "
                f"[model] encoders, or choose a data.mix without {field_name}"
            )
    llm_lengths = [m.text_tokens - len(m.images) - len(m.audios) for m in metas]
    for name in arch.encoder_names:
        module = arch.module(name)
        field_name = ITEM_FIELDS.get(module.kind)
        if field_name is None:
            raise WorkloadError(f"encoder {name!r} has kind {module.kind!r}; simulation knows {sorted(ITEM_FIELDS)}")
        lengths = []
        for b, meta in enumerate(metas):
            for item in getattr(meta, field_name):
                lengths.append(module.num_tokens(item))
                llm_lengths[b] += module.llm_tokens(item)
        work[name] = Workload.of_lengths(lengths)
    if llm_batching not in ("packed", "padded"):
        raise WorkloadError(f"data.llm_batching = {llm_batching!r}: choose 'packed' or 'padded'")
    work[LLM] = Workload.of_lengths(llm_lengths) if llm_batching == "packed" else Workload.padded(llm_lengths)
    return work
