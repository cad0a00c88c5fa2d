"""From a `TrainConfig` to the objects a run needs: tokenizer, dataset, model, token counts.

`build_model` constructs on the meta device; every layer then gets values from a seed derived
from (run seed, module, layer index) when it is materialised (`loom.model.materialise`), so a
rank that materialises only its stage (``device="meta"``, then `ParallelEngine.create`) holds
the same values as the single-process reference built with ``device="cpu"``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from loom.data.collate import MODALITY_KINDS, GenerationSpec, TokenCounter, target_count
from loom.data.collate import encoder_modality as encoder_modality_of_name
from loom.data.demo import DemoDataset
from loom.data.hf_tokenizer import HFTokenizer
from loom.data.llava import LlavaSource, RecordSource
from loom.data.media import DataError
from loom.data.webdataset import WebDatasetSource
from loom.data.sample import SampleMeta
from loom.data.tokenizer import GEN_IMAGE_MARKER, Tokenizer
from loom.cost.model import Workload
from loom.plan.plan import Plan
from loom.schedule.ir import Schedule
from loom.model.generator import ModalityGenerator
from loom.model.multimodal import ModalityEncoder, MultimodalModel
from loom.model.zoo import AudioEncoder, LlamaForCausalLM, VisionEncoder
from loom.model.zoo.diffusion import DiffusionGenerator
from loom.train.config import ConfigError, ModelConfig, TrainConfig, encoder_modality


def build_model(
    cfg: ModelConfig, tokenizer: Tokenizer, seed: int = 0, *, device: torch.device | str = "cpu"
) -> MultimodalModel:
    """The `MultimodalModel` described by ``cfg``: zoo modules, or Hugging Face ones where
    ``cfg.llm.hf`` / an encoder's ``hf`` is set (with their checkpoint's weights when the directory
    has safetensors), encoders by their table names, its layers initialised from
    ``seed`` (one derived seed per layer) on ``device``. ``device="meta"`` allocates nothing:
    a pipeline rank then materialises its own stage (`ParallelEngine.create`)."""
    hf_dir = getattr(cfg.llm, "hf", "")  # a zoo LlamaConfig (no hf field) is accepted too
    llm = _hf_llm(hf_dir, tokenizer) if hf_dir else None
    llm_cfg = cfg.llm
    if llm_cfg.vocab_size < tokenizer.vocab_size:
        llm_cfg = dataclasses.replace(llm_cfg, vocab_size=tokenizer.vocab_size)
    encoder_cfgs = cfg.encoder_configs()
    hf_encoders = {name: _hf_encoder_config(name, enc.hf) for name, enc in encoder_cfgs.items()
                   if getattr(enc, "hf", "")}
    with torch.device("meta"):
        encoders: dict[str, ModalityEncoder] = {}
        for name, enc in encoder_cfgs.items():  # any names; each consumes its table's modality
            modality = encoder_modality(enc)
            if name in hf_encoders:
                from loom.model.hf_encoders import encoder_from_config

                module = encoder_from_config(hf_encoders[name])
                before = _hf_processor(name, enc.hf, module, getattr(enc, "processor", ""))
            else:
                module, before = VisionEncoder(enc) if modality == "image" else AudioEncoder(enc), None
            encoders[name] = ModalityEncoder(module, projector=cfg.projector, modality=modality, before_encoder=before)
        generators: dict[str, ModalityGenerator] = {}
        if cfg.generator is not None:  # DistTrain's output projector + generator, the module "image"
            if not tokenizer.has(GEN_IMAGE_MARKER):
                raise ConfigError(f"model.generator: the tokenizer has no {GEN_IMAGE_MARKER} token; build it with "
                                  f"build_data(cfg), which adds it for a model with a generator")
            generators["image"] = ModalityGenerator(DiffusionGenerator(cfg.generator), projector=cfg.projector,
                                                    loss_weight=cfg.generator_loss_weight)
        model = MultimodalModel(
            encoders,
            llm if llm is not None else LlamaForCausalLM(llm_cfg),
            placeholder_ids=placeholder_ids(encoders, tokenizer),
            generators=generators,
            generation_ids={name: tokenizer.token_id(GEN_IMAGE_MARKER) for name in generators},
        )
    model.init_seed = seed
    if llm is not None:
        from loom.model.hf import safetensors_files
        from loom.model.weights import SafetensorsWeights

        files = safetensors_files(hf_dir)
        if files:  # pretrained: each rank reads only its stages' tensors when it materialises them
            tied = {"lm_head.weight": "model.embed_tokens.weight"} if llm.config.tie_word_embeddings else {}
            model.pretrained["llm"] = SafetensorsWeights(files, aliases=tied)
    for name in hf_encoders:  # an encoder directory's checkpoint: its layers read from it, per stage
        from loom.model.hf_encoders import encoder_weights

        weights = encoder_weights(encoder_cfgs[name].hf)
        if weights is not None:
            model.pretrained[name] = weights
    if cfg.freeze:
        try:
            model.freeze(*cfg.freeze)
        except ValueError as e:
            raise ConfigError(f"model.freeze: {e}") from e
    if torch.device(device).type != "meta":
        for name in model.module_names:
            model.materialise(name, device)
    return model


def _hf_llm(path: str, tokenizer: Tokenizer) -> torch.nn.Module:
    """The Hugging Face causal LM ``model.llm.hf`` names, on the meta device; its vocabulary must
    hold the tokenizer's ids."""
    from loom.model.hf import causal_lm_from_config, load_config

    try:
        config = load_config(path)
    except ValueError as e:
        raise ConfigError(f"model.llm.hf = {path!r}: {e}; point it at a local Hugging Face model directory "
                          "of a supported family, or remove it to use the zoo Llama") from e
    if config.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.llm.hf = {path!r}: its vocab_size ({config.vocab_size}) is smaller than the "
                          f"tokenizer's ({tokenizer.vocab_size} ids); use a model with at least "
                          f"{tokenizer.vocab_size} embeddings")
    return causal_lm_from_config(config)


def placeholder_ids(encoders: dict[str, ModalityEncoder], tokenizer: Tokenizer) -> dict[str, int]:
    """Each encoder's placeholder id: the first encoder of a modality takes its marker's id; a
    further one (a second vision tower, whose tokens follow the first's at every marker) an id
    past the tokenizer's vocabulary, which no text holds (the LLM never embeds placeholder ids:
    `MultimodalModel` masks them before its embedding)."""
    out: dict[str, int] = {}
    seen: set[str] = set()
    for name, enc in encoders.items():
        modality = enc.modality or encoder_modality_of_name(name)
        if modality in seen:
            out[name] = tokenizer.vocab_size + len(out) - len(seen)
        else:
            out[name] = tokenizer.token_id(MODALITY_KINDS[modality].marker)
            seen.add(modality)
    return out


def _hf_encoder_config(name: str, path: str):
    """The Hugging Face config ``model.<name>.hf`` names; a `ConfigError` naming the field otherwise."""
    from loom.model.hf_encoders import load_encoder_config

    try:
        return load_encoder_config(path)
    except ValueError as e:
        raise ConfigError(f"model.{name}.hf = {path!r}: {e}; point it at a local Hugging Face encoder directory "
                          "of a registered family, or remove it to use the zoo encoder") from e


def _hf_processor(name: str, path: str, encoder: torch.nn.Module, processor: str = ""):
    """The image processor or feature extractor of ``model.<name>.processor``, or by default the
    one saved beside ``model.<name>.hf``'s config (its ``preprocessor_config.json`` /
    ``processor_config.json``, as ``AutoProcessor`` finds it), bound to ``encoder``
    (`loom.data.hf_processor`): the encoder's ``before_encoder`` and its token count from
    metadata; None without one (or with ``processor = "none"``). A `ConfigError` naming the
    field when it cannot be read, does not fit the encoder, or the encoder cannot run without
    one (Whisper)."""
    from pathlib import Path

    from loom.data.hf_processor import has_processor, load_processor

    field = f"model.{name}.processor = {processor!r}" if processor else f"model.{name}.hf = {path!r}"
    where = Path(processor) if processor and processor != "none" else (
        Path(path) if Path(path).is_dir() else Path(path).parent)
    if processor == "none" or (not processor and not has_processor(where)):
        if getattr(encoder, "needs_processor", False):
            raise ConfigError(f"{field}: a {type(encoder).__name__} takes what its processor makes, and "
                              f"{'none is set' if processor else repr(str(where)) + ' has none'}; save its feature "
                              f"extractor or processor there (save_pretrained writes preprocessor_config.json) or "
                              f"set model.{name}.processor to its directory")
        return None
    try:
        return load_processor(where).for_encoder(encoder)
    except ValueError as e:
        raise ConfigError(f"{field}: {'' if processor else 'its processor: '}{e}") from e


def token_counters(model: MultimodalModel) -> dict[str, Callable]:
    """Per encoder, the function from an item's metadata to its number of tokens, with the
    modality of its items and its placeholder id (`loom.data.collate.TokenCounter`; an encoder
    without a modality the one its name implies)."""
    return {name: TokenCounter(enc.modality or encoder_modality_of_name(name), enc.num_tokens,
                               model.placeholder_ids.get(name))
            for name, enc in model.encoders.items()}


def generation_specs(model: MultimodalModel) -> dict[str, GenerationSpec]:
    """Per generator, what collation needs of it: LLM states per item and the target shape."""
    return {name: GenerationSpec(gen.cond_tokens, gen.target_shape) for name, gen in model.generators.items()}


def num_targets(meta: SampleMeta) -> int:
    """Target tokens of a sample from metadata alone (`loom.data.collate.target_count`)."""
    return target_count(meta)


def build_data(cfg: TrainConfig) -> tuple[Tokenizer | HFTokenizer, DemoDataset | RecordSource]:
    """The tokenizer (the demo's word tokenizer, or the Hugging Face one of ``data.tokenizer``;
    with the ``<gen_image>`` marker when the model has a generator) and the samples of
    ``data.source``: the demo dataset, a LLaVA-style JSON file or WebDataset shards (a
    `ConfigError` naming ``data.tokenizer`` / ``data.path`` when they cannot be read)."""
    extra = [GEN_IMAGE_MARKER] if cfg.model.generator is not None else []
    data = cfg.data
    if data.tokenizer:  # a Hugging Face tokenizer (loom.data.hf_tokenizer)
        try:
            tokenizer = HFTokenizer(data.tokenizer, extra_tokens=extra, chat=data.chat_template)
        except ValueError as e:
            raise ConfigError(f"data.tokenizer = {data.tokenizer!r}: {e}") from e
    else:
        tokenizer = Tokenizer(extra_tokens=extra)
    if data.source == "demo":
        return tokenizer, DemoDataset(data.demo, tokenizer=tokenizer)
    try:
        if data.source == "llava":
            return tokenizer, LlavaSource(data.path, tokenizer, root=data.root or None, chat=data.chat_template)
        return tokenizer, WebDatasetSource(data.path, tokenizer, chat=data.chat_template)
    except DataError as e:
        raise ConfigError(f"data.path = {data.path!r}: {e}") from e


def mean_workloads(cfg: TrainConfig, model: MultimodalModel, dataset: DemoDataset,
                   llm_batching: str = "padded") -> tuple[dict[str, Workload], dict[str, Workload]]:
    """The mean microbatch's and the mean sample's workload per module over the run's first
    (up to 4) global batches, from metadata only (`loom.cost.workload.sample_work`)."""
    from loom.cost.arch_from_model import arch_from_model
    from loom.cost.workload import sample_work
    from loom.data.collate import split_microbatches
    from loom.data.sampler import GlobalBatchSampler

    arch = arch_from_model(model)
    sampler = GlobalBatchSampler(len(dataset), cfg.data.global_batch_size, seed=cfg.run.seed)
    works, samples = [], 0
    for step in range(min(4, cfg.run.steps)):
        for part in split_microbatches(sampler.batch(step), cfg.plan.num_microbatches):
            works.append(sample_work(arch, [dataset.meta(i) for i in part], llm_batching=llm_batching))
            samples += len(part)

    def mean(over: int) -> dict[str, Workload]:
        return {m: Workload(*(round(sum(getattr(w[m], f) for w in works) / over)
                              for f in ("tokens", "attn_sq", "segments")))
                for m in model.module_names}

    return mean(len(works)), mean(samples)


def profiled_boundaries(cfg: TrainConfig, model: MultimodalModel, dataset: DemoDataset) -> None:
    """Fill the plan's unset stage boundaries with the frozen-aware partition (cornstarch.md
    §3.2.2, eq. 3.5) of per-layer costs from ``run.profile``, for the mean microbatch of the
    run's first global batches (from metadata only). Modules with explicit boundaries keep them."""
    from loom.cost.frozen import INPUT_KINDS
    from loom.planner.partition import frozen_aware_boundaries, frozen_aware_layer_costs

    profile = _profile(cfg, model)
    mean = mean_workloads(cfg, model, dataset)[0]
    per_layer = {phase: {m: [profile.module_time(m, phase, mean[m], i, i + 1) for i in range(len(profile.layers[m]))]
                         for m in model.module_names}
                 for phase in ("forward", "backward_input", "backward_weight")}
    trainable = {m: [any(p.requires_grad for p in l.module.parameters()) for l in model.module_layers(m)]
                 for m in model.module_names}
    reads_data = {m: [l.kind in INPUT_KINDS for l in model.module_layers(m)] for m in model.module_names}
    costs = frozen_aware_layer_costs(per_layer["forward"], per_layer["backward_input"], per_layer["backward_weight"],
                                     trainable, model.module_names, reads_data=reads_data)
    cfg.plan = frozen_aware_boundaries(cfg.plan, costs)


def _profile(cfg: TrainConfig, model: MultimodalModel):
    """``run.profile``, checked against ``model`` and ``run.dtype``; a `ConfigError` naming the field otherwise."""
    from loom.cost.profile_file import ProfileError, load_profile_for

    try:
        return load_profile_for(cfg.run.profile, model, cfg.run.dtype)  # the model's, timed under run.dtype
    except (OSError, ProfileError) as e:
        raise ConfigError(f"run.profile = {cfg.run.profile!r}: {e}") from e


def bubble_filler(cfg: TrainConfig, model: MultimodalModel, dataset: DemoDataset,
                  plan: Plan) -> Callable[[Schedule, Plan], Schedule]:
    """The schedule transform of ``plan.bubble_fill = "optimus"`` (`loom.sim.bubble_fill`) for
    `ParallelEngine.schedule_transform`: each iteration's colocated schedule with the encoders'
    work moved into the LLM's bubbles, decided as Optimus decides offline (optimus.md §2.2) on
    the mean microbatch of the run's first batches, timed by ``run.profile`` when set (`loom
    profile`) and otherwise by the analytic model (FLOPs on an H100: only the ratios of the
    durations steer the fill). The same on every rank: the same inputs, the same arithmetic."""
    from loom.cost.analytic import AnalyticCostModel
    from loom.cost.arch_from_model import arch_from_model
    from loom.cost.hardware import Cluster
    from loom.cost.memory import DTYPE_BYTES
    from loom.cost.profiled import ProfiledCostModel
    from loom.sim.bubble_fill import fill_bubbles

    batching = "packed" if cfg.data.pack_sequences else "padded"
    per_microbatch, per_sample = mean_workloads(cfg, model, dataset, batching)
    if cfg.run.profile:
        cost = ProfiledCostModel(_profile(cfg, model), model, plan)
    else:
        cost = AnalyticCostModel(arch_from_model(model), plan, Cluster("H100", max(8, plan.world_size)),
                                 dtype_bytes=DTYPE_BYTES[cfg.run.dtype])

    def fill(schedule: Schedule, run_plan: Plan) -> Schedule:
        work = [per_microbatch] * schedule.num_microbatches
        return fill_bubbles(schedule, run_plan, cost, work, [per_sample] * cfg.data.global_batch_size).schedule

    return fill
