"""Typed run configuration, loaded from TOML with command-line overrides.

Sections: ``[run]``, ``[model]`` (with ``[model.vision]``, ``[model.audio]``, ``[model.llm]``),
``[data]`` (with ``[data.demo]``), ``[optim]``, ``[balance]`` (per-phase balancing policy and
microbatch order, see `loom.balance.policy.BalanceConfig`) and ``[plan]`` (see `loom.plan.plan.Plan`).
Every unknown key, wrong type or bad value raises `ConfigError` naming the dotted field and
what to do. Overrides are ``dotted.key=value`` with TOML values (``run.steps=10``,
``model.freeze=["vision.encoder"]``); plan modules are addressed by name
(``plan.modules.llm.num_stages=2``).
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.balance.policy import BalanceConfig, BalanceError
from loom.data.demo import DemoConfig
from loom.model.zoo import AudioConfig, LlamaConfig, VisionConfig
from loom.plan.plan import ModuleSpec, Plan, PlanError


class ConfigError(ValueError):
    """A configuration problem; the message names the field and the fix."""


@dataclass
class RunConfig:
    name: str = "demo"
    out_dir: str = "runs"
    steps: int = 120
    seed: int = 0
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, one GPU per process)
    log_every: int = 10  # log-line interval when stdout is not a terminal
    profile: str = ""  # a `loom profile` JSON: unset stage boundaries then come from the frozen-aware partitioner


@dataclass
class ModelConfig:
    vision: VisionConfig | None = field(default_factory=VisionConfig)
    audio: AudioConfig | None = field(default_factory=AudioConfig)
    llm: LlamaConfig = field(default_factory=LlamaConfig)
    projector: str = "mlp"  # "linear" | "mlp"
    freeze: list[str] = field(default_factory=list)  # parts: "vision", "vision.encoder", "llm", ...


@dataclass
class DataConfig:
    global_batch_size: int = 16
    # LLM microbatches as one packed row (attention and positions restart per sample; no
    # padding) instead of one right-padded row per sample. Needs the zoo Llama.
    pack_sequences: bool = False
    demo: DemoConfig = field(default_factory=DemoConfig)


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio at the last step


def default_plan() -> Plan:
    """The demo layout: vision and audio encoders in parallel on a rank each, LLM in 2 stages."""
    return Plan(
        modules=[ModuleSpec("vision"), ModuleSpec("audio"), ModuleSpec("llm", num_stages=2)],
        num_microbatches=4,
        schedule="1f1b",
    )


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    plan: Plan = field(default_factory=default_plan)
    balance: BalanceConfig = field(default_factory=BalanceConfig)  # per-phase policy, see loom.balance.policy

    def check(self) -> "TrainConfig":
        """Value checks that do not need the model (the plan is checked against it later)."""
        if self.run.steps < 1:
            raise ConfigError(f"run.steps = {self.run.steps}: must be at least 1")
        if self.run.device not in ("cpu", "cuda"):
            raise ConfigError(f"run.device = {self.run.device!r}: choose 'cpu' or 'cuda'")
        if self.model.projector not in ("linear", "mlp"):
            raise ConfigError(f"model.projector = {self.model.projector!r}: choose 'linear' or 'mlp'")
        if self.optim.lr <= 0:
            raise ConfigError(f"optim.lr = {self.optim.lr}: must be positive")
        if self.data.global_batch_size < self.plan.num_microbatches:
            raise ConfigError(
                f"data.global_batch_size = {self.data.global_batch_size} is smaller than "
                f"plan.num_microbatches = {self.plan.num_microbatches}: every microbatch needs a sample"
            )
        encoders = [n for n in ("vision", "audio") if getattr(self.model, n) is not None]
        for m in self.plan.modules:
            if m.name != "llm" and m.name not in encoders:
                raise ConfigError(
                    f"plan.modules[{m.name!r}]: unknown module name; the model has {encoders + ['llm']}"
                )
        try:
            self.balance.check(self.plan.module_names)
        except BalanceError as e:
            raise ConfigError(str(e)) from e
        return self


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
    cfg = _build(TrainConfig, data, "")
    if plan_data is not None:
        try:
            cfg.plan = Plan.from_dict(plan_data)
        except (PlanError, TypeError) as e:
            raise ConfigError(str(e)) from e
    return cfg.check()


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r}: write it as dotted.key=value, e.g. run.steps=10")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string
    parts = key.split(".")
    if parts[:2] == ["plan", "modules"] and len(parts) == 4:
        mods = data.setdefault("plan", {}).setdefault("modules", [m_as_dict(m) for m in default_plan().modules])
        for m in mods:
            if m.get("name") == parts[2]:
                m[parts[3]] = value
                if parts[3] == "num_stages":
                    m.pop("stage_boundaries", None)  # a new stage count takes the default split
                return
        raise ConfigError(f"override {item!r}: plan.modules has no module {parts[2]!r}")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {p!r} is not a section")
    node[parts[-1]] = value


def m_as_dict(m: ModuleSpec) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(m).items() if v is not None}


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"unknown field(s) {sorted(unknown)} in [{where or 'top level'}]; known: {sorted(names)}")
    kwargs = {}
    for k, v in data.items():
        kwargs[k] = _convert(hints[k], v, f"{where}.{k}" if where else k)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{where or 'top level'}]: {e}") from e


def _convert(tp: Any, v: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in args if a is not type(None)]
        if v is None or v is False or (isinstance(v, str) and v.lower() == "none"):
            if type(None) in args:
                return None
        return _convert(inner[0], v, where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, v, where)
    if origin in (list, tuple):
        if not isinstance(v, list):
            raise ConfigError(f"{where} must be a list, got {v!r}")
        return list(v) if origin is list else tuple(v)
    if origin is dict:
        if not isinstance(v, dict):
            raise ConfigError(f"{where} must be a table, got {v!r}")
        return dict(v)
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if tp in (int, float, str, bool) and not (isinstance(v, tp) and not (tp is int and isinstance(v, bool))):
        raise ConfigError(f"{where} must be of type {tp.__name__}, got {v!r}")
    return v


def config_to_toml(cfg: TrainConfig) -> str:
    """The resolved configuration as TOML (written to the run directory)."""
    lines: list[str] = []

    def emit(prefix: str, obj: Any) -> None:
        scalars, tables = [], []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                tables.append((f.name, v))
            elif v is None:
                scalars.append(f'{f.name} = "none"')
            else:
                scalars.append(f"{f.name} = {_toml_value(v)}")
        lines.append(f"[{prefix}]")
        lines.extend(scalars)
        lines.append("")
        for name, v in tables:
            emit(f"{prefix}.{name}", v)

    for section in ("run", "model", "data", "optim", "balance"):
        emit(section, getattr(cfg, section))
    lines.append(cfg.plan.to_toml())
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f'"{k}" = {_toml_value(x)}' for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")
