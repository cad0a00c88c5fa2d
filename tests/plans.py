"""Small hand-built plans shared by the schedule, simulator and validator tests."""

from loom.plan.plan import ModuleSpec, Plan


def multimodal(vision: int = 2, audio: int = 1, llm: int = 2, microbatches: int = 4,
               dp_enc: int = 1, dp_llm: int = 1, kind: str = "1f1b") -> Plan:
    """Vision (4 layers) and, if ``audio`` > 0, audio (3 layers) encoders feeding an LLM of 6
    layers, with the given stage counts and data-parallel degrees."""
    modules = [ModuleSpec("vision", data_parallel=dp_enc, num_stages=vision)]
    layers = {"vision": 4, "llm": 6}
    if audio:
        modules.append(ModuleSpec("audio", data_parallel=dp_enc, num_stages=audio))
        layers["audio"] = 3
    modules.append(ModuleSpec("llm", data_parallel=dp_llm, num_stages=llm))
    return Plan(modules, num_microbatches=microbatches, schedule=kind).resolve(layers)
