"""Typed run configuration, loaded from TOML with command-line overrides.

Sections: ``[run]``, ``[model]`` (with ``[model.vision]``, ``[model.audio]``, ``[model.llm]``, an
optional ``[model.generator]`` and further encoders as ``[model.<name>]`` tables, see
`ModelConfig`),
``[data]`` (with ``[data.demo]``), ``[optim]``, ``[balance]`` (per-phase balancing policy and
microbatch order, see `loom.balance.policy.BalanceConfig`) and ``[plan]`` (see `loom.plan.plan.Plan`).
Every unknown key, wrong type or bad value raises `ConfigError` naming the dotted field and
what to do. Overrides are ``dotted.key=value`` with TOML values (``run.steps=10``,
``model.freeze=["vision.encoder"]``); plan modules are addressed by name
(``plan.modules.llm.num_stages=2``).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from loom.balance.config import BalanceConfig, BalanceError, check_balance_config
from loom.data.demo import DemoConfig
from loom.elastic.config import ElasticConfig
from loom.model.zoo import AudioConfig, LlamaConfig, VisionConfig
from loom.model.zoo.diffusion import DiffusionConfig
from loom.plan.overrides import ConfigError, build_dataclass, parse_override, set_dotted, typed_value
from loom.plan.plan import ModuleSpec, Plan, PlanError
from loom.runtime.tensor_parallel import check_tp_degree
from loom.runtime.context_parallel import check_context_parallel
from loom.runtime.zero import check_zero
from loom.train import scalars

DATA_SOURCES = ("demo", "llava", "webdataset")  # data.source

__all__ = ["ConfigError", "TrainConfig", "config_to_toml", "load_config", "parse_override", "typed_value"]


@dataclass
class RunConfig:
    name: str = "demo"
    out_dir: str = "runs"
    steps: int = 120
    seed: int = 0
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, one GPU per process)
    log_every: int = 10  # log-line interval when stdout is not a terminal
    profile: str = ""  # a `loom profile` JSON: unset stage boundaries then come from the frozen-aware partitioner
    # "fp32" or "bf16": bf16 compute and messages, fp32 master weights, gradients and optimizer
    # state (loom.runtime.precision)
    dtype: str = "fp32"
    # save a checkpoint (loom.train.checkpoint) every N steps, and always after the last step
    # and on SIGTERM; 0: only after the last step and on SIGTERM
    checkpoint_every: int = 0
    # the periodic saves in the background (DCP async_save: the step waits only for a CPU copy
    # of the state); the final and the SIGTERM save wait for it (loom.train.checkpoint)
    checkpoint_async: bool = False
    # rank 0 writes each metrics.jsonl row's numbers as TensorBoard scalars to
    # runs/<name>/tensorboard/ (loom.train.scalars; needs pip install tensorboard)
    tensorboard: bool = False
    # every N steps, and after the last, the mean token loss over the held-out split
    # (data.eval_samples), forward only, as eval_loss in metrics.jsonl and the log; 0: off
    eval_every: int = 0


@dataclass
class LLMConfig(LlamaConfig):
    """``[model.llm]``: the zoo Llama's fields, or ``hf`` naming a Hugging Face model (a local
    directory or its ``config.json``; `loom.model.hf.SUPPORTED_MODEL_TYPES`), built from its
    config and initialised from its ``*.safetensors`` when the directory has them (else from the
    run seed by the model's own init). With ``hf`` set the zoo fields are ignored."""

    hf: str = ""


@dataclass
class VisionEncoderConfig(VisionConfig):
    """``[model.<name>]`` of an image encoder: the zoo ViT's fields, or ``hf`` naming a Hugging
    Face encoder (a local directory or its ``config.json`` of a family in
    `loom.model.hf_encoders.HF_ENCODERS`), built from its config and initialised from the
    directory's ``*.safetensors`` when it has them (else from the run seed). With ``hf`` set the
    zoo fields must keep their defaults. ``modality``: the sample items and marker it consumes.
    ``processor`` (with ``hf``): the directory of the Hugging Face image processor / feature
    extractor that makes the encoder's inputs (`loom.data.hf_processor`); ``""``: the ``hf``
    directory's own when it has one; ``"none"``: none."""

    hf: str = ""
    modality: str = "image"
    processor: str = ""


@dataclass
class AudioEncoderConfig(AudioConfig):
    """``[model.<name>]`` of an audio encoder: the zoo's fields, or ``hf`` (as
    `VisionEncoderConfig`)."""

    hf: str = ""
    modality: str = "audio"
    processor: str = ""


# an encoder table's dataclass by the modality it consumes (loom.data.collate.MODALITY_KINDS)
ENCODER_CONFIGS: dict[str, type] = {"image": VisionEncoderConfig, "audio": AudioEncoderConfig}


def encoder_modality(config: Any) -> str:
    """The modality an encoder config consumes: its ``modality`` field, or its zoo class's (a
    plain `VisionConfig` / `AudioConfig` built from Python)."""
    modality = getattr(config, "modality", "")
    if modality:
        return modality
    return "image" if isinstance(config, VisionConfig) else "audio"


@dataclass
class ModelConfig:
    """``[model]``: encoders, the LLM, projectors, freezing and an optional generator.

    Encoders are ``[model.<name>]`` tables, any names: ``vision`` and ``audio`` are there by
    default (the zoo's; ``model.vision = "none"`` removes one), every other table (not a field
    below) is a further encoder, kept in `extra_encoders` in the file's order. A table's
    ``modality`` (``"image"`` or ``"audio"``) says which sample items and marker it consumes:
    ``vision`` and ``audio`` imply theirs, an ``hf`` encoder its family's, other tables must set
    it. Several encoders may consume one modality (a second vision tower): each encodes the same
    items, and each marker expands to every one's tokens, in this order."""

    vision: VisionEncoderConfig | None = field(default_factory=VisionEncoderConfig)
    audio: AudioEncoderConfig | None = field(default_factory=AudioEncoderConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    projector: str = "mlp"  # "linear" | "mlp" (the output projector of a generator too)
    freeze: list[str] = field(default_factory=list)  # parts: "vision", "vision.encoder", "llm", "image.projector", ...
    # an image generator after the LLM (DistTrain's output projector + generator), the module
    # "image": a tiny diffusion transformer conditioned on the LLM's states at <gen_image> tokens
    generator: DiffusionConfig | None = None
    generator_loss_weight: float = 1.0  # its denoising loss's weight beside the language-model loss
    # encoders of other names, from [model.<name>] tables (written back as such; see the class docstring)
    extra_encoders: dict[str, VisionEncoderConfig | AudioEncoderConfig] = field(default_factory=dict)

    def encoder_configs(self) -> dict[str, Any]:
        """Every encoder's config by name, in model order: vision, audio (unless none), then the
        further tables in the file's order."""
        fixed = {"vision": self.vision, "audio": self.audio}
        return {**{n: c for n, c in fixed.items() if c is not None}, **self.extra_encoders}


@dataclass
class DataConfig:
    global_batch_size: int = 16
    # LLM microbatches as one packed row (attention and positions restart per sample; no
    # padding) instead of one right-padded row per sample. Needs the zoo Llama.
    pack_sequences: bool = False
    # > 0: each step's batch is cut into contiguous microbatches of at most this many LLM tokens
    # (a longer sample alone), at least plan.num_microbatches of them, a multiple of the plan's
    # data-parallel round (`loom.schedule.layout.token_budget_sizes`); 0: plan.num_microbatches
    # microbatches of equal sample counts
    microbatch_tokens: int = 0
    # where samples come from: "demo" (generated, [data.demo]), "llava" (a LLaVA-style JSON or
    # JSON Lines file) or "webdataset" (tar shards); `loom data write-demo` writes the demo set in
    # both file formats (docs/data.md, "File formats")
    source: str = "demo"
    path: str = ""  # llava: the JSON file; webdataset: a .tar shard, a directory of them or a glob pattern
    root: str = ""  # llava: the directory media paths are relative to (default: the JSON file's)
    # a sample that fails to load (a missing or corrupt file, a bad record): "raise" stops the run
    # naming it; "skip" loads the next index in its place, logs it and counts it in metrics.jsonl
    on_error: str = "raise"
    # a local Hugging Face tokenizer directory (AutoTokenizer, local files only; markers it lacks
    # are added as special tokens, `loom.data.hf_tokenizer`); "": the demo's word tokenizer
    tokenizer: str = ""
    # render each LLaVA / WebDataset conversation with data.tokenizer's chat template and put the
    # loss on the assistant turns only (docs/data.md, "Chat templates")
    chat_template: bool = False
    # the held-out split run.eval_every evaluates: the dataset's last eval_samples indices, which
    # the training sampler never draws; a multiple of global_batch_size (it runs in global batches)
    eval_samples: int = 0
    demo: DemoConfig = field(default_factory=DemoConfig)


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio at the last step
    # gradient clipping by the global L2 norm over every module, stage and replica (as
    # torch.nn.utils.clip_grad_norm_ on the whole model); 0 turns it off, the default
    max_grad_norm: float = 0.0


def default_plan(encoders: tuple[str, ...] | list[str] = ("vision", "audio")) -> Plan:
    """The demo layout: the encoders in parallel on a rank each, LLM in 2 stages."""
    return Plan(
        modules=[*(ModuleSpec(name) for name in encoders), ModuleSpec("llm", num_stages=2)],
        num_microbatches=4,
        schedule="1f1b",
    )


def _encoder_names(data: dict[str, Any]) -> list[str]:
    """The encoders a raw config's [model] section describes, in model order (vision and audio
    unless set to none, then its further tables): the modules a plan it leaves out places."""
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    fixed = [n for n in ("vision", "audio") if not (isinstance(model.get(n), str) and model[n].lower() == "none")]
    return fixed + [k for k, v in model.items() if k not in fields and isinstance(v, dict)]


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    plan: Plan = field(default_factory=default_plan)
    balance: BalanceConfig = field(default_factory=BalanceConfig)  # per-phase policy, see loom.balance.policy
    # [elastic]: survive rank failures without a restart (loom.elastic, docs/elastic.md); None: off
    elastic: ElasticConfig | None = None

    def check(self) -> "TrainConfig":
        """Value checks that do not need the model (the plan is checked against it later, and
        what only a launch needs, such as a GPU, by `check_launch`). Every field is checked for
        range and choice; types were checked while building."""
        run, optim = self.run, self.optim
        _require(run.name.strip() != "" and run.name not in (".", "..") and "/" not in run.name
                 and "\\" not in run.name, "run.name", run.name,
                 "a run needs a plain directory name", "use letters, digits, '-' or '_', e.g. run.name=demo")
        _require(run.out_dir.strip() != "", "run.out_dir", run.out_dir, "runs need a directory",
                 'use a directory such as run.out_dir="runs"')
        _require(run.steps >= 1, "run.steps", run.steps, "must be at least 1", "train at least one step")
        _require(run.seed >= 0, "run.seed", run.seed, "must not be negative", "use 0 or a positive integer")
        _require(run.device in DEVICES, "run.device", run.device, "unknown device", "choose 'cpu' or 'cuda'")
        _require(run.dtype in DTYPES, "run.dtype", run.dtype, "unknown precision",
                 'choose "fp32" or "bf16" (bf16 compute with fp32 master weights)')
        _require(run.log_every >= 1, "run.log_every", run.log_every, "must be at least 1",
                 "log every N >= 1 steps, e.g. run.log_every=10")
        _require(run.checkpoint_every >= 0, "run.checkpoint_every", run.checkpoint_every, "must not be negative",
                 "use 0 (a checkpoint after the last step only) or a step interval such as 100")
        _require(not run.checkpoint_async or run.checkpoint_every > 0, "run.checkpoint_async", run.checkpoint_async,
                 "only the periodic saves (run.checkpoint_every) go to the background, and there are none",
                 "set run.checkpoint_every to a step interval such as 100, or run.checkpoint_async = false")
        _require(run.eval_every >= 0, "run.eval_every", run.eval_every, "must not be negative",
                 "use 0 (no evaluation) or a step interval such as 100")
        _require(self.data.eval_samples >= 0, "data.eval_samples", self.data.eval_samples, "must not be negative",
                 "use 0 (no held-out split) or a multiple of data.global_batch_size")
        _require(run.eval_every == 0 or self.data.eval_samples > 0, "run.eval_every", run.eval_every,
                 "evaluation needs a held-out split", "set data.eval_samples (a multiple of data.global_batch_size), "
                 "or run.eval_every = 0")
        _require(self.data.eval_samples == 0 or run.eval_every > 0, "data.eval_samples", self.data.eval_samples,
                 "a held-out split is only evaluated with run.eval_every > 0", "set run.eval_every, or "
                 "data.eval_samples = 0")
        _require(self.data.global_batch_size < 1 or self.data.eval_samples % self.data.global_batch_size == 0,
                 "data.eval_samples", self.data.eval_samples, f"the split is evaluated in global batches of "
                 f"data.global_batch_size = {self.data.global_batch_size}", "use a multiple of it")
        _require(self.model.projector in ("linear", "mlp"), "model.projector", self.model.projector,
                 "unknown projector", "choose 'linear' or 'mlp'")
        _require(all(isinstance(f, str) and f for f in self.model.freeze), "model.freeze", self.model.freeze,
                 "every entry must be a part name", 'e.g. model.freeze=["vision.encoder"]')
        gen = self.model.generator
        _require(gen is not None or self.data.demo.mix.get("generate", 0) == 0, "data.demo.mix.generate",
                 self.data.demo.mix.get("generate"), "generation requests need a model with an image generator",
                 "add a [model.generator] table, or set it to 0")
        modalities = self.check_encoders()
        if self.data.source == "demo":  # the demo's sample kinds need their encoders (files are checked as they load)
            for kind, modality in (("image", "image"), ("multi_image", "image"), ("image_audio", "image"),
                                   ("audio", "audio"), ("image_audio", "audio")):
                weight = self.data.demo.mix.get(kind, 0)
                default = "vision" if modality == "image" else "audio"
                _require(modality in modalities.values() or not weight, f"data.demo.mix.{kind}", weight,
                         f"these samples need the {modality} encoder, and the model has none (model.{default} = none "
                         f"removes the default one)", f"set data.demo.mix.{kind} to 0, keep [model.{default}] or add "
                         f'an encoder table with modality = "{modality}"')
        _require(math.isfinite(self.model.generator_loss_weight) and self.model.generator_loss_weight >= 0,
                 "model.generator_loss_weight", self.model.generator_loss_weight, "must not be negative",
                 "use a weight such as 1.0")
        _require(gen is None or not run.profile, "run.profile", run.profile, "loom profile does not time generator "
                 "layers yet, so a profile cannot cut a model with a generator", 'leave run.profile = ""')
        hf = [n for n, enc in self.model.encoder_configs().items() if getattr(enc, "hf", "")]
        _require(not hf or not run.profile, "run.profile", run.profile, f"loom profile does not time Hugging Face "
                 f"encoders yet (model.{hf[0] if hf else ''}.hf), so a profile cannot cut this model",
                 'leave run.profile = "" (the analytic cost model prices them)')
        if gen is not None and gen.image_size != self.data.demo.gen_image_size:
            raise ConfigError(f"model.generator.image_size = {gen.image_size} but data.demo.gen_image_size = "
                              f"{self.data.demo.gen_image_size}: the generator makes the images the demo asks for; "
                              f"set both to the same size")
        _require(self.data.global_batch_size >= 1, "data.global_batch_size", self.data.global_batch_size,
                 "must be at least 1", "use a positive number of samples per step")
        data = self.data
        _require(data.source in DATA_SOURCES, "data.source", data.source, "unknown source",
                 "choose 'demo', 'llava' (a LLaVA-style JSON file) or 'webdataset' (tar shards)")
        _require(data.source == "demo" or data.path.strip() != "", "data.path", data.path,
                 f"data.source = {data.source!r} reads files", "set data.path to the JSON file (llava) or the shards "
                 "(webdataset); `loom data write-demo --out DIR` writes both from the demo set")
        _require(data.source == "demo" or not (gen is not None or data.demo.mix.get("generate", 0)), "data.source",
                 data.source, "the file formats carry no generation targets", 'use data.source = "demo" with a '
                 "[model.generator]")
        _require(not data.chat_template or (data.tokenizer and data.source != "demo"), "data.chat_template", True,
                 "a chat template renders the conversations of data.source llava / webdataset with a Hugging Face "
                 "tokenizer", "set data.tokenizer to its directory and data.source to llava or webdataset, or "
                 "data.chat_template = false")
        _require(data.on_error in ("raise", "skip"), "data.on_error", data.on_error, "unknown choice",
                 "choose 'raise' (stop at a bad sample) or 'skip' (replace it by the next index, logged and counted)")
        _require(self.data.microbatch_tokens >= 0, "data.microbatch_tokens", self.data.microbatch_tokens,
                 "is a token budget per microbatch", "use 0 (plan.num_microbatches equal microbatches) or a positive "
                 "budget such as 4096")
        policies = set(self.balance.summary(self.plan.module_names).values())
        _require(self.data.microbatch_tokens == 0 or policies == {"none"}, "data.microbatch_tokens",
                 self.data.microbatch_tokens, f"a token budget cuts the batch under the 'none' policy only, and the "
                 f"balance section chooses {sorted(policies)}", 'set balance.default = "none" or data.microbatch_tokens = 0')
        _require(math.isfinite(optim.lr) and optim.lr > 0, "optim.lr", optim.lr, "must be positive",
                 "use a learning rate such as 3e-3")
        _require(math.isfinite(optim.weight_decay) and optim.weight_decay >= 0, "optim.weight_decay",
                 optim.weight_decay, "must not be negative", "use 0 for none")
        _require(optim.warmup_steps >= 0, "optim.warmup_steps", optim.warmup_steps, "must not be negative",
                 "use 0 for no warmup")
        _require(math.isfinite(optim.min_lr_ratio) and 0 <= optim.min_lr_ratio <= 1, "optim.min_lr_ratio",
                 optim.min_lr_ratio, "is a fraction of the peak learning rate", "use a value from 0 to 1")
        _require(math.isfinite(optim.max_grad_norm) and optim.max_grad_norm >= 0, "optim.max_grad_norm",
                 optim.max_grad_norm, "is a gradient-norm threshold", "use 0 for no clipping or a positive "
                 "norm such as 1.0")
        if self.data.global_batch_size < self.plan.num_microbatches:
            raise ConfigError(
                f"data.global_batch_size = {self.data.global_batch_size} is smaller than "
                f"plan.num_microbatches = {self.plan.num_microbatches}: every microbatch needs a sample; "
                f"raise the batch size or lower the microbatch count"
            )
        for name, enc in self.model.encoder_configs().items():  # zoo ViTs patchify the demo's images as they are
            if modalities[name] == "image" and not getattr(enc, "hf", "") and self.data.demo.patch_size % enc.patch_size:
                raise ConfigError(
                    f"model.{name}.patch_size = {enc.patch_size}: the demo images' sides are multiples of "
                    f"data.demo.patch_size = {self.data.demo.patch_size}, which this patch size does not divide; "
                    f"set both to the same value"
                )
        encoders = list(modalities)
        names = encoders + ["llm"] + (["image"] if gen is not None else [])
        for m in self.plan.modules:
            if m.name not in names:
                raise ConfigError(
                    f"plan.modules[{m.name!r}]: unknown module name; the model has {names}: name one "
                    f"of them (an encoder set to none in [model] has no module to place; the generator is "
                    f"'image', with a [model.generator] table)"
                )
        shapes = {"llm": self.hf_llm_config() or self.model.llm, **self.model.encoder_configs()}
        for m in self.plan.modules:  # TP degrees against heads and widths (loom.runtime.tensor_parallel)
            if m.name in encoders and getattr(shapes[m.name], "hf", ""):
                _require(not isinstance(m.tensor_parallel, int) or m.tensor_parallel <= 1,
                         f"plan.modules[{m.name!r}].tensor_parallel", m.tensor_parallel,
                         f"model.{m.name}.hf is a Hugging Face encoder, which loom has no TP plan for",
                         "set it to 1 (data parallelism and pipeline stages work)")
                continue
            if isinstance(m.tensor_parallel, int) and m.tensor_parallel > 1 and shapes.get(m.name) is not None:
                try:
                    check_tp_degree(m.name, m.tensor_parallel, shapes[m.name])
                except PlanError as e:
                    raise ConfigError(str(e)) from e
        try:
            self.balance.check(self.plan.module_names)
        except BalanceError as e:
            raise ConfigError(str(e)) from e
        if self.elastic is not None:  # what the elastic runtime cannot honour (loom.elastic.config)
            self.elastic.check(self)
        return self

    def check_encoders(self) -> dict[str, str]:
        """Every encoder table's name, ``modality`` and ``hf`` config: returns the modality of
        each encoder by name (several may share one: each marker then expands to every one's
        tokens, in this order); a `ConfigError` naming the field otherwise."""
        gen = self.model.generator
        modalities: dict[str, str] = {}
        for name, enc in self.model.encoder_configs().items():
            reserved = ("llm",) + (("image",) if gen is not None else ())
            _require(name not in reserved and name.replace("_", "").replace("-", "").isalnum(), f"model.{name}",
                     "table", "an encoder needs a name of letters, digits, '-' or '_', other than 'llm' (the language "
                     "model) and, with a [model.generator], 'image'", "rename the table, e.g. [model.eye]")
            modality = encoder_modality(enc)
            _require(modality in ENCODER_CONFIGS, f"model.{name}.modality", modality, "unknown modality",
                     'choose "image" or "audio"')
            implied = {"vision": "image", "audio": "audio"}.get(name)
            _require(implied is None or modality == implied, f"model.{name}.modality", modality,
                     f"[model.{name}] is the default {implied} encoder's table", f'use another table name for an '
                     f'encoder of {modality}s, e.g. [model.{modality}_encoder], and set model.{name} = "none"')
            if getattr(enc, "hf", ""):
                family = hf_encoder_family(name, enc.hf)
                _require(family.modality == modality, f"model.{name}.hf", enc.hf, f"a {family.title} encoder "
                         f"consumes {family.modality}s, but model.{name}.modality is {modality!r}",
                         f'set model.{name}.modality = "{family.modality}"' + ("" if implied is None else
                         f' in another table than [model.{name}] (e.g. [model.{family.modality}_encoder])'))
                zoo = ENCODER_CONFIGS[modality]()
                changed = [f.name for f in dataclasses.fields(VisionConfig if modality == "image" else AudioConfig)
                           if getattr(enc, f.name) != getattr(zoo, f.name)]
                _require(not changed, f"model.{name}.{changed[0] if changed else ''}",
                         getattr(enc, changed[0]) if changed else None, f"model.{name}.hf builds the encoder from "
                         "its Hugging Face config, which fixes the shapes", f"remove model.{name}.{{{', '.join(changed)}}} "
                         "or the hf field")
            _require(not getattr(enc, "processor", "") or getattr(enc, "hf", ""), f"model.{name}.processor",
                     getattr(enc, "processor", ""), "a Hugging Face processor makes a Hugging Face encoder's inputs",
                     f"set model.{name}.hf too, or remove model.{name}.processor")
            modalities[name] = modality  # several per modality: each marker expands to every one's tokens
        return modalities

    def hf_llm_config(self) -> Any:
        """The Hugging Face config ``model.llm.hf`` names (None when unset); a one-line
        `ConfigError` naming the field when it is missing or not a supported causal LM."""
        path = getattr(self.model.llm, "hf", "")  # a zoo LlamaConfig (no hf field) is accepted too
        if not path:
            return None
        from loom.model.hf import load_config

        try:
            config = load_config(path)
        except ImportError as e:
            raise ConfigError(f"model.llm.hf = {path!r}: needs transformers ({e}); pip install transformers") from e
        except ValueError as e:
            raise ConfigError(f"model.llm.hf = {path!r}: {e}; point it at a local Hugging Face model directory "
                              "of a supported family, or remove it to use the zoo Llama") from e
        _require(not self.data.pack_sequences, "data.pack_sequences", True, "packed rows need the zoo Llama's "
                 "per-sample attention, and model.llm.hf runs the model's own", "set data.pack_sequences = false")
        llm = next((m for m in self.plan.modules if m.name == "llm"), None)
        if getattr(config, "tie_word_embeddings", False) and llm is not None and llm.num_stages > 1:
            for name in ("tensor_parallel", "context_parallel", "zero_stage"):  # loom.runtime.tied's limits
                value = getattr(llm, name)
                _require(not isinstance(value, int) or value <= (0 if name == "zero_stage" else 1),
                         f"plan.modules.llm.{name}", value, "model.llm.hf ties its embeddings (tie_word_embeddings), "
                         "and loom sums tied copies across pipeline stages without it yet",
                         f"set {name} = {0 if name == 'zero_stage' else 1}, or use one LLM stage")
        return config

    def check_launch(self, ranks_per_launch_node: int | None = None) -> "TrainConfig":
        """What a launch needs beyond valid values, checked by `loom train` (``--dry-run``
        included) before any process starts: the device exists here, the runtime executes
        every plan feature, and ``balance.ranks_per_node`` describes the nodes
        (`check_ranks_per_node`; ``ranks_per_launch_node``: the processes per node of the launch,
        when known). Call after ``plan.resolve``."""
        self.check_ranks_per_node(self.plan.world_size, ranks_per_launch_node)
        if self.run.tensorboard and not scalars.tensorboard_installed():
            raise ConfigError("run.tensorboard = true: needs the tensorboard package, which is not installed; "
                              "pip install tensorboard (or loom[tensorboard]), or set run.tensorboard = false")
        if self.run.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError('run.device = "cuda": this machine has no usable CUDA device; '
                                  'use run.device="cpu" or run on a GPU machine')
            if torch.cuda.device_count() < self.plan.world_size:
                raise ConfigError(
                    f'run.device = "cuda": the plan needs {self.plan.world_size} GPUs (one per process) but this '
                    f"machine has {torch.cuda.device_count()}; shrink the plan or launch on several nodes with torchrun"
                )
            if self.run.dtype == "bf16" and not torch.cuda.is_bf16_supported():
                raise ConfigError('run.dtype = "bf16": this CUDA device has no bf16 support '
                                  '(torch.cuda.is_bf16_supported() is False); use run.dtype="fp32" or an Ampere or '
                                  'newer GPU')
        try:  # the balancing policies' refusals (equal degrees, divisible batches, rounds)
            check_balance_config(self.balance, self.plan, self.data.global_batch_size)
        except BalanceError as e:
            raise ConfigError(str(e)) from e
        for m in self.plan.modules:
            try:  # context parallelism and ZeRO the runtime can execute (loom.runtime.context_parallel, .zero)
                check_context_parallel(m)
                check_zero(m)
            except PlanError as e:
                raise ConfigError(str(e)) from e
        return self

    def check_ranks_per_node(self, world_size: int, local_world_size: int | None = None) -> None:
        """``balance.ranks_per_node`` against the launch (orchmllm.md §3.10: node-wise
        rearrangement places rank r on node r // ranks_per_node, as torchrun does): 1 turns
        rearrangement off; above 1 it must divide ``world_size`` (homogeneous nodes) and, where
        the launch's processes per node are known (torchrun's ``LOCAL_WORLD_SIZE``; ``loom train``
        starts every rank on this machine), equal them, or rearrangement would price and permute
        for nodes the run does not have."""
        per_node = self.balance.ranks_per_node
        if per_node == 1:
            return
        if world_size % per_node:
            raise ConfigError(
                f"balance.ranks_per_node = {per_node} does not divide the plan's {world_size} ranks; set it to the "
                f"processes per node of the launch (a divisor of {world_size}), or 1 to turn node-wise "
                f"rearrangement off")
        if local_world_size is not None and per_node != local_world_size:
            raise ConfigError(
                f"balance.ranks_per_node = {per_node}, but the launch runs {local_world_size} processes per node "
                f"(torchrun's --nproc-per-node); set balance.ranks_per_node={local_world_size} or 1 (off), or "
                f"launch {per_node} processes per node on {world_size // per_node} nodes with torchrun")


def hf_encoder_family(name: str, path: str) -> Any:
    """The registered family (`loom.model.hf_encoders.HFEncoderFamily`) of ``model.<name>.hf =
    path``; a one-line `ConfigError` naming the field when it cannot be read or is not registered."""
    from loom.model.hf_encoders import encoder_family, load_encoder_config

    try:
        return encoder_family(load_encoder_config(path))
    except ImportError as e:
        raise ConfigError(f"model.{name}.hf = {path!r}: needs transformers ({e}); pip install transformers") from e
    except ValueError as e:
        raise ConfigError(f"model.{name}.hf = {path!r}: {e}; point it at a local Hugging Face encoder directory "
                          "of a registered family, or remove it to use the zoo encoder") from e


DEVICES = ("cpu", "cuda")
DTYPES = ("fp32", "bf16")  # run.dtype (loom.runtime.precision.DTYPES)


def _shown(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def _require(ok: bool, field_name: str, value: Any, why: str, fix: str) -> None:
    """Raise the one-line `ConfigError` ``<field> = <value>: <why>; <fix>`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{field_name} = {_shown(value)}: {why}; {fix}")


# Model shapes: every integer field is a size or count (at least 1), every float a positive
# scale. Checked before the zoo configs' own __post_init__, which would divide by zero.
def _check_shape(cls: type, where: str, kwargs: dict[str, Any]) -> None:
    if not issubclass(cls, (VisionConfig, AudioConfig, LlamaConfig)):  # LLMConfig too
        return
    for k, v in kwargs.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, int):
            _require(v >= 1, f"{where}.{k}", v, "a size or count must be at least 1", "use a positive integer")
        elif isinstance(v, float):
            _require(math.isfinite(v) and v > 0, f"{where}.{k}", v, "must be a positive number",
                     "use a positive value")


# ---- loading ---------------------------------------------------------------------------------
def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a TOML file (or start from the defaults), apply overrides, build and check."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass --config with a TOML file (see configs/)")
        try:
            with open(p, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is unreadable (not UTF-8 text): {e}") from e
    for item in overrides or []:
        _apply_override(data, item)
    plan_data = data.pop("plan", None)
    encoders = _encoder_names(data)
    extra = _extra_encoder_tables(data)
    cfg = build_dataclass(TrainConfig, data, "", _check_shape)
    cfg.model.extra_encoders = {name: _build_encoder(name, table) for name, table in extra.items()}
    if isinstance(plan_data, str) and plan_data.startswith("@"):  # plan = "@file": a plan file (loom plan --search)
        try:
            cfg.plan = Plan.read_file(plan_data[1:], field="plan")
        except PlanError as e:
            raise ConfigError(str(e)) from e
        _check_plan_types(cfg.plan)
    elif plan_data is None:  # the default layout of the model's encoders
        cfg.plan = default_plan(encoders)
    else:
        if not isinstance(plan_data, dict):
            raise ConfigError(f"plan = {plan_data!r}: must be a table ([plan] with [[plan.modules]] entries) or "
                              f'"@path" of a plan file')
        if "modules" not in plan_data:  # [plan] fields without modules: the default layout's modules
            plan_data = {**plan_data, "modules": [m_as_dict(m) for m in default_plan(encoders).modules]}
        try:
            cfg.plan = Plan.from_dict(plan_data)
        except (PlanError, TypeError) as e:
            raise ConfigError(str(e)) from e
        _check_plan_types(cfg.plan)
    return cfg.check()


def _extra_encoder_tables(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``[model.<name>]`` tables that are not `ModelConfig` fields (further encoders), taken
    out of ``data`` in the file's order; one set to ``"none"`` is dropped (an override removes it)."""
    model = data.get("model")
    if not isinstance(model, dict):
        return {}
    if "extra_encoders" in model:
        raise ConfigError("model.extra_encoders: write each further encoder as its own [model.<name>] table")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    out = {}
    for name in [k for k in model if k not in fields]:
        value = model[name]
        if isinstance(value, str) and value.lower() == "none":
            del model[name]
        elif isinstance(value, dict):
            out[name] = model.pop(name)
    return out  # anything else stays, for build_dataclass's unknown-field error


def _build_encoder(name: str, table: dict[str, Any]) -> Any:
    """A further encoder's config, its dataclass chosen by ``modality`` (or by its ``hf``
    family's when unset)."""
    modality = table.get("modality", "")
    if not modality and table.get("hf"):
        modality = hf_encoder_family(name, table["hf"]).modality
    _require(modality in ENCODER_CONFIGS, f"model.{name}.modality", modality or "",
             "an encoder table other than [model.vision] / [model.audio] must say which sample items it consumes"
             if not modality else "unknown modality",
             f'set model.{name}.modality = "image" or "audio" (or model.{name}.hf to a registered encoder)')
    return build_dataclass(ENCODER_CONFIGS[modality], {**table, "modality": modality}, f"model.{name}", _check_shape)


def _check_plan_types(plan: Plan) -> None:
    """Types of every plan field, so a wrong one is named here rather than failing as a raw
    TypeError inside `Plan.resolve` (which checks the ranges)."""
    for k, tp in (("num_microbatches", int), ("schedule", str), ("placement", str),
                  ("bubble_fill", str)):
        typed_value(tp, getattr(plan, k), f"plan.{k}")
    hints = typing.get_type_hints(ModuleSpec)
    for m in plan.modules:
        for f in dataclasses.fields(ModuleSpec):
            where = f"plan.modules[{m.name!r}].{f.name}"
            value = typed_value(hints[f.name], getattr(m, f.name), where)
            if f.name == "stage_boundaries" and value is not None:
                for b in value:
                    typed_value(int, b, where)


def _apply_override(data: dict[str, Any], item: str) -> None:
    parts, value = parse_override(item)
    plan = data.get("plan")
    if parts[0] == "plan" and len(parts) > 1 and isinstance(plan, str) and plan.startswith("@"):
        try:  # a field of a plan file's plan: read the file, then override it
            data["plan"] = Plan.read_file(plan[1:], field="plan").to_dict()
        except PlanError as e:
            raise ConfigError(str(e)) from e
    if parts[:2] == ["plan", "modules"] and len(parts) == 4:
        mods = data.setdefault("plan", {}).setdefault("modules", [m_as_dict(m) for m in
                                                                  default_plan(_encoder_names(data)).modules])
        for m in mods:
            if m.get("name") == parts[2]:
                m[parts[3]] = value
                if parts[3] == "num_stages":
                    m.pop("stage_boundaries", None)  # a new stage count takes the default split
                return
        raise ConfigError(f"override {item!r}: plan.modules has no module {parts[2]!r}; address one of "
                          f"{[m.get('name') for m in mods]} (or set plan.modules=[...] as a whole)")
    set_dotted(data, parts, value, item)


def m_as_dict(m: ModuleSpec) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(m).items() if v is not None}


def config_to_toml(cfg: TrainConfig) -> str:
    """The resolved configuration as TOML (written to the run directory), by ``tomli_w``:
    `load_config` reads it back to an equal `TrainConfig`. TOML has no null, so a None field
    (an encoder or generator turned off) is written as ``"none"``, which loading reads as None."""
    data: dict[str, Any] = {s: _toml_data(getattr(cfg, s)) for s in ("run", "model", "data", "optim", "balance")}
    if cfg.elastic is not None:
        data["elastic"] = _toml_data(cfg.elastic)
    data["model"].update(data["model"].pop("extra_encoders"))  # as the [model.<name>] tables they came from
    data["plan"] = cfg.plan.to_toml_table()
    return tomli_w.dumps(data)


def _toml_data(v: Any) -> Any:
    """A config value as TOML data: dataclasses as tables, None as ``"none"``, tuples as lists."""
    if dataclasses.is_dataclass(v):
        return {f.name: _toml_data(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if v is None:
        return "none"
    if isinstance(v, dict):
        return {str(k): _toml_data(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_toml_data(x) for x in v]
    return v
