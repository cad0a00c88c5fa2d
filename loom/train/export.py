"""``loom export RUN_DIR --hf OUT_DIR``: a run's checkpoint as a Hugging Face model directory.

The export reads the run's ``config.toml`` and one checkpoint (``checkpoints/latest``, or
``step_<N>``) in this process, without a process group: DCP reads the saved shards into whole
tensors (``no_dist=True``) through `loom.train.checkpoint.SafeReader`, so nothing is unpickled
beyond DCP's own metadata classes, and only the ``model.*`` keys are read (the optimizer state
and RNG states stay on disk). It writes into ``OUT_DIR``:

- ``model.safetensors`` and ``config.json`` (with ``generation_config.json`` copied from the
  source directory when it has one): the LLM, which ``AutoModelForCausalLM.from_pretrained``
  loads with no missing or unexpected keys. A Hugging Face LLM (``model.llm.hf``) keeps its own
  config and names (checkpoint key ``llm.<hf name>`` -> ``<hf name>``); a tied model writes the
  embedding only, as ``save_pretrained`` does. The zoo Llama is written as HF Llama: its
  parameter names are HF's already, its layout maps 1:1 (separate q/k/v/o projections without
  bias, SwiGLU gate/up/down, RMSNorm computed in fp32 then scaled, rotate-half RoPE over
  ``cat(freqs, freqs)``, untied head), and `zoo_llama_config` carries every field that changes
  the function. The weights are the checkpoint's fp32 master weights, and ``config.json`` says
  ``float32`` so that ``from_pretrained`` does not cast them.
- ``<name>/`` for each Hugging Face encoder (``[model.<name>] hf = DIR``): ``config.json`` (the
  encoder's own config: the vision config of a full SigLIP / CLIP / Qwen2-VL config, Whisper's
  whole config), ``model.safetensors`` and the processor files (``preprocessor_config.json``,
  ``processor_config.json``) copied from the encoder's processor source (``model.<name>.processor``,
  else the ``hf`` directory). The adapters wrap the unmodified model, so checkpoint key
  ``encoders.<name>.encoder.model.<hf name>`` -> ``<hf name>``, checked name for name and shape
  for shape against the class's state dict. Each loads with no missing or unexpected keys by the
  class the adapter wraps (`HF_ENCODER_CLASSES`): ``AutoModel`` for SigLIP and CLIP vision;
  ``Qwen2VisionTransformerPretrainedModel.from_pretrained`` (transformers has no Auto class for
  the Qwen2-VL vision config); ``WhisperEncoder.from_pretrained`` for Whisper (``AutoModel`` of a
  Whisper config is the encoder-decoder ``WhisperModel``, whose decoder loom never had, and
  ``WhisperForAudioClassification`` adds an untrained classifier: the bare encoder is the one
  class that loads exactly what was trained). What the adapter drops because loom never runs it:
  SigLIP's pooling head (the config is written with ``vision_use_head = false``, so the model has
  none) and CLIP's ``post_layernorm`` (it normalises the pooled class token only; written from the
  source's safetensors when the ``hf`` directory has them, else with LayerNorm's initial ones and
  zeros, and listed as ``untrained`` in ``loom_modules.json``).
- ``loom_modules.safetensors`` and ``loom_modules.json``: loom's own encoders, projectors and
  generators (zoo modules transformers cannot load) under their names in the whole model
  (``encoders.vision.encoder...``), and every encoder's projector (HF has no class for it:
  ``encoders.<name>.projector...``), described per module (kind, config, projector, tensor
  shapes; for a Hugging Face encoder also where it went: its directory, class and processor
  files); ``loom_config.toml`` is the run's config, from which `loom.train.build.build_model`
  rebuilds them.

Every refusal is an `ExportError` (a `ConfigError`: ``loom`` prints it as one line).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loom.train.checkpoint import (CHECKPOINTS, CheckpointMeta, SafeReader, check_compatible, expected_shapes,
                                   latest_checkpoint, step_dir)
from loom.train.config import ConfigError, TrainConfig, load_config

MODEL_PREFIX = "model."  # the checkpoint's model state (`Checkpointer` saves {"model": ..., "optim": ...})
LLM_PREFIX = "llm."
HF_WEIGHTS = "model.safetensors"
LOOM_WEIGHTS = "loom_modules.safetensors"
LOOM_INDEX = "loom_modules.json"
LOOM_CONFIG = "loom_config.toml"
FORMAT = 1


class ExportError(ConfigError):
    """A run that cannot be exported; the message names it and the fix."""


@dataclass
class ExportResult:
    """What `export_run` wrote."""

    out_dir: Path
    checkpoint: Path
    step: int
    llm: str  # "hf" (model.llm.hf) or "zoo" (the zoo Llama, written as HF Llama)
    model_type: str  # the exported config's model_type
    llm_tensors: int  # tensors in model.safetensors
    loom_modules: list[str] = field(default_factory=list)  # modules in loom_modules.safetensors
    hf_encoders: dict[str, str] = field(default_factory=dict)  # encoder name -> its HF class, in out_dir/<name>/


# ---- the run and its checkpoint ---------------------------------------------------------------
def run_config(run_dir: Path) -> TrainConfig:
    """The config ``loom train`` wrote into ``run_dir``."""
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory; pass runs/<name> of an earlier loom train")
    path = run_dir / "config.toml"
    if not path.is_file():
        raise ExportError(f"{run_dir}: no config.toml in it, so the model is unknown; pass the run directory "
                          f"loom train wrote (runs/<name>)")
    return load_config(path)


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """``checkpoints/step_<step>``, or the one ``checkpoints/latest`` names; refused when it is
    missing or incomplete (no ``meta.json``)."""
    saved = sorted((p.name for p in (run_dir / CHECKPOINTS).glob("step_*") if (p / "meta.json").is_file()),
                   key=lambda n: int(n.split("_")[1]) if n.split("_")[1].isdigit() else -1)
    if step is None:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None or not (ckpt / "meta.json").is_file():
            raise ExportError(f"{run_dir}: the run has no complete checkpoint (no {run_dir / CHECKPOINTS / 'latest'}, "
                              f"or it names an incomplete one); train it (loom train saves after the last step) or "
                              f"pass --step N of one of {saved or 'none'}")
        return ckpt
    ckpt = step_dir(run_dir, step)
    if not (ckpt / "meta.json").is_file():
        raise ExportError(f"--step {step}: {run_dir} has no complete checkpoint step_{step}; complete ones: "
                          f"{saved or 'none'}")
    return ckpt


def read_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of the DCP checkpoint ``ckpt``, whole (DTensor shards of any
    plan assembled), keyed by its FQN in the whole model (``llm.model.norm.weight``). In this
    process alone: no process group is used even when one exists."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = SafeReader(ckpt)
    metadata = reader.read_metadata()
    state: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    with warnings.catch_warnings():  # DCP warns that it loads in one process: what is asked for here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeReader(ckpt), no_dist=True)
    return {k[len(MODEL_PREFIX):]: v for k, v in state.items()}


# ---- the LLM as a Hugging Face model ----------------------------------------------------------
def zoo_llama_config(llm: Any, vocab_size: int) -> Any:
    """The ``transformers.LlamaConfig`` whose model computes what the zoo Llama of ``llm`` (a
    `loom.model.zoo.LlamaConfig`) computes: ``vocab_size`` is the checkpoint's (`build_model`
    grows the config's to the tokenizer's)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=llm.hidden_size, intermediate_size=llm.intermediate_size,
        num_hidden_layers=llm.num_layers, num_attention_heads=llm.num_heads, num_key_value_heads=llm.num_kv_heads,
        head_dim=llm.hidden_size // llm.num_heads, hidden_act="silu", rms_norm_eps=llm.norm_eps,
        rope_theta=llm.rope_theta, max_position_embeddings=llm.max_seq_len, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )


def _hf_tensors(config: Any, llm_state: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """``llm_state`` (HF names) as ``save_pretrained`` of ``config``'s model writes it: every
    name of the model's state dict, a tied parameter under its first name only. Refused when the
    checkpoint lacks a name, has one the model does not, or differs in a shape."""
    from loom.model.hf import causal_lm_from_config

    model = causal_lm_from_config(config)  # on meta: names and shapes only
    expected = model.state_dict()
    kept: dict[int, str] = {}  # a shared parameter -> its first name (the embedding before lm_head)
    for name, p in model.named_parameters(remove_duplicate=False):
        kept.setdefault(id(p), name)
    duplicates = {name: kept[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
                  if kept[id(p)] != name}
    missing = [n for n in expected if n not in llm_state and n not in duplicates]
    extra = [n for n in llm_state if n not in expected]
    if missing or extra:
        raise ExportError(f"{what}: the checkpoint's LLM does not map onto {type(model).__name__} (missing "
                          f"{missing[:3]}, unexpected {extra[:3]}); refusing to export a different model")
    out: dict[str, torch.Tensor] = {}
    for name, meta in expected.items():
        if name in duplicates:
            saved = llm_state.get(name)
            if saved is not None and not torch.equal(saved, llm_state[duplicates[name]]):
                raise ExportError(f"{what}: {name} is tied to {duplicates[name]} but the checkpoint holds different "
                                  f"values; refusing to export a different model")
            continue  # save_pretrained writes a tied weight once
        value = llm_state[name]
        if list(value.shape) != list(meta.shape):
            raise ExportError(f"{what}: {name} has shape {list(value.shape)} in the checkpoint and "
                              f"{list(meta.shape)} in {type(model).__name__}; refusing to export a different model")
        out[name] = value.contiguous()
    return out


def _llm_config(cfg: TrainConfig, state: dict[str, torch.Tensor]) -> tuple[Any, str]:
    """The HF config of the exported LLM, and whether it is the run's ``"hf"`` model or the ``"zoo"`` Llama."""
    hf_dir = cfg.model.llm.hf
    if hf_dir:
        from loom.model.hf import load_config as load_hf_config

        try:
            return load_hf_config(hf_dir), "hf"
        except ValueError as e:
            raise ExportError(f"model.llm.hf = {hf_dir!r}: {e}; the export takes the LLM's config from there: "
                              f"restore that directory") from e
    embed = state.get("llm.model.embed_tokens.weight")
    if embed is None:
        raise ExportError("the checkpoint's LLM has no llm.model.embed_tokens.weight: it is not the zoo Llama the "
                          "run's config names; export the run it was saved by")
    return zoo_llama_config(cfg.model.llm, embed.shape[0]), "zoo"


# ---- Hugging Face encoders as Hugging Face directories -----------------------------------------
# the adapter's wrapped class -> how a user loads the exported directory
HF_ENCODER_CLASSES = {
    "SiglipVisionModel": "transformers.AutoModel (SiglipVisionModel)",
    "CLIPVisionModel": "transformers.AutoModel (CLIPVisionModel)",
    "Qwen2VisionTransformerPretrainedModel":
        "transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel",
    "WhisperEncoder": "transformers.models.whisper.modeling_whisper.WhisperEncoder",
}


@dataclass
class HFEncoderExport:
    """One Hugging Face encoder, ready to write into ``out_dir/<name>/``."""

    name: str
    config: Any  # the HF config written as config.json
    cls: str  # the class whose state dict the tensors are
    tensors: dict[str, torch.Tensor]  # HF names
    untrained: dict[str, str]  # HF name -> where its values come from (the adapter dropped it)
    processor_files: list[Path]


def _encoder_prefix(name: str) -> str:
    return f"encoders.{name}.encoder.model."


def _hf_encoder(cfg: TrainConfig, name: str, enc_cfg: Any, state: dict[str, torch.Tensor]) -> HFEncoderExport:
    """The encoder ``[model.<name>] hf = ...`` of the run as its Hugging Face class's tensors:
    refused (naming the field) when its config is unreadable, or when the checkpoint does not map
    onto the class name for name and shape for shape."""
    import copy

    from loom.data.hf_processor import PROCESSOR_FILES
    from loom.model.hf_encoders import encoder_from_config, encoder_weights, load_encoder_config

    field = f"model.{name}.hf = {enc_cfg.hf!r}"
    try:
        source_config = load_encoder_config(enc_cfg.hf)
    except ValueError as e:
        raise ExportError(f"{field}: {e}; the export takes the encoder's config from there: restore that "
                          f"directory") from e
    with torch.device("meta"):
        adapted = encoder_from_config(source_config).model  # the class the adapter wraps, and its config
        config = copy.deepcopy(adapted.config)
        if getattr(config, "vision_use_head", False) and not getattr(adapted, "use_head", True):
            config.vision_use_head = False  # the adapter dropped SigLIP's pooling head: loom never trained it
        model = type(adapted)(config)
    cls = type(model).__name__
    prefix = _encoder_prefix(name)
    saved = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    expected = model.state_dict()
    dropped = set(expected) - set(adapted.state_dict())  # what the adapter removed (CLIP's post_layernorm)
    extra = [n for n in saved if n not in expected]
    missing = [n for n in expected if n not in saved and n not in dropped]
    if extra or missing:
        raise ExportError(f"{field}: the checkpoint's encoder {name} does not map onto {cls} (missing "
                          f"{missing[:3]}, unexpected {extra[:3]}); refusing to export a different model")
    source = encoder_weights(enc_cfg.hf)
    tensors: dict[str, torch.Tensor] = {}
    untrained: dict[str, str] = {}
    for hf_name, meta in expected.items():
        if hf_name in saved:
            value = saved[hf_name]
        else:  # a part loom's adapter dropped (CLIP's post_layernorm): the source's values, else its init
            where = source.key(f"model.{hf_name}") if source is not None else None
            if where is not None and where in source.source.where:
                value, untrained[hf_name] = source.tensor(f"model.{hf_name}").to(meta.dtype), "source"
            else:
                owner = model.get_submodule(hf_name.rsplit(".", 1)[0]) if "." in hf_name else model
                if not hasattr(owner, "reset_parameters"):
                    raise ExportError(f"{field}: the checkpoint's encoder {name} lacks {hf_name} of {cls}, and "
                                      f"neither {enc_cfg.hf!r} has it nor can it be initialised; refusing to "
                                      f"export a different model")
                fresh = copy.deepcopy(owner).to_empty(device="cpu")
                fresh.reset_parameters()
                value, untrained[hf_name] = fresh.state_dict()[hf_name.rsplit(".", 1)[-1]], "init"
        if list(value.shape) != list(meta.shape):
            raise ExportError(f"{field}: {hf_name} has shape {list(value.shape)} in the checkpoint and "
                              f"{list(meta.shape)} in {cls}; refusing to export a different model")
        tensors[hf_name] = value.contiguous()
    processor = getattr(enc_cfg, "processor", "")
    where = Path(processor) if processor and processor != "none" else (
        Path(enc_cfg.hf) if Path(enc_cfg.hf).is_dir() else Path(enc_cfg.hf).parent)
    files = [where / f for f in PROCESSOR_FILES if processor != "none" and (where / f).is_file()]
    config.architectures = [cls]
    config.dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.") if tensors else None
    return HFEncoderExport(name, config, cls, tensors, untrained, files)


def _write_hf_encoder(out_dir: Path, enc: HFEncoderExport) -> dict[str, Any]:
    """``out_dir/<name>/``: config.json, model.safetensors, the processor files; its description."""
    from safetensors.torch import save_file

    target = out_dir / enc.name
    target.mkdir()
    save_file(enc.tensors, str(target / HF_WEIGHTS), metadata={"format": "pt"})
    enc.config.save_pretrained(target)
    for f in enc.processor_files:
        shutil.copyfile(f, target / f.name)
    return {"directory": enc.name, "class": enc.cls, "load_with": HF_ENCODER_CLASSES.get(enc.cls, enc.cls),
            "model_type": enc.config.model_type, "tensors": len(enc.tensors), "untrained": enc.untrained,
            "processor_files": [f.name for f in enc.processor_files],
            "processor_source": str(enc.processor_files[0].parent) if enc.processor_files else None}


# ---- loom's own modules -----------------------------------------------------------------------
def _module_of(fqn: str) -> str:
    """``encoders.vision.encoder.blocks.0.w`` -> ``encoders.vision``."""
    return ".".join(fqn.split(".")[:2])


def _describe(cfg: TrainConfig, module: str, tensors: dict[str, torch.Tensor],
              hf: dict[str, Any] | None = None) -> dict[str, Any]:
    group, name = module.split(".", 1)
    if group == "encoders":
        config = cfg.model.encoder_configs().get(name)  # any name ([model.<name>])
        kind = "encoder"
        if hf is not None:  # the encoder went to its HF directory; its projector is here
            return {"kind": "hf_encoder", "name": name, "projector": cfg.model.projector,
                    "config": dataclasses.asdict(config), "hf": hf,
                    "tensors": {k: list(v.shape) for k, v in tensors.items()}}
    else:
        config, kind = cfg.model.generator, "generator"
    return {
        "kind": kind, "name": name, "projector": cfg.model.projector,
        "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None,
        "tensors": {k: list(v.shape) for k, v in tensors.items()},
    }


# ---- the export -------------------------------------------------------------------------------
def _claim_out_dir(out_dir: Path, run_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--hf {out_dir}: a file, not a directory; pass a new or empty directory")
    resolved, run = out_dir.resolve(), run_dir.resolve()
    if resolved == run or resolved in run.parents or run in resolved.parents:
        raise ExportError(f"--hf {out_dir}: it overlaps the run directory {run_dir}; export somewhere else")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise ExportError(f"--hf {out_dir}: the directory is not empty; pass a new or empty directory, or "
                              f"--overwrite to delete it first")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)


def export_run(run_dir: Path | str, out_dir: Path | str, step: int | None = None,
               overwrite: bool = False) -> ExportResult:
    """Export the run in ``run_dir`` (its ``step`` checkpoint, else the latest) into ``out_dir``
    as described in the module docstring. Everything is checked before ``out_dir`` is touched."""
    from safetensors.torch import save_file

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    cfg = run_config(run_dir)
    ckpt = find_checkpoint(run_dir, step)
    meta = CheckpointMeta.read(ckpt)
    # the checkpoint must be of the model config.toml builds (e.g. not copied from another run)
    check_compatible(ckpt, meta, expected_shapes(cfg))
    state = read_model_state(ckpt)
    config, kind = _llm_config(cfg, state)
    what = f"model.llm.hf = {cfg.model.llm.hf!r}" if kind == "hf" else "the zoo Llama ([model.llm])"
    llm_state = {k[len(LLM_PREFIX):]: v for k, v in state.items() if k.startswith(LLM_PREFIX)}
    hf_tensors = _hf_tensors(config, llm_state, what)
    dtypes = {v.dtype for v in hf_tensors.values()}
    if len(dtypes) == 1:  # loom's master weights (fp32): from_pretrained keeps what was trained
        config.dtype = str(next(iter(dtypes))).removeprefix("torch.")
    hf_encoders = [_hf_encoder(cfg, name, enc, state) for name, enc in sorted(cfg.model.encoder_configs().items())
                   if getattr(enc, "hf", "")]
    for enc in hf_encoders:
        if enc.name in (HF_WEIGHTS, LOOM_WEIGHTS, LOOM_INDEX, LOOM_CONFIG, "config.json", "generation_config.json"):
            raise ExportError(f"[model.{enc.name}]: the encoder's directory would overwrite the export's file "
                              f"{enc.name}; rename the encoder")
    in_hf_dirs = tuple(_encoder_prefix(enc.name) for enc in hf_encoders)
    loom_state = {k: v.contiguous() for k, v in state.items()
                  if not k.startswith(LLM_PREFIX) and not k.startswith(in_hf_dirs)}
    modules = sorted({_module_of(k) for k in loom_state})

    _claim_out_dir(out_dir, run_dir, overwrite)
    save_file(hf_tensors, str(out_dir / HF_WEIGHTS), metadata={"format": "pt"})  # transformers wants "format"
    config.save_pretrained(out_dir)
    if kind == "hf":
        source = Path(cfg.model.llm.hf)
        generation = (source if source.is_dir() else source.parent) / "generation_config.json"
        if generation.is_file():
            shutil.copyfile(generation, out_dir / "generation_config.json")
    written = {f"encoders.{enc.name}": _write_hf_encoder(out_dir, enc) for enc in hf_encoders}
    if loom_state:
        save_file(loom_state, str(out_dir / LOOM_WEIGHTS), metadata={"format": "pt"})
    if loom_state or written:
        described = sorted(set(modules) | set(written))
        index = {
            "format": FORMAT, "run": str(run_dir), "checkpoint": ckpt.name, "step": meta.step, "config": LOOM_CONFIG,
            "modules": {m: _describe(cfg, m, {k: v for k, v in loom_state.items() if _module_of(k) == m},
                                     written.get(m)) for m in described},
        }
        (out_dir / LOOM_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    shutil.copyfile(run_dir / "config.toml", out_dir / LOOM_CONFIG)
    return ExportResult(out_dir, ckpt, meta.step, kind, config.model_type, len(hf_tensors),
                        [m.split(".", 1)[1] for m in modules if m not in written],
                        {enc.name: enc.cls for enc in hf_encoders})
