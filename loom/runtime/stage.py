"""Pipeline stages cut from a `MultimodalModel` by a `Plan`, and the process groups they need.

A rank allocates only its own stage: the model comes built on the meta device
(`loom.train.build.build_model` with ``device="meta"``), and `build_stages` materialises the
stages' layers one at a time, each from its own seed, so their values equal the
single-process reference's (`loom.model.materialise`). A model built with values (older
callers, the profiler) still works: its stage is moved to the device and the other layers are
released to meta. Parameter names stay those of the full model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from loom.model.layers import Layer
from loom.model.multimodal import MultimodalModel
from loom.plan.plan import LLM, Plan


@dataclass
class Stage:
    """The slice of one module that one rank runs."""

    module: str
    stage: int
    replica: int
    layers: list[Layer]
    is_first: bool  # first stage of its module (encoders read the microbatch here)
    is_last: bool  # last stage of its module (the LLM's and a generator's compute a loss)
    generator: bool = False  # a stage of a generator after the LLM (loom.model.generator)

    @property
    def computes_loss(self) -> bool:
        return self.is_last and (self.module == LLM or self.generator)

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {f"{l.name}.{n}": p for l in self.layers for n, p in l.module.named_parameters()}

    def trainable_parameters(self) -> list[nn.Parameter]:
        # a tie held whole by the stage (tied embeddings on one stage) is one parameter, listed once
        return list({id(p): p for p in self.named_parameters().values() if p.requires_grad}.values())


def stage_layers(model: MultimodalModel, plan: Plan, module: str, stage: int) -> list[Layer]:
    start, end = plan.layers_of(module, stage)
    return model.module_layers(module)[start:end]


def trainable_stages(model: MultimodalModel, plan: Plan) -> dict[tuple[str, int], bool]:
    """Whether each stage holds a trainable parameter (input to frozen-aware scheduling)."""
    return {
        (m.name, s): any(p.requires_grad for l in stage_layers(model, plan, m.name, s) for p in l.module.parameters())
        for m in plan.modules
        for s in range(m.num_stages)
    }


def build_stages(
    model: MultimodalModel, plan: Plan, rank: int, release_others: bool = True, device: torch.device | str = "cpu",
    shard_layer: Callable[[str], Callable[[Layer], None] | None] | None = None,
) -> list[Stage]:
    """The stages ``rank`` runs (one, or its chunks under virtual stages, `Plan.stages_of`),
    with their layers (and their module's context modules) on ``device``. With
    ``release_others``, layers of other stages that hold values go to meta.
    ``shard_layer(module)`` gives what splits a layer of ``module`` (tensor parallelism:
    `loom.runtime.tensor_parallel.layer_sharder`; None: nothing); it runs on each layer right
    after it is materialised, so a rank holds at most one whole layer next to its shards."""
    stages = []
    for module, stage, replica in plan.stages_of(rank):
        start, end = plan.layers_of(module, stage)
        layers = stage_layers(model, plan, module, stage)
        shard = shard_layer(module) if shard_layer is not None else None
        for index, layer in zip(range(start, end), layers):
            model.materialise(module, device, index, index + 1)
            if shard is not None:
                shard(layer)
        stages.append(Stage(module, stage, replica, layers, is_first=stage == 0,
                            is_last=stage == plan.spec(module).num_stages - 1,
                            generator=module in plan.generator_names))
    if release_others:
        held = {id(l.module) for st in stages for l in st.layers}
        for name in plan.module_names:
            for layer in model.module_layers(name):
                if id(layer.module) not in held:
                    layer.module.to("meta")
    return stages


def move_batch(batch, device: torch.device):
    """A copy of a `Batch` with every tensor on ``device``."""
    from dataclasses import replace

    inputs = {
        name: {k: [t.to(device) for t in v] for k, v in d.items()} for name, d in batch.modality_inputs.items()
    }
    generation = {name: {**d, "targets": [t.to(device) for t in d["targets"]]}
                  for name, d in batch.generation_inputs.items()}
    return replace(batch, input_ids=batch.input_ids.to(device), labels=batch.labels.to(device), modality_inputs=inputs,
                   generation_inputs=generation)
