"""The configuration of optimus.md §4.6 / §4.9 that issue 10's acceptance times the scheduler
at: ViT-22B (§4.2, Table 8) with GPT-175B (Table 9) on 3072 H100 GPUs, the LLM at PP 8, TP 8,
DP 48 (the baselines' plan, Table 12), 32 microbatches per LLM pipeline (the issue's figure; the
paper's 3072-GPU row has 16 at global batch 1536, §4.9), microbatch size 2, sequence 2048.

The paper does not give image resolution or image tokens per sample (§4.1); decided here: the
encoder's sequence is 2048 tokens per sample too (optimus.md §4.6 [interp] and §7 point 11 take
s = 2048 for the ViT), one image of 32 x 64 patches of 14 pixels; loom's analytic model then
prices a ViT-22B layer at TP 8 at 1.44 ms forward and 2.43 ms backward for a microbatch of 2,
near the paper's 1.4 ms and 2.0 ms (§1.2). ViT-22B's published variant has other details (parallel layers, no
biases); Table 8's dimensions are what this uses, as a ViT-H-style block stack.
"""

from __future__ import annotations

from loom.cost.arch import ModelArch
from loom.cost.model import Workload
from loom.cost.model_configs import FrontendConfig, ModuleConfig, TransformerConfig, load_module_config
from loom.planner.optimus.model_planner import LLMParallel

SEQUENCE = 2048
MICROBATCH_SIZE = 2
IMAGE_TOKENS = 2048  # one 448 x 896 image at patch 14 per sample (module docstring)
NUM_GPUS = 3072
NUM_MICROBATCHES = 32
LLM_PLAN = LLMParallel(data_parallel=48, pipeline_parallel=8, tensor_parallel=8)


def vit_22b() -> ModuleConfig:
    """ViT-22B from optimus.md §4.2 Table 8: width 6144, depth 48, MLP 24576, 48 heads of 128."""
    return ModuleConfig(
        name="vit-22b", kind="vision", source="optimus.md §4.2 Table 8", published_params=22e9,
        transformer=TransformerConfig(hidden=6144, layers=48, heads=48, ffn=24576, qkv_bias=True, linear_bias=True),
        frontend=FrontendConfig(type="patch", in_channels=3, patch=14, positions=IMAGE_TOKENS),
    )


def paper_arch() -> ModelArch:
    """ViT-22B (with an MLP projector into the LLM's width) and GPT-175B."""
    llm = load_module_config("gpt3-175b")
    vision = vit_22b().module_arch("vision", "mlp", llm.transformer.hidden)
    return ModelArch({"vision": vision, "llm": llm.module_arch()})


def paper_workload() -> dict[str, Workload]:
    """One microbatch: 2 sequences of 2048 tokens, 2 images of 2048 tokens."""
    b = MICROBATCH_SIZE
    return {"llm": Workload(b * SEQUENCE, b * SEQUENCE * SEQUENCE, b),
            "vision": Workload(b * IMAGE_TOKENS, b * IMAGE_TOKENS * IMAGE_TOKENS, b)}
