"""Timing the optimizer step: AdamW as a function of parameter and tensor counts.

On a CPU each timed step starts with the caches holding none of its tensors (`evict_caches`),
as in a run: a rank's optimizer step comes after its whole forward and backward work (and, on a
shared host, the other ranks'), which leave its parameters, gradients and moments out of cache,
while a benchmark cycling over a few parameter lists finds them warm. Measured on the demo's LLM
stage 0 (577 k parameters, one thread): 2.57 ms warm, 2.86 ms right after that stage's forwards
and backwards of a real step, 3.02 ms after an eviction.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from loom.cost.profile_fit import nnls
from loom.model.multimodal import MultimodalModel
from loom.profile.layers import timed


def last_level_cache_bytes(default: int = 32 * 2**20) -> int:
    """The CPU's largest cache in bytes (Linux sysfs), or ``default`` where it cannot be read."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or default


def eviction_buffer(device: torch.device) -> torch.Tensor | None:
    """What `evict_caches` writes on ``device``: twice the last-level cache on a CPU; None on a
    GPU, whose kernels do not start from the host's caches."""
    return torch.zeros(2 * last_level_cache_bytes() // 4) if device.type == "cpu" else None


def evict_caches(buffer: torch.Tensor | None) -> None:
    """Write ``buffer`` (twice the last-level cache, on the CPU), so what ran before is out of
    cache; None (a GPU) does nothing."""
    if buffer is not None:
        buffer.add_(1.0)


OPTIMIZER_SHAPES = ((1, 1_000), (1, 200_000), (1, 1_000_000), (16, 16_000), (16, 400_000), (64, 64_000),
                    (64, 640_000))  # (tensors, parameters)


class OptimizerBench:
    """``AdamW.step`` + ``zero_grad`` (what the executor's optimizer_step runs) over parameter
    lists of several sizes and tensor counts, one timed step per list and pass: synthetic lists
    and, given ``shape_groups``, copies of a model's own parameters (whole modules, halves and
    single layers, whose mix of large matrices and small norms and biases a stage holds)."""

    def __init__(self, device: torch.device, shape_groups: Sequence[Sequence[Sequence[int]]] = ()):
        self.device = device
        groups = [[(total // count,)] * count for count, total in OPTIMIZER_SHAPES] + [list(g) for g in shape_groups]
        self.cases = []
        for shapes in groups:
            params = [torch.nn.Parameter(torch.randn(*shape, device=device)) for shape in shapes]
            grads = [torch.randn_like(p) for p in params]
            self.cases.append((len(params), sum(p.numel() for p in params), params, grads,
                               torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95))))
        self.times: list[list[float]] = [[] for _ in self.cases]
        # a CPU step runs with its tensors out of cache, as in a run (module docstring)
        self._evict = eviction_buffer(device)

    def run_pass(self, keep: bool) -> None:
        for k, (_, _, params, grads, opt) in enumerate(self.cases):
            for p, g in zip(params, grads):
                p.grad = g.clone()

            def step():
                opt.step()
                opt.zero_grad(set_to_none=True)

            evict_caches(self._evict)
            t, _ = timed(step, self.device)
            if keep:
                self.times[k].append(t)

    def fit(self) -> dict[str, float]:
        """``fixed + per_tensor * tensors + per_param * params``, relative least squares."""
        x = np.array([[1.0, c[0], c[1]] for c in self.cases], dtype=np.float64)
        y = np.array([statistics.median(t) for t in self.times])
        scale = x.max(axis=0)
        coef = nnls(x / scale / y[:, None], np.ones_like(y)) / scale
        return {"fixed_s": float(coef[0]), "per_tensor_s": float(coef[1]), "per_param_s": float(coef[2])}


def parameter_shape_groups(model: MultimodalModel) -> list[list[tuple[int, ...]]]:
    """Per module: all its parameters, its first half of layers, and its first block."""
    groups = []
    for name in model.module_names:
        layers = model.module_layers(name)
        shapes = [[tuple(p.shape) for p in l.module.parameters()] for l in layers]
        groups.append([s for ls in shapes for s in ls])
        groups.append([s for ls in shapes[: max(len(shapes) // 2, 1)] for s in ls])
        block = next((ls for l, ls in zip(layers, shapes) if l.kind == "block"), None)
        if block:
            groups.append(block)
    return [g for g in groups if g]
