"""The cost model's per-block memory (`loom.cost.memory`) against what a zoo Llama block keeps
and holds during its backward, measured tensor by tensor by `MemoryMeter`, under each
recompute mode as `loom.runtime.recompute` applies it (fp32, one process)."""

from __future__ import annotations

import pytest
import torch

from loom.cost.arch import LayerArch
from loom.cost.memory import activation_bytes_per_token, backward_working_bytes
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
