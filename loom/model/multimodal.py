"""`ModalityEncoder` and `MultimodalModel`: the model tree and its single-process reference
semantics (cornstarch.md §2.2 call order, §2.4 merge, §3.1 modality parallelism).

A `MultimodalModel` holds named encoders (each an encoder + projector with callbacks) and an
LLM. Run in one process it *is* the reference: a parallel run must produce the same loss and
gradients on the same global batch (docs/architecture.md principle 1). For parallel runs every module is
also exposed as a flat list of layers (`module_layers`) with a context builder
(`module_context`), so a pipeline stage is a slice of that list.

Call order per encoder (Cornstarch Listing 5):
``before_encoder(inputs) -> encoder -> after_encoder(inputs, out) -> projector ->
after_projector(inputs, out)``, then the LLM's first layer embeds the text with placeholders
masked and scatters each encoder's projected tokens into its placeholder positions.

Construction may happen on the meta device (`loom.train.build.build_model` does): then
`MultimodalModel.materialise` gives layers memory, each from its own seed
(`loom.model.materialise`), so a pipeline rank allocates only its stage and every layer has
the same values wherever it is built.

Generators (`loom.model.generator.ModalityGenerator`, DistTrain's output projector and
generator, disttrain.md §1) come after the LLM: its final hidden states at each generator's
generation positions (``generation_ids``) condition the generator, whose loss adds to the
language-model loss (`MultimodalModel.loss`).

Freezing is ``requires_grad`` and nothing else (docs/architecture.md principle 3), set through
`MultimodalModel.freeze` / `unfreeze` on parts named ``"vision"``, ``"vision.encoder"``,
``"vision.projector"``, ``"llm"``, and a generator's ``"<name>"``, ``"<name>.generator"``,
``"<name>.projector"``.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from loom.model.adapter import adapter_for
from loom.model.generator import ModalityGenerator
from loom.model.layers import Layer, prefixed, run_layers
from loom.model.projector import make_projector, projector_kind, width_of
from loom.model.materialise import (LayerInit, SeededInit, Tie, check_untied, find_ties, is_meta, materialise,
                                    materialise_module, reset_buffers, reset_parameters)
from loom.model.weights import PretrainedInit, SafetensorsWeights

if TYPE_CHECKING:  # loom.model sits above loom.data (docs/architecture.md layers): types only
    from loom.data.sample import AudioMeta, Batch, ImageMeta

IGNORE_INDEX = -100

BeforeEncoder = Callable[[dict[str, Any]], dict[str, Any]]
AfterModule = Callable[[dict[str, Any], torch.Tensor], torch.Tensor]


class ModalityEncoder(nn.Module):
    """An encoder, its projector into the LLM's embedding space, and Cornstarch's callbacks.

    ``projector`` may be ``"linear"`` / ``"mlp"`` (built by `MultimodalModel` once the LLM's
    width is known) or a ready module. The encoder must have a layer adapter
    (`loom.model.layers.adapter_for`) and a ``num_tokens(item_meta)`` method that gives the
    number of output tokens of one item from its metadata alone.
    """

    def __init__(
        self,
        encoder: nn.Module,
        projector: str | nn.Module = "linear",
        before_encoder: BeforeEncoder | None = None,
        after_encoder: AfterModule | None = None,
        after_projector: AfterModule | None = None,
        modality: str | None = None,
    ):
        super().__init__()
        self.encoder = encoder
        # the sample items it consumes ("image" / "audio", loom.data.collate.MODALITY_KINDS);
        # None: the one its name implies (vision, audio)
        self.modality = modality
        self._projector_kind = projector_kind(projector)
        if self._projector_kind is None:
            self.projector = projector
        self.before_encoder = before_encoder
        self.after_encoder = after_encoder
        self.after_projector = after_projector

    def build_projector(self, out_features: int) -> None:
        """Create the projector lazily, as Cornstarch does, once the LLM's width is known."""
        if self._projector_kind is not None:
            self.projector = make_projector(self._projector_kind, width_of(self.encoder), out_features)
            self._projector_kind = None

    def num_tokens(self, item: "ImageMeta | AudioMeta") -> int:
        # a before_encoder that resizes or pads items (a Hugging Face processor,
        # loom.data.hf_processor) says how many tokens the encoder makes of what it hands over
        counter = getattr(self.before_encoder, "num_tokens", None)
        return counter(item) if counter is not None else self.encoder.num_tokens(item)

    # ---- layer-list adapter --------------------------------------------------------------
    def layers(self) -> list[Layer]:
        if self._projector_kind is not None:
            raise RuntimeError("projector not built yet: wrap the encoder in a MultimodalModel first")
        encoder_layers = prefixed(adapter_for(self.encoder).layers(), "encoder")

        def project(x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
            inputs = ctx["inputs"]
            if self.after_encoder is not None:
                x = self.after_encoder(inputs, x)
            x = self.projector(x)
            if self.after_projector is not None:
                x = self.after_projector(inputs, x)
            return x

        return encoder_layers + [Layer("projector", self.projector, project, kind="projector")]

    def context(self, inputs: dict[str, Any]) -> dict[str, Any]:
        if self.before_encoder is not None:
            inputs = self.before_encoder(dict(inputs))
        ctx = adapter_for(self.encoder).context(inputs)
        ctx["inputs"] = inputs
        return ctx

    def forward(self, **inputs: Any) -> torch.Tensor:
        return run_layers(self.layers(), None, self.context(inputs))


class MultimodalModel(nn.Module):
    """Encoders feeding an LLM, and generators after it; runs standalone as the reference
    semantics.

    ``placeholder_ids[name]`` is the token id that marks encoder ``name``'s tokens in
    ``input_ids`` (the collated batch expands each item's marker to ``num_tokens`` copies);
    ``generation_ids[name]`` the token id of generator ``name``'s generation positions (each
    item to generate expands to ``cond_tokens`` of them; the LLM embeds them as tokens).
    """

    init_seed: int = 0  # run seed of per-layer initialisation (`materialise`); build_model sets it

    def __init__(self, encoders: dict[str, ModalityEncoder], llm: nn.Module, placeholder_ids: dict[str, int],
                 generators: dict[str, ModalityGenerator] | None = None,
                 generation_ids: dict[str, int] | None = None):
        super().__init__()
        generators = dict(generators or {})
        generation_ids = dict(generation_ids or {})
        if "llm" in encoders or "llm" in generators:
            raise ValueError("encoders and generators may not be named 'llm': that name is the language model's")
        shared = sorted(set(encoders) & set(generators))
        if shared:
            raise ValueError(f"{shared} name both an encoder and a generator: give every module its own name")
        missing = [n for n in encoders if n not in placeholder_ids]
        if missing:
            raise ValueError(f"placeholder_ids lacks {missing}: give each encoder its placeholder token id")
        missing = [n for n in generators if n not in generation_ids]
        if missing:
            raise ValueError(f"generation_ids lacks {missing}: give each generator its generation token id")
        self.encoders = nn.ModuleDict(encoders)
        self.llm = llm
        self.generators = nn.ModuleDict(generators)
        self.placeholder_ids = dict(placeholder_ids)
        # module name -> its checkpoint: layers materialise from it instead of a seed (the LLM, an
        # encoder's layers; projectors are seeded)
        self.pretrained: dict[str, SafetensorsWeights] = {}
        self.generation_ids = {n: generation_ids[n] for n in generators}
        llm_width = getattr(llm, "hidden_size", None) or llm.config.hidden_size
        for enc in self.encoders.values():
            enc.build_projector(llm_width)
        for gen in self.generators.values():
            gen.build_projector(llm_width)
        # tied input and output embeddings of the LLM (`materialise` keeps them equal; across
        # pipeline stages the runtime sums their gradients: loom.runtime.tied)
        # (found now, while the model is whole: materialising and staging allocate layers apart)
        try:
            self.ties: list[Tie] = find_ties("llm", self.module_layers("llm"))
        except TypeError:  # an LLM without a layer adapter: refused when its layers are asked for
            self.ties = []

    @property
    def module_names(self) -> list[str]:
        """Modules in graph order: encoders (as given), ``"llm"``, then generators (as given)."""
        return [*self.encoders.keys(), "llm", *self.generators.keys()]

    # ---- freezing ------------------------------------------------------------------------
    def _part(self, part: str) -> nn.Module:
        if part == "llm":
            return self.llm
        name, _, sub = part.partition(".")
        if name in self.generators:
            gen = self.generators[name]
            if sub == "":
                return gen
            if sub in ("generator", "projector"):
                return getattr(gen, sub)
            raise ValueError(f"unknown part {part!r}: after {name!r} use '.generator' or '.projector'")
        if name not in self.encoders:
            raise ValueError(f"unknown part {part!r}: parts are 'llm', '<encoder>[.encoder|.projector]' with encoders "
                             f"{list(self.encoders)}, or '<generator>[.generator|.projector]' with generators "
                             f"{list(self.generators)}")
        enc = self.encoders[name]
        if sub == "":
            return enc
        if sub in ("encoder", "projector"):
            return getattr(enc, sub)
        raise ValueError(f"unknown part {part!r}: after {name!r} use '.encoder' or '.projector'")

    def freeze(self, *parts: str) -> "MultimodalModel":
        """Freeze parts (``requires_grad=False``): their parameters get no gradient at all."""
        for p in parts:
            self._part(p).requires_grad_(False)
        return self

    def unfreeze(self, *parts: str) -> "MultimodalModel":
        for p in parts:
            self._part(p).requires_grad_(True)
        return self

    # ---- layer lists, per module -----------------------------------------------------------
    def module_layers(self, name: str) -> list[Layer]:
        """The ordered layers of module ``name``, named as in this model's ``named_parameters``.

        The LLM's first layer is its embedding followed by the merge of encoder tokens
        (Cornstarch's ``cb_before_llm``), so it takes ``x = {encoder name: tokens}``. With
        generators, its last layer returns ``{"logits": ..., "generate": {generator name:
        states}}``: besides the logits, the final hidden states (the head's input) at each
        generator's generation positions, ``[N_cond, hidden]`` in sample order.
        """
        if name in self.generators:
            layers = prefixed(self.generators[name].layers(), f"generators.{name}")
            project, cond = layers[0], self.generators[name].cond_tokens

            def check_and_project(x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
                if x.shape[0] != ctx["items"] * cond:
                    raise ValueError(
                        f"generator {name!r} got {x.shape[0]} LLM states at its generation positions but the batch "
                        f"has {ctx['items']} items x {cond} cond_tokens for it: each item to generate needs "
                        f"exactly {cond} generation tokens in its sample's text")
                return project(x, ctx)

            layers[0] = Layer(project.name, project.module, check_and_project, kind=project.kind)
            return layers
        if name != "llm":
            if name not in self.encoders:
                raise ValueError(f"unknown module {name!r}; modules are {self.module_names}")
            return prefixed(self.encoders[name].layers(), f"encoders.{name}")
        layers = prefixed(adapter_for(self.llm).layers(), "llm")
        embed = layers[0]

        def embed_and_merge(x: dict[str, torch.Tensor] | None, ctx: dict[str, Any]) -> torch.Tensor:
            return self.merge(embed(None, ctx), x or {}, ctx)

        layers[0] = Layer(embed.name, embed.module, embed_and_merge, kind="embedding")
        if self.generators:
            head = layers[-1]

            def head_and_select(x: torch.Tensor, ctx: dict[str, Any]) -> dict[str, Any]:
                masks = ctx["generation_masks"]
                # a runtime that holds a share of the sequence here (tensor parallelism's sequence
                # shard, context parallelism's tokens) gives the context the whole sequence's gather
                whole = ctx.get("gather_sequence", lambda t: t)(x)
                return {"logits": head(x, ctx), "generate": {g: whole[masks[g]] for g in self.generators}}

            layers[-1] = Layer(head.name, head.module, head_and_select, kind="head")
        return layers

    def layer_counts(self) -> dict[str, int]:
        return {n: len(self.module_layers(n)) for n in self.module_names}

    # ---- materialising (loom.model.materialise) -------------------------------------------
    def _root(self, name: str) -> nn.Module:
        if name == "llm":
            return self.llm
        if name in self.generators:
            return self.generators[name]
        if name not in self.encoders:
            raise ValueError(f"unknown module {name!r}; modules are {self.module_names}")
        return self.encoders[name]

    def _init_of(self, owner: Any, key: str, index: int) -> SeededInit:
        """``owner``'s init (its ``init_layer_weights`` / ``init_layer_buffers`` when it has them,
        else PyTorch's ``reset_parameters`` / modules' ``reset_buffers``) under a seed of
        (`init_seed`, ``key``, ``index``)."""
        return SeededInit(self.init_seed, key, index, getattr(owner, "init_layer_weights", reset_parameters),
                          getattr(owner, "init_layer_buffers", reset_buffers))

    def layer_init(self, name: str, index: int) -> LayerInit:
        """The seeded initialisation of layer ``index`` of module ``name`` by its model's own
        init (the LLM's or the encoder's adapter; a projector is a plain module), or, for an LLM
        with a checkpoint in `pretrained`, the layer's tensors read from it by name."""
        count = len(self.module_layers(name))
        if not 0 <= index < count:
            raise IndexError(f"module {name!r} has {count} layers; no layer {index}")
        if name == "llm":
            owner: Any = adapter_for(self.llm)
            if "llm" in self.pretrained:
                return PretrainedInit(self.pretrained["llm"], owner.layers()[index].name,
                                      getattr(owner, "init_layer_buffers", reset_buffers))
        elif name in self.generators:  # the projector, then the generator's layers
            owner = adapter_for(self.generators[name].generator) if index > 0 else None
        else:  # the encoder's layers (from its checkpoint, when it has one), then the projector
            owner = adapter_for(self.encoders[name].encoder) if index < count - 1 else None
            if owner is not None and name in self.pretrained:
                return PretrainedInit(self.pretrained[name], owner.layers()[index].name,
                                      getattr(owner, "init_layer_buffers", reset_buffers))
        return self._init_of(owner, name, index)

    def context_modules(self, name: str) -> dict[str, nn.Module]:
        """Submodules of module ``name`` outside its layers that hold tensors of their own (a
        Hugging Face LLM's ``rotary_emb``): ``context`` reads them, so every stage holds them."""
        inside = {id(m) for layer in self.module_layers(name) for m in layer.module.modules()}
        return {path: m for path, m in self._root(name).named_modules()
                if id(m) not in inside
                and (next(m.parameters(recurse=False), None) is not None or next(m.buffers(recurse=False), None) is not None)}

    def materialise(self, name: str, device: torch.device | str, start: int = 0, end: int | None = None) -> None:
        """Give layers ``[start, end)`` of module ``name``, and its context modules, memory on
        ``device``: layers still on the meta device are allocated and initialised one at a time
        (`layer_init`), layers that already hold values are moved. Nothing else is touched, so a
        pipeline rank never allocates another stage."""
        check_untied({n: self.module_layers(n) for n in self.module_names}, self.ties)
        layers = self.module_layers(name)
        end = len(layers) if end is None else end
        for index in range(start, end):
            layer = layers[index]
            if is_meta(layer.module):
                materialise(layer, device, self.layer_init(name, index))
                for tie in self.ties:  # a tie's second holder starts from the first's values
                    if tie.module == name and tie.second[0] == index:
                        self._copy_tied(tie, layers)
            else:
                layer.module.to(device)
        self._retie(name, layers)
        owner = adapter_for(self.llm) if name == "llm" else adapter_for(
            self.generators[name].generator if name in self.generators else self.encoders[name].encoder)
        for path, module in self.context_modules(name).items():
            if is_meta(module):  # no layer index: seeded by its path (derived buffers, in practice)
                materialise_module(module, device, self._init_of(owner, f"{name}/{path}", 0))
            else:
                module.to(device)

    def _copy_tied(self, tie: Tie, layers: list[Layer]) -> None:
        """Give the second holder of ``tie`` the first holder's values: read from it when this
        process holds it, else computed by the first layer's own init on a scratch copy (a
        pipeline stage that holds the head but not the embedding)."""
        (i, a), (j, b) = tie.first, tie.second
        source = layers[i].module.get_parameter(a)
        if source.is_meta:
            scratch = copy.deepcopy(layers[i].module)
            materialise_module(scratch, "cpu", self.layer_init(tie.module, i))
            source = scratch.get_parameter(a)
        with torch.no_grad():
            layers[j].module.get_parameter(b).copy_(source)

    def _retie(self, name: str, layers: list[Layer]) -> None:
        """Share one tensor again between a tie's two holders once both hold values on the same
        device here (materialising allocates each layer's parameters on its own)."""
        for tie in self.ties:
            (i, a), (j, b) = tie.first, tie.second
            if tie.module != name:
                continue
            first, second = layers[i].module.get_parameter(a), layers[j].module.get_parameter(b)
            if first is not second and not first.is_meta and not second.is_meta and first.device == second.device:
                owner, _, attr = b.rpartition(".")
                setattr(layers[j].module.get_submodule(owner) if owner else layers[j].module, attr, first)

    def module_context(self, name: str, batch: "Batch", context_parallel: Any = None) -> dict[str, Any]:
        """Everything module ``name``'s layers need from the microbatch besides the activation.

        ``context_parallel`` (the LLM only: the runtime's per-rank context, with ``tokens``, the
        rank's positions of the row, and ``attend``) cuts the LLM's inputs to the rank's tokens,
        placeholder masks included: the merge then takes the encoder tokens of those
        placeholders only (the runtime selects them, `loom.runtime.context_parallel`)."""
        if name in self.generators:
            inputs = getattr(batch, "generation_inputs", {}).get(name)
            if inputs is None:
                raise ValueError(f"batch.generation_inputs has no entry for generator {name!r}: collate with every "
                                 f"generator of the model ({list(self.generators)})")
            return self.generators[name].context({**inputs, "device": batch.input_ids.device})
        if name != "llm":
            enc = self.encoders[name]
            inputs = batch.modality_inputs.get(name)
            if inputs is None:
                raise ValueError(
                    f"batch.modality_inputs has no entry for encoder {name!r}: collate with a token "
                    f"count for every encoder of the model ({list(self.encoders)})"
                )
            # the device lets an encoder build its (empty) context when a microbatch has no items
            return enc.context({**inputs, "device": batch.input_ids.device})
        ids = batch.input_ids
        masks = {n: ids == pid for n, pid in self.placeholder_ids.items() if n in self.encoders}
        generation = {n: ids == gid for n, gid in self.generation_ids.items()}
        masked = ids.clone()
        for m in masks.values():
            masked[m] = 0  # placeholder ids need not exist in the LLM's vocabulary
        inputs = {"input_ids": masked}
        if getattr(batch, "segments", None) is not None:
            inputs["segments"] = batch.segments  # packed samples: the LLM keeps them apart
        if context_parallel is not None:
            adapter = adapter_for(self.llm)
            if not getattr(adapter, "supports_context_parallel", False):
                raise ValueError(f"{type(adapter).__name__} does not run context parallelism (its context() has no "
                                 f"'context_parallel' input); set plan.modules['llm'].context_parallel = 1")
            inputs["context_parallel"] = context_parallel
            tokens = context_parallel.tokens.to(ids.device)
            masks = {n: m[:, tokens] for n, m in masks.items()}
            # generation masks stay whole: the runtime gathers the whole sequence of final states
            # before selecting a generator's (its context's ``gather_sequence``)
        ctx = adapter_for(self.llm).context(inputs)
        ctx["placeholder_masks"] = masks
        ctx["generation_masks"] = generation
        return ctx

    def merge(self, embeds: torch.Tensor, features: dict[str, torch.Tensor], ctx: dict[str, Any]) -> torch.Tensor:
        """Scatter each encoder's projected tokens into its placeholder positions."""
        for name, mask in ctx["placeholder_masks"].items():
            feats = features.get(name)
            n_slots = int(mask.sum())
            n_feats = 0 if feats is None else feats.shape[0]
            if n_slots != n_feats:
                raise ValueError(
                    f"encoder {name!r} produced {n_feats} tokens but the batch has {n_slots} "
                    f"placeholder tokens for it: the sample's placeholder count does not match its "
                    f"encoder output (check the collation's token counts against the encoder's num_tokens)"
                )
            if n_feats:
                embeds = embeds.masked_scatter(mask.unsqueeze(-1), feats.to(embeds.dtype))
            elif feats is not None:
                # No tokens of this modality: keep the (empty) output in the graph, so its
                # encoder's trainable parameters get a zero gradient, as they do in a parallel
                # run where the microbatch is processed by the encoder's own ranks.
                embeds = embeds + feats.sum().to(embeds.dtype) * 0
        return embeds

    # ---- reference forward -----------------------------------------------------------------
    def encode(self, batch: "Batch") -> dict[str, torch.Tensor]:
        return {
            n: run_layers(self.module_layers(n), None, self.module_context(n, batch)) for n in self.encoders
        }

    def llm_outputs(self, batch: "Batch") -> Any:
        """The LLM's last layer's output on the whole batch (`module_layers`)."""
        features = self.encode(batch)
        return run_layers(self.module_layers("llm"), features, self.module_context("llm", batch))

    def forward(self, batch: "Batch") -> torch.Tensor:
        """Logits ``[B, L, vocab]`` of the whole batch in one process."""
        out = self.llm_outputs(batch)
        return out["logits"] if self.generators else out

    def generator_loss_sum(self, name: str, batch: "Batch", states: torch.Tensor) -> torch.Tensor:
        """Generator ``name``'s summed loss over the batch's items, conditioned on the LLM's
        ``states`` at its generation positions."""
        return run_layers(self.module_layers(name), states, self.module_context(name, batch))

    def loss(self, batch: "Batch", num_targets: int | None = None,
             num_generations: dict[str, int] | None = None) -> torch.Tensor:
        """Mean next-token loss, normalised by ``num_targets`` (the *global* batch's target
        count in parallel runs, so moving samples between ranks never changes the math), plus
        each generator's ``loss_weight`` times its mean loss per item, normalised by
        ``num_generations[name]`` (the global batch's items of that generator) likewise."""
        n = batch.num_targets if num_targets is None else num_targets
        out = self.llm_outputs(batch)
        if not self.generators:
            return loss_sum(out, batch.labels) / n
        total = loss_sum(out["logits"], batch.labels) / n
        for name, gen in self.generators.items():
            items = batch.num_generations(name) if num_generations is None else num_generations[name]
            total = total + gen.loss_weight * self.generator_loss_sum(name, batch, out["generate"][name]) / max(1, items)
        return total


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over positions whose label is not ``IGNORE_INDEX``."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten().to(logits.device), ignore_index=IGNORE_INDEX, reduction="sum"
    )
