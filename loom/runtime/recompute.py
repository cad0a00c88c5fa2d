"""Activation checkpointing of a stage (issue 9 point 6; ``ModuleSpec.recompute``).

- ``"full"``: every block (layer of kind ``block``) of the stage keeps only its inputs; its whole
  forward runs again in the backward (Chen et al., "Training Deep Nets with Sublinear Memory
  Cost", 2016; torchtitan's ``apply_ac`` in mode ``full``).
- ``"selective"``: only the attention core of each block (the scaled-dot-product part) is
  recomputed, the cheap part whose intermediates grow with the sequence (Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023, §4.2): the zoo's
  `loom.model.zoo.attention.AttentionCore` modules, and in Hugging Face attention modules the
  attention function they look up by ``config._attn_implementation`` (each such module gets
  its own config copy naming a checkpointed twin of its function, registered with
  ``transformers.AttentionInterface``; the model's masks, built from the model's config, keep
  the original implementation's format).
- ``"none"``: nothing.

Both wrap the module from outside, in place, with ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`` around its ``forward``: a `Layer`'s forward is a closure that calls the
module object (STYLE P2), so replacing the layer would not take effect, while the instance's
``forward`` is what ``nn.Module.__call__`` runs (hooks of other techniques stay outside). The
non-reentrant variant supports the executor's split backward (several ``backward`` calls over
one graph with ``retain_graph``) and inputs that do not require grad.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

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


def hf_attention_modules(block: nn.Module) -> list[nn.Module]:
    """Hugging Face attention modules inside a block: those that pick their attention function
    by ``config._attn_implementation`` (Llama-layout ``*Attention`` with ``q_proj``)."""
    return [m for m in block.modules()
            if type(m).__name__.endswith("Attention") and hasattr(m, "q_proj")
            and isinstance(getattr(getattr(m, "config", None), "_attn_implementation", None), str)]


_CHECKPOINTED = "loom_checkpointed_"


def checkpoint_hf_attention(module: nn.Module) -> bool:
    """Make a Hugging Face attention module recompute its attention function (only) in the
    backward; False if it already does."""
    base = module.config._attn_implementation
    if base.startswith(_CHECKPOINTED):
        return False
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = _CHECKPOINTED + base
    if name not in ALL_ATTENTION_FUNCTIONS:
        # "eager" is not in the registry: get_interface's default is the model's own eager
        # function, which is the same for every Llama-layout family this adapter accepts
        from transformers.models.llama.modeling_llama import eager_attention_forward

        inner: Callable[..., Any] = ALL_ATTENTION_FUNCTIONS.get_interface(base, eager_attention_forward)

        def checkpointed(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)

        AttentionInterface.register(name, checkpointed)
    module.config = copy.copy(module.config)  # this module's own: the model's masks keep ``base``
    module.config._attn_implementation_internal = name
    return True


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
        found = attention_cores(l.module) or hf_attention_modules(l.module)
        if not found:
            raise PlanError(
                f'plan.modules[{module!r}].recompute = "selective": block {l.name!r} '
                f"({type(l.module).__name__}) has no attention core loom can wrap (the zoo's AttentionCore or a "
                f"Hugging Face attention module); "
                f'use recompute = "full" for this module'
            )
        cores += found
    return cores


def apply_recompute(layers: list[Layer], mode: str, module: str = "?") -> int:
    """Checkpoint ``layers`` (a stage's) in place under ``mode``; returns how many modules were
    wrapped (0 for ``none``)."""
    wrapped = 0
    for m in recompute_targets(layers, mode, module):
        # a selective target is a zoo core (wrapped whole) or a Hugging Face attention module
        # (only its attention function is wrapped)
        hf = mode == "selective" and not isinstance(m, AttentionCore)
        wrapped += checkpoint_hf_attention(m) if hf else checkpoint_module(m)
    if wrapped:
        log.info("applied %s activation checkpointing to %d modules of %s", mode, wrapped, module)
    return wrapped
