"""Which layers run which part of the backward pass: Cornstarch's frozen-aware rule
(cornstarch.md §3.2.2, eqs. 3.1-3.3 and the pseudocode ``layer_costs``).

Backward splits into a weight-gradient part ``B_w`` and an input-gradient part ``B_d``
(eq. 3.1). A layer runs ``B_w`` iff it is trainable, and ``B_d`` iff ``p(L_l)`` holds (eq. 3.2),
where ``p`` propagates forward: ``p(L_l) = p(L_{l-1}) or trainable(L_l)`` (eq. 3.3). Each
encoder chain (its layers, then its projector) starts with ``p = False``; the LLM starts with
the OR of every encoder chain's final ``p`` ("if some parameters in the modality encoders are
trainable, all layers after it ... as well as the LLM need to backpropagate gradients"). A
generator after the LLM (disttrain.md §1) starts with the LLM's final ``p``: its output
projector passes the gradient back into the LLM when anything up to it trains.

One refinement, because it is what autograd does and what a profiler would measure: a layer
that reads raw data (a front-end reading pixels or mel frames, the LLM's token embedding)
has no input tensor to differentiate except what arrives from *upstream*, so its ``B_d`` is
taken only when something strictly before it is trainable (for the LLM's embedding: when an
encoder chain is, the gradient then flowing back through the merge of encoder tokens; for a
generator's projector, which reads the LLM's states: when anything up to the LLM is).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loom.cost.arch import LLM, ModelArch

# Layers whose input is data, not an activation that may require grad.
INPUT_KINDS = ("frontend", "embedding")


@dataclass(frozen=True)
class BackwardNeeds:
    """What the backward pass computes for one layer."""

    weight: bool  # B_w: the layer's own parameter gradients
    input: bool  # B_d: the gradient of its input, for trainable layers upstream

    @property
    def any(self) -> bool:
        return self.weight or self.input


def needs_from_flags(
    trainable: Mapping[str, Sequence[bool]], reads_data: Mapping[str, Sequence[bool]] | None = None
) -> dict[str, list[BackwardNeeds]]:
    """The rule on plain flags: per module (encoders in graph order, then ``"llm"``), per layer,
    whether it is trainable and (optionally) whether it reads raw data (the refinement above;
    without it, a trainable layer counts its own ``B_d`` exactly as eq. 3.3 states)."""
    needs: dict[str, list[BackwardNeeds]] = {}
    encoders_propagate = False
    llm_propagates: bool | None = None  # the LLM's final p, once its chain is done (generators follow it)
    for name, flags in trainable.items():
        raw = reads_data.get(name) if reads_data is not None else None
        if name == LLM:
            seen = encoders_propagate  # p(L_{l-1}) entering the chain
        else:
            seen = bool(llm_propagates)  # an encoder starts afresh, a generator after the LLM
        out = []
        for i, t in enumerate(flags):
            p = seen or bool(t)  # eq. 3.3
            needs_input = seen if (raw is not None and raw[i]) else p
            out.append(BackwardNeeds(weight=bool(t), input=needs_input))  # eq. 3.2
            seen = p
        needs[name] = out
        if name == LLM:
            llm_propagates = seen
        elif llm_propagates is None:
            encoders_propagate = encoders_propagate or seen
    return needs


def backward_needs(arch: ModelArch) -> dict[str, list[BackwardNeeds]]:
    """Per module, per layer (in `ModelArch` order), the parts of backward it runs."""
    generators = set(arch.generator_names)
    return needs_from_flags(
        {name: [layer.trainable for layer in m.layers] for name, m in arch.modules.items()},
        # a generator's projector reads the LLM's states: as data, they need a gradient only when
        # something before them trains
        {name: [layer.kind in INPUT_KINDS or (name in generators and i == 0) for i, layer in enumerate(m.layers)]
         for name, m in arch.modules.items()},
    )
