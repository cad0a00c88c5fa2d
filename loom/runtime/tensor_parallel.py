"""Tensor parallelism (Megatron-LM's column/row-wise split) with sequence parallelism, applied
per pipeline stage with PyTorch's ``parallelize_module`` after the stage is materialised
(docs/architecture.md principle 5: DeviceMesh and DTensor, the model code stays plain).

One plan per model family, chosen from the module's model (`apply_tensor_parallel`):

- **Llama-layout LLMs** (the zoo's ``LlamaForCausalLM`` and Hugging Face's, which share the
  parameter names): q/k/v/gate/up column-wise, o/down row-wise with a reduce-scatter onto the
  sequence (``RowwiseParallel(output_layouts=Shard(1))``), the norms ``SequenceParallel``, so
  between blocks every rank holds its slice of the sequence ``[B, L / tp, H]``; before
  attention and the MLP the slice is all-gathered. The embedding is vocabulary-parallel
  (row-wise) and the head column-wise with vocabulary-sharded logits, which the loss reads
  under ``loss_parallel`` (`loom.runtime.unit.UnitPlace.loss_context`): no rank ever holds the
  full logits. For Hugging Face models the projections' split comes from the config's own
  ``base_model_tp_plan`` ("colwise" / "rowwise"); the sequence parallel parts are loom's.
- **The zoo's ViT and audio encoder** (`EncoderBlock`): the fused qkv projection column-wise by
  heads (a strided shard: each rank holds its heads' rows of q, of k and of v), the attention
  output projection row-wise, the MLP column- then row-wise. No sequence parallelism: the
  packed item sequence stays whole (``Replicate``) on every rank, so norms, the front-end and
  the projector are replicated.

**The merge under sequence parallelism.** The LLM's first layer embeds the text and scatters
the encoders' projected tokens into their placeholder positions (`MultimodalModel.merge`). The
vocabulary-parallel embedding's output is the full sequence (``Replicate``), the merge runs on
the full sequence, and only then is the sequence sharded, by a hook on the first decoder block
(`_shard_sequence`, a DTensor redistribute ``Replicate -> Shard(1)``). Its backward all-gathers,
so the encoder tokens' gradient is the full gradient on every rank (what the unit contract in
`loom.runtime.unit` sends back from the leader only).

Sequence sharding is even: the LLM's microbatches are right-padded to a multiple of the TP
degree (`loom.runtime.unit.pad_microbatch`: a non-placeholder id, label ``-100``, an extra packed segment), which
changes nothing for the real tokens under causal attention.

Every rank materialises the same full stage from per-layer seeds (`loom.model.materialise`)
and keeps its shards (``src_data_rank=None``: no scatter), so the shards equal the
single-process model's slices.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.distributed.tensor.placement_types import _StridedShard

from loom.model.hf import adapter_for as hf_adapter_for
from loom.model.layers import Layer
from loom.model.multimodal import MultimodalModel
from loom.model.zoo.audio import AudioEncoder
from loom.model.zoo.llama import LlamaForCausalLM
from loom.model.zoo.vision import EncoderBlock, VisionEncoder
from loom.plan.plan import LLM, PlanError
from loom.runtime.stage import Stage

# A Hugging Face base_model_tp_plan entry -> the style loom applies (sequence parallel flavour)
_HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise"}
_LLAMA_PROJECTIONS = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                      "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                      "mlp.down_proj": "rowwise"}


class FusedColwiseParallel(ColwiseParallel):
    """Column-wise split of a linear whose output concatenates ``parts`` projections (a fused
    qkv): each rank holds its slice of every part (``_StridedShard(0, parts)``), so its local
    output is ``[q_r, k_r, v_r]`` and splits into ``parts`` equal pieces as the full one does."""

    def __init__(self, parts: int):
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            shard = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=self.parts)],
                                      src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(shard, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001
        return outputs.to_local()  # each rank's heads, in the fused order


def _local(styles: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    for style in styles.values():
        style.src_data_rank = None  # every rank holds the same seeded values: keep the own shard
    return styles


def _shard_sequence(mesh: DeviceMesh):
    """Forward pre-hook: the full sequence (argument 0, ``Replicate``) -> this rank's slice."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)
        return (x.redistribute(mesh, [Shard(1)]).to_local(), *args[1:]), kwargs
    return hook


def _gather_sequence(mesh: DeviceMesh):
    """Forward pre-hook: this rank's slice of the hidden states (argument 0 or keyword
    ``hidden_states``, ``Shard(1)``) -> the full sequence as a ``Replicate`` DTensor."""
    def gather(x: Any) -> Any:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return x.redistribute(mesh, [Replicate()])

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
        return (gather(args[0]), *args[1:]), kwargs
    return hook


def llama_projection_styles(model: nn.Module) -> dict[str, str]:
    """A Llama-layout block's projection splits: the Hugging Face config's
    ``base_model_tp_plan`` where it ships one, else the Megatron split."""
    shipped = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not shipped or isinstance(model, LlamaForCausalLM):
        return dict(_LLAMA_PROJECTIONS)
    styles = {}
    for key, value in shipped.items():
        if not key.startswith("layers.*."):
            continue
        sub = key[len("layers.*."):]
        if value not in _HF_STYLES:
            raise PlanError(f"plan.modules['llm'].tensor_parallel: the model config's base_model_tp_plan names "
                            f"{value!r} for {key!r}, which loom does not apply; use tensor_parallel = 1 or a "
                            f"model whose plan uses {sorted(_HF_STYLES)}")
        styles[sub] = _HF_STYLES[value]
    return styles


def parallelize_llama_layer(layer: Layer, mesh: DeviceMesh, projections: dict[str, str]) -> None:
    """TP with sequence parallelism for one layer of a Llama-layout LLM (module docstring)."""
    if layer.kind == "embedding":
        parallelize_module(layer.module, mesh, _local({"": RowwiseParallel(input_layouts=Replicate(),
                                                                           output_layouts=Replicate())})[""])
    elif layer.kind == "block":
        styles: dict[str, ParallelStyle] = {"input_layernorm": SequenceParallel(use_local_output=True),
                                            "post_attention_layernorm": SequenceParallel(use_local_output=True)}
        for sub, kind in projections.items():
            styles[sub] = ColwiseParallel() if kind == "colwise" else RowwiseParallel(output_layouts=Shard(1))
        parallelize_module(layer.module, mesh, _local(styles))
        for sub in ("self_attn", "mlp"):
            layer.module.get_submodule(sub).register_forward_pre_hook(_gather_sequence(mesh), with_kwargs=True)
        if layer.name.endswith("layers.0"):  # the first block receives the merged full sequence
            layer.module.register_forward_pre_hook(_shard_sequence(mesh), with_kwargs=True)
    elif layer.kind == "norm":
        parallelize_module(layer.module, mesh, _local({"": SequenceParallel(use_local_output=True)})[""])
    elif layer.kind == "head":
        parallelize_module(layer.module, mesh, _local({"": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})[""])


def parallelize_encoder_layer(layer: Layer, mesh: DeviceMesh) -> None:
    """TP for one layer of the zoo's ViT / audio encoder: blocks only (module docstring)."""
    if isinstance(layer.module, EncoderBlock):
        parallelize_module(layer.module, mesh, _local({"qkv": FusedColwiseParallel(3), "proj": RowwiseParallel(),
                                                       "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}))


def check_tp_degree(module: str, degree: int, config: Any) -> None:
    """Refuse a TP degree that module ``module``'s shapes (from its ``config``: the zoo's
    ``LlamaConfig``, ``VisionConfig``, ``AudioConfig`` or a Hugging Face config) cannot split
    evenly: query and key/value heads, the hidden size, the MLP width, the vocabulary. The
    message names the field and the fix. Needs no model, so `TrainConfig.check` runs it before
    launch, and the engine again on the built model."""
    where = f"plan.modules[{module!r}].tensor_parallel = {degree}"
    for what, size in tp_split_sizes(config).items():
        if size % degree:
            divisors = [d for d in range(1, min(size, 64) + 1) if size % d == 0]
            raise PlanError(f"{where} does not divide the {what} ({size}); choose a degree that divides it "
                            f"(one of {divisors}) or 1")


def tp_split_sizes(config: Any) -> dict[str, int]:
    """The sizes TP splits in a module of ``config`` (each must be divisible by the degree)."""
    if hasattr(config, "num_attention_heads"):  # Hugging Face
        return {"attention heads (num_attention_heads)": config.num_attention_heads,
                "key/value heads (num_key_value_heads)": getattr(config, "num_key_value_heads", None)
                or config.num_attention_heads,
                "hidden size (hidden_size)": config.hidden_size,
                "intermediate size (intermediate_size)": config.intermediate_size,
                "vocabulary (vocab_size)": config.vocab_size}
    if hasattr(config, "num_kv_heads"):  # the zoo's Llama
        return {"attention heads (num_heads)": config.num_heads,
                "key/value heads (num_kv_heads)": config.num_kv_heads,
                "hidden size (hidden_size)": config.hidden_size,
                "intermediate size (intermediate_size)": config.intermediate_size,
                "vocabulary (vocab_size)": config.vocab_size}
    # the zoo's encoders: heads, width, MLP width
    return {"attention heads (num_heads)": config.num_heads, "hidden size (hidden_size)": config.hidden_size,
            "MLP width (hidden_size * mlp_ratio)": int(config.hidden_size * config.mlp_ratio)}


def module_config(model: MultimodalModel, module: str) -> Any:
    """The config that shapes module ``module`` of ``model``."""
    return model.llm.config if module == LLM else model.encoders[module].encoder.config


def supports_tensor_parallel(model: MultimodalModel, module: str) -> bool:
    if module == LLM:
        return isinstance(model.llm, LlamaForCausalLM) or _is_hf_llama(model.llm)
    return isinstance(model.encoders[module].encoder, (VisionEncoder, AudioEncoder))


def _is_hf_llama(llm: nn.Module) -> bool:
    return hf_adapter_for(llm) is not None


def layer_sharder(model: MultimodalModel, module: str, mesh: DeviceMesh | None) -> Callable[[Layer], None] | None:
    """What splits one materialised layer of ``module`` over the unit's TP ``mesh`` with its
    model family's plan (None: TP = 1, nothing to do); `loom.runtime.stage.build_stages` calls it
    on each layer as soon as it has values. A layer is split once, however often it is passed."""
    if mesh is None:
        return None
    degree = mesh.size()
    if not supports_tensor_parallel(model, module):
        kind = type(model.llm if module == LLM else model.encoders[module].encoder).__name__
        raise PlanError(f"plan.modules[{module!r}].tensor_parallel = {degree}: loom has no TP plan for "
                        f"{kind}; set tensor_parallel = 1 for it")
    check_tp_degree(module, degree, module_config(model, module))
    projections = llama_projection_styles(model.llm) if module == LLM else {}

    def shard(layer: Layer) -> None:
        if getattr(layer.module, "_loom_tp", False):
            return
        if module == LLM:
            parallelize_llama_layer(layer, mesh, projections)
        else:
            parallelize_encoder_layer(layer, mesh)
        layer.module._loom_tp = True
    return shard


def apply_tensor_parallel(model: MultimodalModel, stage: Stage, mesh: DeviceMesh | None) -> None:
    """Split ``stage``'s layers over the unit's TP ``mesh`` (None: TP = 1, nothing to do), those
    not split yet (`layer_sharder`). Call after the stage is materialised, before recompute
    wrappers."""
    shard = layer_sharder(model, stage.module, mesh)
    if shard is not None:
        for layer in stage.layers:
            shard(layer)

