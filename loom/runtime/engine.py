"""Wiring a rank for a parallel run: plan check, schedule, meshes, stage, groups, executor.

`ParallelEngine.create` is what the training loop and the multi-process tests both call after
``torch.distributed`` is initialised, so the tests exercise exactly the production path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from loom.schedule.layout import BatchLayout, contiguous_layout
from loom.data.sample import Batch
from loom.model.multimodal import MultimodalModel
from loom.plan.plan import Plan, PlanError
from loom.runtime.executor import PipelineExecutor, StepResult
from loom.runtime.precision import Precision
from loom.runtime.recompute import apply_recompute
from loom.runtime.context_parallel import check_context_parallel
from loom.runtime.mesh import (build_hybrid_meshes, build_meshes, build_replica_meshes, data_parallel_group,
                               stage_data_parallel_group)
from loom.runtime.rows import RowMap
from loom.runtime.stage import Stage, build_stages, trainable_stages
from loom.runtime.tensor_parallel import check_tp_degree, layer_sharder, module_config
from loom.runtime.tied import tied_copies
from loom.runtime.unit import UnitPlace
from loom.runtime.zero import apply_zero, check_zero, zero_optimizer
from loom.schedule.generators import build_schedule, pipeline_stages
from loom.schedule.ir import Schedule
from loom.schedule.validate import validate_schedule

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass
class ParallelEngine:
    plan: Plan
    schedule: Schedule
    stages: list[Stage]  # the stages this rank hosts: one, or its chunks under virtual stages
    executor: PipelineExecutor
    optimizer: torch.optim.Optimizer | None
    trainable: dict[tuple[str, int], bool] = field(default_factory=dict)
    eager_forward: int = 0  # extra encoder warmup microbatches of balanced schedules (Entrain §3.6)
    meshes: dict[str, DeviceMesh] = field(default_factory=dict)  # per module (loom.runtime.mesh)
    # a reordering of each built schedule decided above the runtime (plan.bubble_fill: loom.train
    # passes the simulator's fill, loom.train.build.bubble_filler); validated like the built one
    schedule_transform: Callable[[Schedule, Plan], Schedule] | None = None
    _schedules: dict = field(default_factory=dict, repr=False)
    _eval_schedules: dict = field(default_factory=dict, repr=False)

    @classmethod
    def create(
        cls,
        model: MultimodalModel,
        plan: Plan,
        device: torch.device,
        optimizer_factory: OptimizerFactory | None = None,
        release_others: bool = True,
        max_grad_norm: float = 0.0,  # global-norm gradient clipping, 0 = off (PipelineExecutor)
        dtype: str = "fp32",  # run.dtype: "fp32" or "bf16" (loom.runtime.precision)
    ) -> "ParallelEngine":
        precision = Precision(dtype, device.type)  # refuses an unknown dtype before any group is built
        rank, world_size = dist.get_rank(), dist.get_world_size()
        plan.resolve(model.layer_counts(), world_size, generators=list(model.generators))
        for m in plan.modules:
            check_context_parallel(m, model)  # loom.runtime.context_parallel: the LLM's, alone on its module
            check_zero(m)  # loom.runtime.zero: ZeRO needs replicas
            if m.tensor_parallel > 1 and m.name not in plan.generator_names:  # a generator's TP ranks hold it whole
                # before any group is built: a bad degree fails on every rank alike
                check_tp_degree(m.name, m.tensor_parallel, module_config(model, m.name))
        trainable = trainable_stages(model, plan)
        schedule = build_schedule(plan, trainable)
        validate_schedule(schedule, plan)
        # every rank builds every module's mesh, in plan order (group creation is collective)
        meshes = build_meshes(plan, device.type)
        hybrid = build_hybrid_meshes(plan, device.type)  # ZeRO hybrid sharding (loom.runtime.zero)
        replicas = build_replica_meshes(plan, device.type)  # dp x cp gradient groups (context parallelism)
        # the rank's pipeline unit (loom.runtime.unit); under hybrid sharding its TP mesh is sliced from the
        # hybrid mesh, the root FSDP2 needs to join it with (dp_replicate, dp_shard) (loom.runtime.zero)
        unit = UnitPlace.of(plan, rank, {**meshes, **hybrid})
        # each layer split over the unit's TP ranks as soon as it has values (loom.runtime.tensor_parallel)
        # every hosted module's layers split over the unit's TP ranks at its own TP degree
        # (first_stage and colocated encoders take the LLM's; an encoder in lanes, TP 1, is whole)
        stages = build_stages(model, plan, rank, release_others=release_others, device=device,
                              shard_layer=lambda module: layer_sharder(
                                  model, module, unit.tp_mesh if plan.spec(module).tensor_parallel > 1
                                  and module not in plan.generator_names else None))
        stage = stages[0]  # ZeRO 2/3 is refused where a rank hosts several; hosted encoders share the LLM's zero_stage
        dp_group = data_parallel_group(meshes, plan, rank, replicas)
        groups = {(st.module, st.stage): stage_data_parallel_group(meshes, plan, rank, st.module, replicas)
                  for st in stages}
        for st in stages:
            apply_recompute(st.layers, plan.spec(st.module).recompute, st.module)  # loom.runtime.recompute
        zero = apply_zero(stage, plan, meshes, hybrid, precision, replicas)  # ZeRO 2/3: FSDP2 over dp (x tp) (loom.runtime.zero)
        params = [p for st in stages for p in st.trainable_parameters()]
        optimizer = optimizer_factory(params) if optimizer_factory is not None and params else None
        if optimizer is not None and plan.spec(stage.module).zero_stage == 1:
            optimizer = zero_optimizer(optimizer, params, dp_group)
        tied = tied_copies(model, plan, rank, stages)  # tied embeddings across stages (loom.runtime.tied)
        executor = PipelineExecutor(model, plan, stages, rank, device, groups, trainable, optimizer, max_grad_norm,
                                    precision, unit, zero, tied)
        return cls(plan, schedule, stages, executor, optimizer, trainable, meshes=meshes)

    @property
    def stage(self) -> Stage:
        """The rank's first stage: its module and replica, and its only stage without virtual stages."""
        return self.stages[0]

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Every parameter this rank holds, by its name in the full model (all hosted stages)."""
        return {n: p for st in self.stages for n, p in st.named_parameters().items()}

    def microbatches_to_load(self) -> list[int]:
        """Global indices of the microbatches this rank works on (in any stage it hosts)."""
        return sorted({j for st in self.stages for j in self.plan.microbatches_of(st.module, st.replica)})

    def schedule_for(self, layout: BatchLayout) -> Schedule:
        """The (validated) schedule of an iteration with ``layout``; identical layouts share
        one, so a steady data mix pays for generation and validation once."""
        key = (layout.key(), layout.eager_forward)  # a digest of the slots: no tuple per sample each step
        if key not in self._schedules:
            if len(self._schedules) >= 64:
                self._schedules.clear()
            schedule = build_schedule(self.plan, self.trainable, layout=layout, eager=self.eager_forward)
            plan = replace(self.plan, num_microbatches=layout.num_microbatches)
            if self.plan.bubble_fill != "none":
                if self.schedule_transform is None:
                    raise PlanError(f"plan.bubble_fill = {self.plan.bubble_fill!r}: the engine needs the fill as its "
                                    f"schedule_transform (loom train sets it: loom.train.build.bubble_filler)")
                schedule = self.schedule_transform(schedule, plan)
            validate_schedule(schedule, plan)
            self._schedules[key] = schedule
        return self._schedules[key]

    def eval_schedule_for(self, layout: BatchLayout) -> Schedule:
        """The (validated) forward-only schedule of an evaluation under ``layout``: the plan's
        schedule with every stage counted as frozen, so it holds forwards and their messages
        only (no backward, gradient sync or optimizer step); no eager warmup or bubble fill,
        which only reorder a training step's work. Cached apart from the training schedules."""
        key = layout.key()
        if key not in self._eval_schedules:
            if len(self._eval_schedules) >= 64:
                self._eval_schedules.clear()
            frozen = {sid: False for sid in pipeline_stages(self.plan)}
            schedule = build_schedule(self.plan, frozen, layout=layout)
            validate_schedule(schedule, replace(self.plan, num_microbatches=layout.num_microbatches))
            self._eval_schedules[key] = schedule
        return self._eval_schedules[key]

    def evaluate(
        self,
        microbatches: dict[int, Batch],
        num_targets: int,
        step: int = 0,
        *,
        layout: BatchLayout,
        rows: RowMap | None = None,
        num_generations: dict[str, int] | None = None,
    ) -> StepResult:
        """A forward-only pass of a global batch (arguments as `step`): the losses as training
        computes them, without autograd, gradients, optimizer or scheduler, so the state of the
        run is left as it was (an evaluation between two steps does not change the training)."""
        microbatches = self.executor.unit.share_microbatches(microbatches)
        with torch.no_grad():
            return self.executor.run(self.eval_schedule_for(layout), microbatches, num_targets, rows, step,
                                     exact_timing=False, num_generations=num_generations, forward_only=True)

    def identity_layout(self, batch_size: int) -> BatchLayout:
        """The unbalanced layout of a global batch of ``batch_size`` samples: the plan's
        microbatches of consecutive positions, the same slots in every phase (what the
        `Dispatcher` returns under policy ``none``)."""
        if batch_size < self.plan.num_microbatches:
            raise ValueError(f"a global batch of {batch_size} samples cannot fill plan.num_microbatches = "
                             f"{self.plan.num_microbatches}; use at least that many samples")
        return contiguous_layout(batch_size, self.plan.num_microbatches, self.plan.module_names)

    def step(
        self,
        microbatches: dict[int, Batch],
        num_targets: int,
        step: int = 0,
        exact_timing: bool = True,
        *,
        layout: BatchLayout,
        rows: RowMap | None = None,
        num_generations: dict[str, int] | None = None,
    ) -> StepResult:
        """One iteration under ``layout`` (from the `Dispatcher`, or `identity_layout`):
        ``microbatches`` are this rank's slots of it, ``rows`` its `RowMap` (needed when the
        layout routes encoder rows by sample); ``num_generations``, per generator, the global
        batch's items (a generator's loss normalisation)."""
        microbatches = self.executor.unit.share_microbatches(microbatches)  # the unit leader's, on every rank
        return self.executor.run(self.schedule_for(layout), microbatches, num_targets, rows, step, exact_timing,
                                 num_generations)

    def close(self) -> None:
        """End the runtime's communication before ``destroy_process_group``: wait for every send
        still in flight, then a barrier, so no rank tears its group down while a peer's message
        to it (or its own) is pending. Call it on every rank; the training loop does."""
        self.executor.close()
        dist.barrier()
