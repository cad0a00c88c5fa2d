"""Tensor parallelism of a Hugging Face Llama-layout LLM (`loom.runtime.tensor_parallel`): the
projections split as the model config's own ``base_model_tp_plan`` says, with loom's sequence
parallelism around them; on gloo, TP 2 x PP 2 gives the single process's loss and gradients
(sequences of odd length: padded to even shards)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch.distributed.tensor import DTensor  # noqa: E402

from loom.data.sample import Batch  # noqa: E402
from loom.model.layers import run_layers  # noqa: E402
from loom.model.multimodal import MultimodalModel, loss_sum  # noqa: E402
from loom.plan.plan import ModuleSpec, Plan  # noqa: E402
from loom.runtime.engine import ParallelEngine  # noqa: E402
from loom.runtime.local import run_local  # noqa: E402
from loom.runtime.tensor_parallel import llama_projection_styles  # noqa: E402
from reference import hf_llama, token_batch  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
SAMPLES, LENGTH, MICROBATCHES = 4, 9, 2


def _model(device: str = "meta") -> MultimodalModel:
    return hf_llama({**TINY, "attn_implementation": "sdpa"}, seed=7, device=device)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(TINY["vocab_size"], SAMPLES, LENGTH, seed=1)


def _worker(rank: int, world_size: int, out: str) -> None:
    model = _model()
    plan = Plan([ModuleSpec("llm", num_stages=2, tensor_parallel=2)], num_microbatches=MICROBATCHES)
    engine = ParallelEngine.create(model, plan, torch.device("cpu"))
    ids, labels = _batch()
    per = SAMPLES // MICROBATCHES
    batches = {j: Batch(ids[j * per:(j + 1) * per], labels[j * per:(j + 1) * per], {}, list(range(j * per, (j + 1) * per)))
               for j in range(MICROBATCHES)}
    result = engine.step(batches, int((labels != -100).sum()), layout=engine.identity_layout(SAMPLES))
    loss = torch.tensor([result.loss], dtype=torch.float64)
    torch.distributed.all_reduce(loss)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in engine.stage.named_parameters().items() if p.grad is not None}
    torch.save({"loss": float(loss), "grads": grads}, Path(out) / f"rank{rank}.pt")
    engine.close()


def test_projection_styles_follow_the_config_plan():
    model = _model().llm
    shipped = model.config.base_model_tp_plan
    styles = llama_projection_styles(model)
    assert styles == {k.removeprefix("layers.*."): v for k, v in shipped.items()}
    assert styles["self_attn.o_proj"] == "rowwise" and styles["mlp.up_proj"] == "colwise"


@pytest.mark.multiprocess
def test_hf_llama_tp2_pp2_matches_single_process(tmp_path: Path) -> None:
    run_local(_worker, 4, str(tmp_path))
    model = _model("cpu")
    ids, labels = _batch()
    ctx = model.module_context("llm", Batch(ids, labels, {}, list(range(SAMPLES))))
    logits = run_layers(model.module_layers("llm"), None, ctx)
    ref = loss_sum(logits, labels) / int((labels != -100).sum())
    ref.backward()
    ref_loss = float(ref.detach())
    named = dict(model.named_parameters())
    seen = set()
    for r in range(4):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        assert res["loss"] == pytest.approx(ref_loss, rel=1e-5)
        for name, g in res["grads"].items():
            torch.testing.assert_close(g, named[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {r} {name}: {m}")
            seen.add(name)
    assert seen == set(named)
