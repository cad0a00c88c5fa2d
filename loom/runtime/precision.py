"""Mixed precision of a run (issue 9 point 7; ``run.dtype``): ``"fp32"`` or ``"bf16"``.

Under ``"bf16"`` the runtime follows PyTorch's automatic mixed precision (Micikevicius et al.,
"Mixed Precision Training", ICLR 2018, with bfloat16 so no loss scaling is needed):

- **master weights stay fp32**: parameters are never cast, so their gradients, the gradient
  reduction over data-parallel replicas, the clipping norm and the optimizer state are fp32;
- **compute in bf16**: every forward (and the forward that activation checkpointing
  recomputes: ``torch.utils.checkpoint`` replays it under the autocast state it was first run
  with) runs under ``torch.autocast(device_type, torch.bfloat16)``, which casts the inputs of
  matrix products and convolutions (weights included, a transient copy) and keeps reductions,
  norms and softmax in fp32;
- **messages in bf16**: a stage's output is cast to bf16 before it is sent (the cast is part of
  the graph, so the gradient that comes back, bf16 too, is applied to the bf16 output and
  flows into the fp32 residual stream); a received activation is a bf16 leaf (its gradient,
  sent back, is bf16) which the stage upcasts to fp32 on entry, so the residual stream past a
  cut is fp32 as in the single-process model;
- **the loss in fp32**: logits are upcast before the cross-entropy
  (`loom.model.multimodal.loss_sum`).

With FSDP2 (ZeRO 2/3) the sharded master parameters stay fp32 and FSDP's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` gathers them in bf16 (half the
all-gather bytes, no separate autocast copy) and reduce-scatters fp32 gradients
(`loom.runtime.zero.mixed_precision_policy`; stage inputs are not cast, autocast runs alongside).

The single-process reference runs ``model.loss`` under `Precision.autocast` too: the same rule
without the message casts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # run.dtype -> the compute dtype


@dataclass(frozen=True)
class Precision:
    """The precision rule of a run on ``device_type`` (``"cpu"`` or ``"cuda"``)."""

    dtype: str = "fp32"
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"run.dtype = {self.dtype!r}: unknown precision; choose one of {list(DTYPES)}")
        check_dtype_supported(self.dtype, self.device_type)

    @property
    def mixed(self) -> bool:
        return self.dtype != "fp32"

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context every forward runs in: autocast to bf16, or nothing under fp32."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def message(self, out: torch.Tensor) -> torch.Tensor:
        """A stage output as it is sent: floating tensors in the compute dtype (a graph op,
        so the received gradient has that dtype too)."""
        if self.mixed and out.is_floating_point() and out.dtype != self.compute_dtype:
            return out.to(self.compute_dtype)
        return out

    def stage_input(self, x: Any) -> Any:
        """What a stage computes from a received activation (or a dict of them, the LLM's first
        stage): bf16 messages upcast to fp32, so the stage's residual stream keeps fp32."""
        if not self.mixed:
            return x
        if isinstance(x, dict):
            return {k: self.stage_input(v) for k, v in x.items()}
        if isinstance(x, torch.Tensor) and x.dtype == self.compute_dtype:
            return x.float()
        return x


def check_dtype_supported(dtype: str, device_type: str) -> None:
    """Refuse ``run.dtype = "bf16"`` on a CUDA device without bf16 (before Ampere); CPU autocast
    supports bf16 everywhere."""
    if dtype == "bf16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError('run.dtype = "bf16": this CUDA device has no bf16 support '
                         '(torch.cuda.is_bf16_supported() is False); use run.dtype="fp32" or an Ampere or newer GPU')
