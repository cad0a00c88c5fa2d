"""How fast a GEMM runs by its shape on a GPU (issue 12, item 1): the achieved throughput the
analytic cost model prices a layer's matrix multiplies with, instead of one constant fraction
of the peak.

A GEMM ``C[m, n] = A[m, k] B[k, n]`` takes the longer of

- compute: ``2 m n k / (peak x ceiling x quantization)``. ``ceiling`` is the fraction of the
  dense peak the largest GEMMs reach on the GPU (`GPUSpec.gemm_ceiling`); ``quantization`` is
  the share of the launched work that is useful, from the two effects NVIDIA's *Matrix
  Multiplication Background User's Guide* ("Tile Quantization", "Wave Quantization") describes:
  the output is cut into ``TILE x TILE`` tiles (a partial tile costs a whole one), and the
  tiles run in waves of one per SM (a partial last wave costs a whole one). A grid smaller than
  the GPU is split along ``k`` (split-K) into as many slices as fill the SMs, each slice at
  least ``SPLIT_K_MIN`` deep;
- memory: ``dtype_bytes x (m k + k n + m n) / HBM bandwidth``, every operand read or written
  once (the roofline's memory side: small and skinny GEMMs, a few tokens against a wide weight,
  are bound here).

So a large square GEMM runs at the ceiling, a 4096-token projection at TP 8 loses a partial
wave, and a microbatch of a few dozen tokens is memory-bound. The constants ``TILE`` and
``SPLIT_K_MIN`` are assumptions (cuBLAS picks among many tile shapes per problem; 128 x 128 is
its common BF16 tile on Ampere and Hopper); a scenario may instead fix one efficiency for every
GEMM (``[cost] efficiency``, `loom.sim.scenario`).

A layer's GEMMs (`layer_gemms`) are the ones Megatron-LM runs: a block's fused QKV projection,
its output projection, the MLP's (fused gate and) up projection and its down projection, each
cut by TP along its parallel dimension; the head ``hidden -> vocab / t``; any other layer one
GEMM from its width to its weights per token. Each phase has its own shape: forward
``(m, n, k)``, backward-input ``dX = dY W^T`` ``(m, k, n)`` and backward-weight ``dW = X^T dY``
``(k, n, m)``.
"""

from __future__ import annotations

import math

from loom.cost.arch import LayerArch
from loom.cost.hardware import GPUSpec

TILE = 128  # output tile side (assumption, module docstring)
SPLIT_K_MIN = 512  # the least depth of a split-K slice (assumption)


def quantization(m: int, n: int, k: int, sms: int) -> float:
    """The useful share of the tiles launched for an ``m x n x k`` GEMM on ``sms`` SMs (1 when
    the SM count is unknown, ``sms = 0``)."""
    if sms <= 0:
        return 1.0
    tm, tn = -(-m // TILE), -(-n // TILE)
    tile_fill = m * n / (tm * tn * TILE * TILE)
    tiles = tm * tn
    splits = max(1, min(sms // tiles, k // SPLIT_K_MIN)) if tiles < sms else 1
    units = tiles * splits
    return tile_fill * units / (math.ceil(units / sms) * sms)


def gemm_seconds(m: float, n: float, k: float, spec: GPUSpec, dtype_bytes: int, flops: float | None = None) -> float:
    """Seconds of one ``m x n x k`` GEMM (module docstring; a token count may be fractional, a
    mean); ``flops`` overrides ``2 m n k`` (a layer's share of its phase's FLOPs,
    `loom.cost.flops`, which counts per-item GEMMs too)."""
    if min(m, n, k) <= 0:
        return 0.0
    f = 2.0 * m * n * k if flops is None else flops
    q = quantization(max(1, round(m)), max(1, round(n)), max(1, round(k)), spec.sms)
    compute = f / (spec.peak_bf16_flops * spec.gemm_ceiling * q)
    memory = dtype_bytes * (m * k + k * n + m * n) / spec.hbm_bandwidth
    return max(compute, memory)


def layer_gemms(layer: LayerArch, tp: int) -> tuple[tuple[int, int], ...]:
    """``(k, n)`` of each GEMM a token of the layer passes through on one of ``tp`` ranks
    (module docstring); empty for layers without GEMMs (embedding, norm)."""
    h = layer.hidden
    if layer.kind == "block" and not layer.cross and not layer.proj_io and layer.scale == 1:
        up = (2 if layer.gated_mlp else 1) * layer.ffn
        return ((h, -(-(layer.q_dim + 2 * layer.kv_dim) // tp)), (-(-layer.q_dim // tp), h),
                (h, -(-up // tp)), (-(-layer.ffn // tp), h))
    if layer.kind == "head":
        return ((h, -(-layer.vocab // tp)),)
    weights = layer.gemm_weights_per_token * layer.scale**2 / tp
    if weights <= 0:
        return ()
    return ((h, max(1, round(weights / h))),)


def layer_gemm_seconds(layer: LayerArch, tokens: float, tp: int, phase: str, flops: float, spec: GPUSpec,
                       dtype_bytes: int) -> float:
    """Seconds of the layer's GEMMs in one phase on one rank: ``flops`` (the phase's GEMM FLOPs
    per rank) shared among `layer_gemms` by their weights, each priced at its own shape with
    ``tokens`` rows (the rank's tokens on the layer's own grid)."""
    gemms = layer_gemms(layer, tp)
    if not gemms or flops <= 0:
        return 0.0
    total = sum(k * n for k, n in gemms)
    t = 0.0
    for k, n in gemms:
        share = flops * k * n / total
        if phase == "forward":
            t += gemm_seconds(tokens, n, k, spec, dtype_bytes, share)
        elif phase == "backward_input":
            t += gemm_seconds(tokens, k, n, spec, dtype_bytes, share)
        else:  # backward_weight: dW[k, n] = X^T dY, a reduction over the tokens
            t += gemm_seconds(k, n, tokens, spec, dtype_bytes, share)
    return t
