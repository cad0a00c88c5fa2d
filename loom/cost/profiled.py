"""`ProfiledCostModel`: the cost contract (`loom.cost.model`) answered from a measured
`Profile` (entrain.md §3.1), frozen-aware by Cornstarch's rule (cornstarch.md §3.2.2)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from loom.cost.analytic import LayerCost
from loom.cost.arch import ModelArch
from loom.cost.frozen import INPUT_KINDS, needs_from_flags
from loom.cost.model import CostModel, MicrobatchWork, StageKind, Workload
from loom.cost.profile_fit import FEATURES, evaluate
from loom.cost.profile_file import Profile, ProfileError
from loom.model.multimodal import MultimodalModel
from loom.plan.plan import LLM, Plan, PlanError

TrainableSpec = Mapping[str, bool | Sequence[bool]]  # module -> one flag, or one per layer


class ProfiledCostModel(CostModel):
    """The `CostModel` contract answered from a `Profile` (measured, not specified).

    - ``model``: what the costs are for: a `MultimodalModel` (its signature must match the
      profile's, else `ProfileError`; its ``requires_grad`` flags say what is trainable), or a
      `loom.cost.arch.ModelArch` (same module names, layer names and parameter counts as the
      profile; its ``trainable`` flags count), or ``None`` with ``trainable`` (module -> bool or
      per-layer bools; default: everything trainable).
    - compute: the sum of the stage's fitted layers, frozen-aware by Cornstarch's rule as
      `loom.cost.frozen.backward_needs` states it (``backward_weight`` for trainable layers,
      ``backward_input`` from the first trainable layer on, for the LLM also when an encoder is
      trainable); every stage's forward adds its context build (the executor builds it on every
      stage), the LLM's last stage its loss. Recompute adds the forward to the backward. TP/CP
      were not profiled: such stages are charged the TP=CP=1 time divided by ``TP x CP`` (ideal
      scaling, no collective cost; use the analytic model to plan TP/CP).
    - messages (`Communication`, for the activation's bytes: tokens x output width x dtype
      bytes): the simulator's sends and receives take no time on their rank, but in the
      executor each costs CPU time, so a forward or backward is charged its messages' costs
      (posting its sends, completing its receives: `_messages`), and ``transfer_time`` is the
      latency a waiting receiver sees beyond its own receive cost. Gradient sync comes from the
      2-rank all-reduce, carried to ``n`` ranks as a ring (``(n-1) alpha + 2 (n-1)/n bytes /
      bandwidth``).
    - optimizer: the measured AdamW fit for the stage's trainable parameters and tensors.
    - memory: parameters, gradients and AdamW states from parameter counts; activations from
      the fitted bytes autograd saved per layer.
    - FLOPs: ``2 x params x tokens`` per matmul phase (embeddings excluded); peak is the
      measured matmul FLOP/s.
    """

    def __init__(self, profile: Profile, model: Any = None, plan: Plan | None = None,
                 trainable: TrainableSpec | None = None):
        self.profile = profile
        self._tensor_counts = {m: [len(layer[1]) for layer in ls] for m, ls in profile.signature.items()}
        if isinstance(model, MultimodalModel):
            profile.check_matches(model)
            trainable = {m: [any(p.requires_grad for p in l.module.parameters()) for l in model.module_layers(m)]
                         for m in model.module_names}
        elif isinstance(model, ModelArch):
            _check_arch(profile, model)
            trainable = {m: [l.trainable for l in mod.layers] for m, mod in model.modules.items()}
        elif model is not None:
            raise TypeError(f"model must be a MultimodalModel, a ModelArch or None, not {type(model).__name__}")
        self._trainable = self._trainable_flags(trainable)
        self._needs_input = _input_needs(profile, self._trainable)
        if plan is None:
            raise ValueError("ProfiledCostModel needs the plan whose stages it costs")
        self.plan = plan.resolve(profile.layer_counts())
        for m in self.plan.modules:  # a profile has no CP collective to price the key/value all-gather with
            if m.context_parallel > 1:
                raise PlanError(f"plan.modules[{m.name!r}].context_parallel = {m.context_parallel}: a profile times "
                                f"layers on one rank, not context parallelism's key/value all-gather; price the plan "
                                f"with the analytic cost model (no profile) or set context_parallel = 1")

    def _trainable_flags(self, trainable: TrainableSpec | None) -> dict[str, list[bool]]:
        counts = self.profile.layer_counts()
        out = {m: [True] * n for m, n in counts.items()}
        for m, v in (trainable or {}).items():
            if m not in counts:
                raise ValueError(f"trainable names module {m!r}; the profile has {list(counts)}")
            if isinstance(v, bool):
                out[m] = [v] * counts[m]
            else:
                v = [bool(f) for f in v]
                if len(v) != counts[m]:
                    raise ValueError(f"trainable[{m!r}] has {len(v)} flags; the module has {counts[m]} layers")
                out[m] = v
        return out

    # ---- helpers ---------------------------------------------------------------------------
    def _layers(self, module: str, stage: int) -> range:
        start, end = self.plan.layers_of(module, stage)
        return range(start, end)

    def _is_last_llm(self, module: str, stage: int) -> bool:
        return module == LLM and stage == self.plan.spec(LLM).num_stages - 1

    def stage_needs_backward(self, module: str, stage: int) -> bool:
        return any(self._needs_input[module][i] or self._trainable[module][i] for i in self._layers(module, stage))

    def _split(self, module: str) -> int:
        """How many ways a stage's compute is split: TP x CP, or an encoder's lanes (each a share of the items)."""
        spec = self.plan.spec(module)
        return spec.tensor_parallel * spec.context_parallel * self.plan.lanes(module)

    def _wants_gradient_before(self, module: str, stage: int) -> bool:
        """Whether the stage's input requires grad (something trainable upstream of it)."""
        start = self.plan.layers_of(module, stage)[0]
        if any(self._trainable[module][:start]):
            return True
        return module == LLM and any(any(f) for m, f in self._trainable.items() if m != LLM)

    def _messages(self, module: str, stage: int, kind: StageKind, work: Workload) -> float:
        """CPU time of the messages around this compute action on its rank: posting its sends
        and completing its receives (`Communication`). The simulator's sends and receives take
        no time on their rank, so the executor's per-message cost is charged here, to the
        forward or backward the messages belong to. An encoder's tokens in the LLM's first
        stage have no size in the LLM's workload: those messages are charged their fixed part."""
        comm = self.profile.comm
        if comm is None:
            return 0.0
        spec = self.plan.spec(module)
        first, last = stage == 0, stage == spec.num_stages - 1
        out_bytes = self.activation_bytes(module, stage, work) / self._split(module)
        in_bytes = self.activation_bytes(module, stage - 1, work) / self._split(module) if not first else 0.0
        if not first:
            predecessors = [module]
        else:
            predecessors = self.plan.encoder_names if module == LLM else []  # encoders feed the LLM
        sends_on = not (module == LLM and last)
        if kind == "forward":
            t = sum(comm.recv_ready.time(in_bytes) for _ in predecessors)
            if sends_on:
                t += comm.send_post.time(out_bytes)
            return t
        if not self.stage_needs_backward(module, stage) or kind == "backward_weight":
            return 0.0  # a split backward's messages go with its input part
        t = comm.recv_ready.time(out_bytes) if sends_on else 0.0
        for p in predecessors:
            if p == module:
                if self._wants_gradient_before(module, stage):
                    t += comm.send_post.time(in_bytes)
            elif any(self._trainable[p]):
                t += comm.send_post.time(0.0)
        return t

    def forward_time(self, module: str, stage: int, work: Workload) -> float:
        """Seconds of the stage's forward on one unit (TP = CP = 1), without messages."""
        prof = self.profile
        t = evaluate(prof.context.get(module, [0.0] * len(FEATURES)), work)
        t += sum(prof.layers[module][i].time("forward", work) for i in self._layers(module, stage))
        if self._is_last_llm(module, stage) and prof.loss:
            t += evaluate(prof.loss["forward"], work)
        return max(t, 0.0)

    def backward_time(self, module: str, stage: int, work: Workload, part: str = "backward") -> float:
        """Seconds of the stage's frozen-aware backward (TP = CP = 1), without messages: one
        autograd call through its layers. ``part`` ``"backward_input"`` / ``"backward_weight"``:
        one part of ZB-H1's split backward (each its own autograd call; the loss and a
        recomputed forward go with the input part, which runs first)."""
        if not self.stage_needs_backward(module, stage):
            return 0.0
        layers = self.profile.layers[module]
        inputs, weights = part != "backward_weight", part != "backward_input"
        t = self.profile.backward_call_s
        for i in self._layers(module, stage):
            if inputs and self._needs_input[module][i]:
                t += layers[i].time("backward_input", work)
            if weights and self._trainable[module][i]:
                t += layers[i].time("backward_weight", work)
        if inputs and self._is_last_llm(module, stage) and self.profile.loss:
            t += evaluate(self.profile.loss["backward_input"], work)
        if inputs and self._recompute(module) == "full":
            t += sum(layers[i].time("forward", work) for i in self._layers(module, stage))
        return max(t, 0.0)

    def cold_start_time(self, module: str, stage: int, kind: StageKind) -> float:
        """The stage's layers' measured cold starts (`LayerProfile.cold_forward_s` and
        ``cold_backward_s``) for the layers the action runs: a backward part those that need
        it, a recomputing backward their forwards too."""
        layers, idx = self.profile.layers[module], self._layers(module, stage)
        if kind == "forward":
            t = sum(layers[i].cold_forward_s for i in idx)
        elif not self.stage_needs_backward(module, stage):
            return 0.0
        else:
            inputs, weights = kind != "backward_weight", kind != "backward_input"  # as `backward_time`
            t = sum(layers[i].cold_backward_s for i in idx
                    if (inputs and self._needs_input[module][i]) or (weights and self._trainable[module][i]))
            if inputs and self._recompute(module) == "full":
                t += sum(layers[i].cold_forward_s for i in idx)
        return max(t, 0.0) / self._split(module)

    def module_layer_costs(self, module: str, work: Workload) -> list[LayerCost]:
        """Per layer of the whole module, measured: its forward and frozen-aware backward parts
        on one unit (TP = CP = 1), the partitioner's input as `AnalyticCostModel` gives it. A
        stage's context build, loss and autograd call are not any layer's: they stay out."""
        layers, out = self.profile.layers[module], []
        full = self._recompute(module) == "full"
        for i, layer in enumerate(layers):
            forward = max(layer.time("forward", work), 0.0)
            out.append(LayerCost(
                layer.name, layer.kind, forward,
                max(layer.time("backward_input", work), 0.0) if self._needs_input[module][i] else 0.0,
                max(layer.time("backward_weight", work), 0.0) if self._trainable[module][i] else 0.0,
                forward if full and (self._needs_input[module][i] or self._trainable[module][i]) else 0.0))
        return out

    def _recompute(self, module: str) -> str:
        """The module's recompute mode; a profile times whole layers, not their attention core,
        so it cannot price ``selective``."""
        mode = self.plan.spec(module).recompute
        if mode == "selective":
            raise PlanError(f'plan.modules[{module!r}].recompute = "selective": a profile times whole layers, not '
                            f'their attention core; price it with the analytic cost model or use "none" or "full"')
        return mode

    # ---- the contract ----------------------------------------------------------------------
    def stage_time(self, module: str, stage: int, kind: StageKind, work: Workload) -> float:
        t = self.forward_time(module, stage, work) if kind == "forward" else self.backward_time(module, stage, work, kind)
        return t / self._split(module) + self._messages(module, stage, kind, work)

    def activation_bytes(self, module: str, stage: int, work: Workload) -> float:
        """Bytes of the activation the stage sends on (its last layer's output)."""
        last = self.profile.layers[module][self._layers(module, stage)[-1]]
        return float(work.tokens) * last.out_width * self.profile.dtype_bytes

    def transfer_time(self, src_unit: int, dst_unit: int, module: str, stage: int, work: Workload) -> float:
        """From the sender's post to the message being usable by a receiver already waiting,
        less the receive cost the receiver's compute action is charged (`_messages`)."""
        comm = self.profile.comm
        if src_unit == dst_unit or comm is None:
            return 0.0
        nbytes = self.activation_bytes(module, stage, work) / self._split(module)
        return max(comm.latency.time(nbytes) - comm.recv_ready.time(nbytes), 0.0)

    def transfer_cpu(self, src_unit: int, dst_unit: int, module: str, stage: int, work: Workload
                     ) -> tuple[float, float]:
        """The communicator threads' CPU for the message of `transfer_time`, on its sender and
        its receiver (`Communication.thread_cpu`)."""
        comm = self.profile.comm
        if src_unit == dst_unit or comm is None:
            return 0.0, 0.0
        return comm.thread_cpu(self.activation_bytes(module, stage, work) / self._split(module))

    def _trainable_params(self, module: str, stage: int) -> tuple[int, int]:
        params = tensors = 0
        for i in self._layers(module, stage):
            if self._trainable[module][i]:
                params += self.profile.layers[module][i].params
                tensors += self._tensor_counts[module][i]
        return params, tensors

    def grad_sync_time(self, module: str, stage: int) -> float:
        spec = self.plan.spec(module)
        n = spec.data_parallel
        params, _ = self._trainable_params(module, stage)
        if n <= 1 or params == 0 or self.profile.comm is None:
            return 0.0
        fit = self.profile.comm.all_reduce
        nbytes = params * self.profile.dtype_bytes / (spec.tensor_parallel)
        ref = self.profile.comm.world  # measured on `ref` ranks: per-step latency and ring bytes scale
        ring = (2 * (n - 1) / n) / (2 * (ref - 1) / ref)
        t = fit.alpha_s * (n - 1) / (ref - 1) + nbytes * fit.seconds_per_byte * ring
        return t / 2 if spec.zero_stage >= 2 else t  # a reduce-scatter is half an all-reduce

    def clip_time(self) -> float:
        """Gradient clipping's norm: one fp32 scalar all-reduce over the plan's world, from the
        measured all-reduce fit scaled to the world as `grad_sync_time` scales it."""
        n = self.plan.world_size
        if n <= 1 or self.profile.comm is None:
            return 0.0
        fit, ref = self.profile.comm.all_reduce, self.profile.comm.world
        ring = (2 * (n - 1) / n) / (2 * (ref - 1) / ref)
        return fit.alpha_s * (n - 1) / (ref - 1) + 4 * fit.seconds_per_byte * ring

    def optimizer_time(self, module: str, stage: int) -> float:
        params, tensors = self._trainable_params(module, stage)
        if params == 0 or not self.profile.optimizer:
            return 0.0
        spec = self.plan.spec(module)
        shard = spec.tensor_parallel * (spec.data_parallel if spec.zero_stage >= 1 else 1)
        o = self.profile.optimizer
        return o["fixed_s"] + o["per_tensor_s"] * tensors + o["per_param_s"] * params / shard

    def static_memory(self, module: str, stage: int) -> float:
        spec = self.plan.spec(module)
        b = self.profile.dtype_bytes
        params = sum(self.profile.layers[module][i].params for i in self._layers(module, stage))
        trainable, _ = self._trainable_params(module, stage)
        dp = spec.data_parallel
        weights = params * b / (dp if spec.zero_stage >= 3 else 1)
        grads = trainable * b / (dp if spec.zero_stage >= 2 else 1)
        states = trainable * 8 / (dp if spec.zero_stage >= 1 else 1)  # AdamW: two fp32 moments
        return (weights + grads + states) / spec.tensor_parallel

    def activation_memory(self, module: str, stage: int, work: Workload) -> float:
        if not self.stage_needs_backward(module, stage):
            return 0.0
        layers = self.profile.layers[module]
        idx = self._layers(module, stage)
        if self._recompute(module) == "full":  # only each layer's input is kept
            widths = [layers[i - 1].out_width if i > 0 else 0 for i in idx]
            total = sum(float(work.tokens) * w * self.profile.dtype_bytes for w in widths)
        else:
            total = sum(max(evaluate(layers[i].activation_bytes, work), 0.0) for i in idx)
        return total / self._split(module)

    def model_flops(self, work: MicrobatchWork) -> float:
        total = 0.0
        for module, w in work.items():
            if module not in self.profile.layers:
                continue
            for i, layer in enumerate(self.profile.layers[module]):
                if layer.kind == "embedding":
                    continue
                per_pass = 2.0 * layer.params * w.tokens
                total += per_pass
                total += per_pass * (self._needs_input[module][i] + self._trainable[module][i])
        return total

    def peak_flops_per_rank(self) -> float:
        return self.profile.matmul_flops_per_s



def _check_arch(profile: Profile, arch: ModelArch) -> None:
    """A `ModelArch` has no parameter shapes: compare modules, layer names and parameter counts."""
    where = f"profile file {profile.path!r}" if profile.path else "the profile"
    for m in list(profile.layers) + [m for m in arch.modules if m not in profile.layers]:
        if m not in arch.modules or m not in profile.layers:
            side = "profile" if m in profile.layers else "architecture"
            raise ProfileError(f"{where} does not fit this architecture: module {m!r} is only in the {side}; "
                               f"re-run `loom profile` on this model")
        ours, theirs = profile.layers[m], arch.modules[m].layers
        for a, b in zip(ours, theirs):
            if a.name != b.name or a.params != b.params:
                raise ProfileError(f"{where} does not fit this architecture: module {m!r} layer {a.name!r} "
                                   f"({a.params} parameters) is {b.name!r} ({b.params} parameters) there; "
                                   f"re-run `loom profile` on this model")
        if len(ours) != len(theirs):
            raise ProfileError(f"{where} does not fit this architecture: module {m!r} has {len(ours)} layers in "
                               f"the profile, {len(theirs)} there; re-run `loom profile` on this model")


def _input_needs(profile: Profile, trainable: dict[str, list[bool]]) -> dict[str, list[bool]]:
    """Per layer, whether its backward computes the input-gradient part: the rule of
    `loom.cost.frozen`, applied to the profile's layer kinds and these flags."""
    reads_data = {m: [l.kind in INPUT_KINDS for l in ls] for m, ls in profile.layers.items()}
    needs = needs_from_flags({m: trainable[m] for m in profile.layers}, reads_data)
    return {m: [n.input for n in ns] for m, ns in needs.items()}
