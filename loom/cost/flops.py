"""FLOPs and memory traffic of each layer as a function of its workload, per backward part,
and the model FLOPs of a microbatch (the MFU numerator) (issue 3, item 1).

For a layer ``l`` given a `Workload` with ``T`` tokens and ``S2 = attn_sq`` (the sum of the
squared segment lengths), with ``W_l`` its GEMM weights per input token
(`LayerArch.gemm_weights_per_token`) and ``q = heads * head_dim``:

- GEMMs, every layer kind with weights: forward ``2 T W_l``; backward-input ``2 T W_l`` (the
  gradient through each matrix); backward-weight ``2 T W_l`` (each weight gradient). A conv
  front-end's backward-weight adds the input gradient of its second convolution
  (``2 T kernel hidden^2``), needed for the first one's weights; a front-end has no
  backward-input (its input is data).
- Attention of a block: scores ``Q K^T`` and ``P V`` are ``2 S2 q`` FLOPs each, so forward
  ``4 c S2 q`` with ``c = 1/2`` for causal attention (only the unmasked half is computed, as
  FlashAttention does) and 1 otherwise; backward-input ``8 c S2 q`` (twice forward: dQ, dK from
  dS and dP, dV); no weights, so no backward-weight.
- Generator layers (`loom.cost.arch`) run on their own grid, ``scale`` times coarser per side
  than the module's base: ``T / scale^2`` positions and ``S2 / scale^4``; a cross-attention adds
  ``4 (T / scale^2) cond q`` (each position against its item's ``cond`` conditioning tokens), and
  per-item GEMMs (the projector and the cross keys and values over the conditioning tokens, the
  timestep MLP and projections) add ``2 segments W_item``. A U-Net's GroupNorms, SiLUs,
  up/downsampling copies and skip concatenations are elementwise and left to the efficiency
  factor, as a transformer's are.
- Embedding lookups and norms are memory-bound: they cost bytes of HBM traffic
  (`memory_traffic`), no FLOPs.
- Elementwise work inside a block (norms, activations, residuals, softmax) is left to the GEMM
  efficiency factor of the cost model.

Model FLOPs of a microbatch (`model_flops`) sum, over its modules' layers, forward plus the
backward parts the layer runs under the frozen-aware rule (`loom.cost.frozen`), without
recomputation (MFU counts model FLOPs, not hardware FLOPs). For a fully trainable dense
decoder of ``L`` blocks with ``P`` GEMM weights per block and a ``hidden x vocab`` head this is
the familiar ``6 T (L P + hidden vocab) + 12 c S2 L q``.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.cost.arch import LayerArch, ModelArch
from loom.cost.frozen import BackwardNeeds, backward_needs
from loom.cost.model import MicrobatchWork, Workload


@dataclass(frozen=True)
class PhaseAmounts:
    """One quantity (FLOPs, bytes, seconds) per part of a layer's work."""

    forward: float = 0.0
    backward_input: float = 0.0
    backward_weight: float = 0.0

    def __add__(self, other: PhaseAmounts) -> PhaseAmounts:
        return PhaseAmounts(self.forward + other.forward, self.backward_input + other.backward_input,
                            self.backward_weight + other.backward_weight)

    def trained(self, needs: BackwardNeeds) -> float:
        """Forward plus the backward parts that ``needs`` says run."""
        return self.forward + (self.backward_input if needs.input else 0.0) + (
            self.backward_weight if needs.weight else 0.0)


def gemm_flops(layer: LayerArch, work: Workload) -> PhaseAmounts:
    """FLOPs of the layer's matrix multiplies (linear in tokens; a generator layer's per-item
    GEMMs, `LayerArch.gemm_weights_per_item`, linear in items)."""
    f = 2.0 * work.tokens * layer.gemm_weights_per_token
    if layer.gemm_weights_per_item:
        f += 2.0 * work.segments * layer.gemm_weights_per_item
    if f == 0:
        return PhaseAmounts()
    if layer.kind == "frontend":
        extra = 2.0 * work.tokens * layer.kernel * layer.hidden**2 if layer.frontend == "conv1d" else 0.0
        return PhaseAmounts(f, 0.0, f + extra)
    return PhaseAmounts(f, f, f)


def attention_flops(layer: LayerArch, work: Workload) -> PhaseAmounts:
    """FLOPs of a block's attention scores and weighted sum (quadratic in segment length)."""
    if layer.kind != "block":
        return PhaseAmounts()
    c = 0.5 if layer.causal else 1.0
    f = 4.0 * c * work.attn_sq / layer.scale**4 * layer.q_dim  # a generator layer's own grid (module docstring)
    if layer.cross:  # each position attends to its item's cond tokens
        f += 4.0 * work.tokens / layer.scale**2 * layer.cond * layer.q_dim
    return PhaseAmounts(f, 2 * f, 0.0)


def layer_flops(layer: LayerArch, work: Workload) -> PhaseAmounts:
    return gemm_flops(layer, work) + attention_flops(layer, work)


def memory_traffic(layer: LayerArch, work: Workload, dtype_bytes: int) -> PhaseAmounts:
    """HBM bytes of the memory-bound layers (embedding gathers, norms); 0 for the others.

    Embedding: forward reads and writes ``T`` rows (``2 T h``); backward-weight scatter-adds
    them into the gradient (read the incoming gradient, read-modify-write the rows: ``3 T h``);
    backward-input, the LLM's gradient for merged encoder tokens, gathers ``T`` rows (``2 T h``).
    Norm: forward reads ``x``, writes ``y`` (``2 T h``); backward-input reads ``x`` and ``dy``
    and writes ``dx`` (``3 T h``); backward-weight reads ``x`` and ``dy`` (``2 T h``).
    """
    row = float(work.tokens) * layer.hidden * dtype_bytes
    if layer.kind == "embedding":
        return PhaseAmounts(2 * row, 2 * row, 3 * row)
    if layer.kind == "norm":
        return PhaseAmounts(2 * row, 3 * row, 2 * row)
    return PhaseAmounts()


def model_flops(arch: ModelArch, work: MicrobatchWork, needs: dict[str, list[BackwardNeeds]] | None = None) -> float:
    """Model FLOPs of a microbatch (or of one sample: its own per-module token counts), as the
    module docstring defines them."""
    needs = backward_needs(arch) if needs is None else needs
    total = 0.0
    for name, w in work.items():
        module = arch.module(name)
        for layer, need in zip(module.layers, needs[name]):
            total += layer_flops(layer, w).trained(need)
    return total
