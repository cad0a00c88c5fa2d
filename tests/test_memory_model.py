"""The cost model's per-block memory (`loom.cost.memory`) against what a zoo Llama block keeps
and holds during its backward, measured tensor by tensor by `MemoryMeter`, under each
recompute mode as `loom.runtime.recompute` applies it (fp32, one process)."""

from __future__ import annotations

import pytest
import torch

from loom.cost.arch import LayerArch
from loom.cost.memory import (activation_bytes_per_token, backward_working_bytes, norm_kept_elements,
                              sp_norm_kept_elements)
from loom.model.layers import Layer
from loom.model.zoo.llama import DecoderLayer, LlamaConfig, rope_tables
from loom.profile.memory_meter import MemoryMeter
from loom.runtime.recompute import apply_recompute

H, HEADS, KV_HEADS, FFN, TOKENS = 128, 4, 2, 344, 96


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_block_memory_matches_the_meter(mode):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=H, num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS,
                      intermediate_size=FFN, max_seq_len=TOKENS)
    block = DecoderLayer(cfg)
    apply_recompute([Layer("b", block, lambda x, ctx: x, "block")], mode, "llm")
    arch = LayerArch("b", "block", H, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN, gated_mlp=True, causal=True,
                     norm="rmsnorm")
    cos, sin = rope_tables(torch.arange(TOKENS)[None], H // HEADS, 10000.0)
    x = torch.randn(1, TOKENS, H, requires_grad=True)
    with MemoryMeter() as m:
        m.track([x, cos, sin, *block.parameters()])
        base = m.live_bytes
        y = block(x, cos, sin)
        # kept: what the forward left alive; the output is the next layer's input and the
        # block's own input was already live (the model counts a block's input, not its output)
        kept = m.live_bytes - base
        m.reset_peak()
        y.backward(torch.ones_like(y))
        working = m.peak_bytes - base - kept - 4 * H * TOKENS  # beyond that, and the output's gradient
        del y
    m.close()
    predicted_kept = activation_bytes_per_token(arch, 1, mode, 4) * TOKENS
    # the model leaves out the norms' per-row 1 / rms (one element per token each)
    assert kept == pytest.approx(predicted_kept, rel=0.01)
    assert working == pytest.approx(backward_working_bytes(arch, 1, 4, TOKENS, mode), rel=0.01)


@pytest.fixture
def fake_tp_group():
    """A 2-rank process group in this one process (PyTorch's fake backend: collectives keep
    their shapes and move no data), so a TP block's memory is measured without a launch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_tp_block_memory_under_sequence_parallelism_matches_the_meter(fake_tp_group, mode):
    # the LLM's TP 2 as loom.runtime.tensor_parallel applies it: the block receives and returns
    # its rank's half of the sequence; the norms run on it, their outputs are all-gathered
    from loom.runtime.tensor_parallel import _LLAMA_PROJECTIONS, parallelize_llama_layer

    t = 2
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=H, num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS,
                      intermediate_size=FFN, max_seq_len=TOKENS)
    block = DecoderLayer(cfg)
    layer = Layer("llm.model.layers.1", block, lambda x, ctx: x, "block")
    parallelize_llama_layer(layer, fake_tp_group, dict(_LLAMA_PROJECTIONS))
    apply_recompute([layer], mode, "llm")
    arch = LayerArch("b", "block", H, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN, gated_mlp=True, causal=True,
                     norm="rmsnorm")
    cos, sin = rope_tables(torch.arange(TOKENS)[None], H // HEADS, 10000.0)
    x = torch.randn(1, TOKENS // t, H, requires_grad=True)
    with MemoryMeter() as m:
        m.track([x, cos, sin, *block.parameters()])  # DTensor parameters: their local shards
        base = m.live_bytes
        y = block(x, cos, sin)
        kept = m.live_bytes - base
        m.reset_peak()
        y.backward(torch.ones_like(y))
        working = m.peak_bytes - base - kept - 4 * H * TOKENS // t
        del y
    m.close()
    predicted = activation_bytes_per_token(arch, t, mode, 4, sequence_parallel=True) * TOKENS
    assert kept == pytest.approx(predicted, rel=0.01)
    # sequence parallelism keeps less than the replicated (Megatron) layout: the norms' inputs
    # and internals are sequence shards; only their all-gathered outputs are whole
    assert predicted < activation_bytes_per_token(arch, t, mode, 4) * TOKENS
    assert working == pytest.approx(backward_working_bytes(arch, t, 4, TOKENS, mode, sequence_parallel=True),
                                    rel=0.01)


def test_sequence_parallel_norm_terms() -> None:
    # without TP the sequence-parallel layout is the plain one; under TP t only the norm's
    # output (the next projection's all-gathered input) stays whole
    for norm, kept in (("rmsnorm", 3), ("layernorm", 2)):
        assert sp_norm_kept_elements(norm, H, 1) == norm_kept_elements(norm, H) == kept * H
        assert sp_norm_kept_elements(norm, H, 4) == (kept - 1) * H / 4 + H
    head = LayerArch("h", "head", H, vocab=64)
    norm = LayerArch("n", "norm", H, norm="rmsnorm")
    assert activation_bytes_per_token(norm, 2, "none", 4, sequence_parallel=True) == 4 * 2 * H / 2
    assert activation_bytes_per_token(norm, 2, "none", 4) == 4 * 2 * H
    # the head keeps its gathered input whole and the vocabulary-parallel log-softmax sharded
    assert activation_bytes_per_token(head, 2, "none", 4, sequence_parallel=True) == 4 * H + 4 * 64 / 2
