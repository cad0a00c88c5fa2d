"""Activation checkpointing of a stage (issue 9 point 6; ``ModuleSpec.recompute``).

- ``"full"``: every block (layer of kind ``block``) of the stage keeps only its inputs; its whole
  forward runs again in the backward (Chen et al., "Training Deep Nets with Sublinear Memory
  Cost", 2016; torchtitan's ``apply_ac`` in mode ``full``).
- ``"selective"``: only the attention core of each block (the scaled-dot-product part,
  `loom.model.zoo.attention.AttentionCore`) is recomputed, the cheap part whose intermediates
  grow with the sequence (Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", MLSys 2023, §4.2).
- ``"none"``: nothing.

Both wrap the module from outside, in place, with ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`` around its ``forward``: a `Layer`'s forward is a closure that calls the
module object (STYLE P2), so replacing the layer would not take effect, while the instance's
``forward`` is what ``nn.Module.__call__`` runs (hooks of other techniques stay outside). The
non-reentrant variant supports the executor's split backward (several ``backward`` calls over
one graph with ``retain_graph``) and inputs that do not require grad.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from loom.model.layers import Layer
from loom.model.zoo.attention import AttentionCore
from loom.plan.plan import RECOMPUTE_MODES, PlanError

log = logging.getLogger(__name__)

_MARK = "_loom_recompute"  # set on a wrapped module, so applying twice wraps once


def checkpoint_module(module: nn.Module) -> bool:
    """Make ``module`` recompute its forward in the backward; False if it already does."""
    if getattr(module, _MARK, False):
        return False
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    setattr(module, _MARK, True)
    return True


def attention_cores(block: nn.Module) -> list[nn.Module]:
    """The attention cores inside a block (what selective recompute wraps)."""
    return [m for m in block.modules() if isinstance(m, AttentionCore)]


def recompute_targets(layers: list[Layer], mode: str, module: str = "?") -> list[nn.Module]:
    """The modules ``mode`` checkpoints among ``layers``: the blocks (``full``), their attention
    cores (``selective``) or none. A block without an attention core cannot run ``selective``
    (the Hugging Face adapter's blocks call Hugging Face's attention functions directly)."""
    if mode not in RECOMPUTE_MODES:
        raise PlanError(f"plan.modules[{module!r}].recompute = {mode!r}: use one of {list(RECOMPUTE_MODES)}")
    blocks = [l for l in layers if l.kind == "block"]
    if mode == "none":
        return []
    if mode == "full":
        return [l.module for l in blocks]
    cores = []
    for l in blocks:
        found = attention_cores(l.module)
        if not found:
            raise PlanError(
                f'plan.modules[{module!r}].recompute = "selective": block {l.name!r} '
                f"({type(l.module).__name__}) has no attention core loom can wrap (the zoo's AttentionCore); "
                f'use recompute = "full" for this module'
            )
        cores += found
    return cores


def apply_recompute(layers: list[Layer], mode: str, module: str = "?") -> int:
    """Checkpoint ``layers`` (a stage's) in place under ``mode``; returns how many modules were
    wrapped (0 for ``none``)."""
    wrapped = sum(checkpoint_module(m) for m in recompute_targets(layers, mode, module))
    if wrapped:
        log.info("applied %s activation checkpointing to %d modules of %s", mode, wrapped, module)
    return wrapped
