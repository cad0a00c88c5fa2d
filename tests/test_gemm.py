"""GEMM efficiency by shape (`loom.cost.gemm`, issue 12 item 1): large square GEMMs run near
the GPU's ceiling, skinny ones far below it, tile and wave quantization as NVIDIA's guide
describes them, and the analytic cost model prices a layer with them."""

import pytest

from loom.cost.analytic import AnalyticCostModel
from loom.cost.arch import LayerArch, ModelArch, ModuleArch
from loom.cost.flops import gemm_flops
from loom.cost.gemm import TILE, gemm_seconds, layer_gemm_seconds, layer_gemms, quantization
from loom.cost.hardware import GPUS, Cluster, GPUSpec
from loom.cost.model import Workload
from loom.plan.plan import ModuleSpec, Plan

H100 = GPUS["H100"]


def achieved(m, n, k, spec=H100):
    return 2 * m * n * k / gemm_seconds(m, n, k, spec, 2) / spec.peak_bf16_flops


def test_large_square_gemms_reach_the_ceiling_and_skinny_ones_fall_far_below():
    big = achieved(8192, 8192, 8192)
    assert big == pytest.approx(H100.gemm_ceiling, rel=0.05)  # 4096 tiles in 32 waves of 132
    assert 0.7 <= big <= 0.8  # the "large square ones near 70 to 80 %"
    skinny = achieved(16, 8192, 8192)  # a few tokens against a wide weight: memory-bound
    assert skinny < 0.1
    # bound by reading the weight once: bytes / bandwidth
    assert gemm_seconds(16, 8192, 8192, H100, 2) == pytest.approx(2 * (16 * 8192 * 2 + 8192**2) / H100.hbm_bandwidth)
    # efficiency grows with the rows, monotonically across a microbatch's range
    rates = [achieved(m, 4096, 4096) for m in (32, 128, 512, 2048, 8192)]
    assert rates == sorted(rates) and rates[0] < 0.2 and rates[-1] > 0.65


def test_tile_and_wave_quantization():
    sms = H100.sms
    assert quantization(TILE * 12, TILE * 11, 4096, sms) == pytest.approx(1.0)  # 132 tiles: one full wave
    assert quantization(TILE * 12, TILE * 11 + 1, 4096, sms) < 0.6  # a partial tile column and a second wave
    # 133 tiles: the second wave has one tile
    assert quantization(TILE * 7, TILE * 19, 512, sms) == pytest.approx(133 / 264)
    # a small grid is split along k to fill the GPU, as far as k allows
    assert quantization(TILE, TILE, 64 * 512, sms) == pytest.approx(64 / 132)
    assert quantization(TILE, TILE, 512, sms) == pytest.approx(1 / 132)
    # no SM count (a device without one): no quantization
    assert quantization(100, 100, 100, 0) == 1.0


def test_layer_gemms_cover_the_weights_and_split_by_tensor_parallelism():
    block = LayerArch("b", "block", hidden=8192, heads=64, kv_heads=8, ffn=28672, gated_mlp=True, causal=True)
    head = LayerArch("h", "head", hidden=8192, vocab=128256)
    for tp in (1, 2, 4, 8):
        assert sum(k * n for k, n in layer_gemms(block, tp)) == block.gemm_weights // tp
        assert sum(k * n for k, n in layer_gemms(head, tp)) == 8192 * 128256 // tp
    assert layer_gemms(LayerArch("e", "embedding", hidden=64, vocab=100), 1) == ()
    # TP cuts the narrow projections more than the wide MLP: a 70B block loses efficiency at TP 8
    tokens, flops = 4096, gemm_flops(block, Workload.of_lengths([4096])).forward
    one = layer_gemm_seconds(block, tokens, 1, "forward", flops, H100, 2)
    eight = layer_gemm_seconds(block, tokens, 8, "forward", flops / 8, H100, 2)
    assert eight > one / 8
    assert flops / one / H100.peak_bf16_flops == pytest.approx(H100.gemm_ceiling, rel=0.05)
    # every phase is priced, the weight gradient reducing over the tokens
    for phase in ("backward_input", "backward_weight"):
        assert layer_gemm_seconds(block, tokens, 8, phase, flops / 8, H100, 2) == pytest.approx(eight, rel=0.1)


def test_the_cost_model_prices_blocks_by_shape_and_a_constant_on_request():
    block = LayerArch("b", "block", hidden=4096, heads=32, kv_heads=8, ffn=14336, gated_mlp=True, causal=True)
    arch = ModelArch({"llm": ModuleArch("llm", "llm", (
        LayerArch("e", "embedding", hidden=4096, vocab=128256), block, LayerArch("n", "norm", hidden=4096),
        LayerArch("h", "head", hidden=4096, vocab=128256)))})
    plan = Plan([ModuleSpec("llm")])

    def block_seconds(tokens, efficiency=None, sequences=1):
        model = AnalyticCostModel(arch, plan, Cluster("H100", 8), efficiency=efficiency)
        return model.layer_costs("llm", 0, Workload.of_lengths([tokens] * sequences))[1].forward

    # per token, a short microbatch costs more than a long one (below the GEMMs' ridge point)
    assert block_seconds(64) / 64 > 2 * block_seconds(4096) / 4096
    # a constant efficiency keeps the old linear model: cost per token constant above the weights' floor
    assert block_seconds(4096, 0.5) == pytest.approx(block_seconds(4096, 0.5, sequences=2) / 2)
    # the shape model is never faster than the ceiling on the block's GEMM FLOPs
    flops = gemm_flops(block, Workload.of_lengths([4096])).forward
    assert block_seconds(4096) >= flops / (H100.peak_bf16_flops * H100.gemm_ceiling)


def test_gpu_spec_checks_its_efficiencies():
    with pytest.raises(ValueError, match="gemm_ceiling"):
        GPUSpec("x", 1e12, 1e9, 1e9, 1e9, 1e9, gemm_ceiling=1.5)
    with pytest.raises(ValueError, match="attention_efficiency"):
        GPUSpec("x", 1e12, 1e9, 1e9, 1e9, 1e9, attention_efficiency=0)
