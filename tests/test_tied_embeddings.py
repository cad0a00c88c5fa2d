"""Tied input and output embeddings (``tie_word_embeddings``): kept as one tensor where a
process holds both layers; across pipeline stages each stage holds a copy, initialised equal,
whose gradients are summed between the two stages (`loom.runtime.tied`, Megatron-LM's embedding
group), so a 2-stage gloo run gives the single process's loss, gradients and clipping norm, and
the copies stay equal after an optimizer step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loom.data.sample import Batch  # noqa: E402
from loom.model.layers import run_layers  # noqa: E402
from loom.model.multimodal import MultimodalModel, loss_sum  # noqa: E402
from loom.plan.plan import ModuleSpec, Plan, PlanError  # noqa: E402
from loom.runtime.engine import ParallelEngine  # noqa: E402
from loom.runtime.local import run_local  # noqa: E402
from loom.runtime.stage import build_stages  # noqa: E402
from reference import hf_llama, token_batch  # noqa: E402

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True)
SAMPLES, LENGTH, MICROBATCHES, MAX_NORM = 4, 7, 2, 0.5
EMBED, HEAD = "llm.model.embed_tokens.weight", "llm.lm_head.weight"


def _model(device: str = "meta") -> MultimodalModel:
    return hf_llama(SHAPE, seed=11, device=device)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(SHAPE["vocab_size"], SAMPLES, LENGTH, seed=2)


def test_materialised_in_any_order_the_tie_is_one_tensor():
    whole = _model("cpu")
    assert whole.ties and whole.llm.lm_head.weight is whole.llm.model.embed_tokens.weight
    backwards = _model()
    for index in reversed(range(len(backwards.module_layers("llm")))):
        backwards.materialise("llm", "cpu", index, index + 1)
    assert backwards.llm.lm_head.weight is backwards.llm.model.embed_tokens.weight
    assert torch.equal(backwards.llm.lm_head.weight, whole.llm.lm_head.weight)
    head_only = _model()  # a last stage: its copy equals the embedding it does not hold
    head_only.materialise("llm", "cpu", 4, 5)
    assert head_only.llm.model.embed_tokens.weight.is_meta
    assert torch.equal(head_only.llm.lm_head.weight, whole.llm.model.embed_tokens.weight)
    # one stage holding both: one parameter
    stage = build_stages(_model(), Plan([ModuleSpec("llm")]).resolve({"llm": 5}, 1), 0)[0]
    assert len(stage.trainable_parameters()) == len({id(p) for p in stage.named_parameters().values()})


def _worker(rank: int, world_size: int, out: str) -> None:
    model = _model()
    plan = Plan([ModuleSpec("llm", num_stages=2)], num_microbatches=MICROBATCHES)
    engine = ParallelEngine.create(model, plan, torch.device("cpu"), max_grad_norm=MAX_NORM)
    ids, labels = _batch()
    per = SAMPLES // MICROBATCHES
    batches = {j: Batch(ids[j * per:(j + 1) * per], labels[j * per:(j + 1) * per], {}, list(range(j * per, (j + 1) * per)))
               for j in range(MICROBATCHES)}
    result = engine.step(batches, int((labels != -100).sum()), layout=engine.identity_layout(SAMPLES))
    loss = torch.tensor([result.loss], dtype=torch.float64)
    torch.distributed.all_reduce(loss)
    params = engine.named_parameters()
    grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    tied = params[EMBED if rank == 0 else HEAD]
    torch.optim.AdamW([tied], lr=0.1).step()  # equal gradients, equal steps: the copies stay equal
    torch.save({"loss": float(loss), "norm": result.grad_norm, "grads": grads, "tied": tied.detach().clone()},
               Path(out) / f"rank{rank}.pt")
    engine.close()


@pytest.mark.multiprocess
def test_two_stages_equal_the_single_process(tmp_path: Path) -> None:
    run_local(_worker, 2, str(tmp_path))
    model = _model("cpu")
    ids, labels = _batch()
    ctx = model.module_context("llm", Batch(ids, labels, {}, list(range(SAMPLES))))
    ref = loss_sum(run_layers(model.module_layers("llm"), None, ctx), labels) / int((labels != -100).sum())
    ref.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # the tie counted once
    assert norm > MAX_NORM  # clipping is on: a tie counted twice would change every gradient
    named = dict(model.named_parameters(remove_duplicate=False))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    seen = set()
    for r, res in enumerate(results):
        assert res["loss"] == pytest.approx(ref.item(), rel=1e-5)
        assert res["norm"] == pytest.approx(float(norm), rel=1e-5)
        for name, g in res["grads"].items():
            torch.testing.assert_close(g, named[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {r} {name}: {m}")
            seen.add(name)
    assert seen == set(named) and EMBED in results[0]["grads"] and HEAD in results[1]["grads"]
    torch.testing.assert_close(results[0]["tied"], results[1]["tied"], rtol=0, atol=0)




def test_unpaired_parallelism_is_refused():
    from loom.runtime.tied import tied_copies

    for spec in (ModuleSpec("llm", num_stages=2, tensor_parallel=2), ModuleSpec("llm", num_stages=2, data_parallel=2,
                                                                               zero_stage=2)):
        plan = Plan([spec], num_microbatches=2).resolve({"llm": 5}, 4)
        with pytest.raises(PlanError, match="tie_word_embeddings"):
            tied_copies(_model(), plan, 0, [])


def test_the_cost_model_prices_the_pair_all_reduce():
    from loom.cost.analytic import AnalyticCostModel
    from loom.cost.arch_from_model import arch_from_model
    from loom.cost.hardware import Cluster

    arch = arch_from_model(_model())  # checks every layer's parameter count: the tied head counts 0
    head = arch.module("llm").layers[-1]
    assert head.tied and head.params == 0 and head.stored_params == 64 * 32

    def cost(stages: int) -> AnalyticCostModel:
        plan = Plan([ModuleSpec("llm", num_stages=stages)], num_microbatches=2).resolve({"llm": 5}, stages)
        return AnalyticCostModel(arch, plan, Cluster("H100", 8))

    two = cost(2)
    assert two.tie_sync_time("llm", 0) == two.tie_sync_time("llm", 1) > 0
    assert two.grad_sync_time("llm", 1) == pytest.approx(two.tie_sync_time("llm", 1))  # no data parallelism
    assert cost(1).tie_sync_time("llm", 0) == 0
