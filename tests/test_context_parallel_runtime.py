"""Context parallelism in the executor (issue 9 point 4, cornstarch.md §3.3) against the single
process, fp32: the loss and every gradient of a vision + audio + LLM model equal the reference's
on the same global batch, with the LLM's rows cut over its CP ranks by LPT over BAM block
workloads (`loom.runtime.context_parallel.microbatch_context`).

One launch of 6 gloo processes (a vision rank, an audio rank, 4 LLM ranks), one step per case:

- ``cp2_pp2``: LLM PP 2 x CP 2 on packed rows (images and clips inside text, several samples
  per row): activations stay token-sharded between LLM stages (CP rank i to CP rank i), labels
  follow the tokens, the encoders' token gradients are summed over the CP group before they go
  back; gradient clipping active (the norm counts each parameter once); full recompute;
- ``cp4``: LLM CP 4 on packed rows; selective recompute (the CP attention core, its gather
  included, reruns in the backward);
- ``cp2_dp2``: LLM DP 2 x CP 2 on right-padded rows (one row per sample): gradients sum over
  the dp x cp group;
- ``tp2_cp2``: LLM TP 2 x CP 2 on packed rows, with sequence parallelism inside each CP rank's
  tokens (blocks a multiple of the TP degree, rows padded to whole blocks); clipping active (TP
  shards counted once, not once per CP rank);
- ``cp2_dp2_zero3``: LLM DP 2 x CP 2 with ZeRO 3 on packed rows: FSDP2 shards over the dp x cp
  ranks and its reduce-scatter sums the CP ranks' partial gradients; clipping active.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from reference import assert_matches_reference, identity_step, reference_backward

from loom.data.demo import DemoConfig
from loom.model.zoo import LlamaConfig, VisionConfig
from loom.model.zoo.audio import AudioConfig
from loom.plan.plan import ModuleSpec, Plan
from loom.runtime.context_parallel import cp_block, microbatch_context, row_spans
from loom.runtime.engine import ParallelEngine
from loom.runtime.local import run_local
from loom.train.build import build_data, build_model
from loom.train.config import ModelConfig, TrainConfig


GLOBAL_BATCH = 8
SEED = 7
WORLD = 6
MAX_NORM = 0.05  # below the batch's gradient norm (checked): clipping scales the gradients
CASES = {  # LLM spec, packed rows, clipping
    "cp2_pp2": (ModuleSpec("llm", num_stages=2, context_parallel=2, recompute="full"), True, MAX_NORM),
    "cp4": (ModuleSpec("llm", context_parallel=4, recompute="selective"), True, 0.0),
    "cp2_dp2": (ModuleSpec("llm", data_parallel=2, context_parallel=2), False, 0.0),
    "tp2_cp2": (ModuleSpec("llm", tensor_parallel=2, context_parallel=2), True, MAX_NORM),
    "cp2_dp2_zero3": (ModuleSpec("llm", data_parallel=2, context_parallel=2, zero_stage=3), True, MAX_NORM),
}


def _config(case: str) -> TrainConfig:
    model = ModelConfig(vision=VisionConfig(hidden_size=32, num_layers=2, num_heads=2),
                        audio=AudioConfig(hidden_size=32, num_layers=1, num_heads=2),
                        llm=LlamaConfig(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                                        intermediate_size=64),
                        projector="mlp")
    llm, _, _ = CASES[case]
    plan = Plan([ModuleSpec("vision"), ModuleSpec("audio"), llm], num_microbatches=2)
    cfg = TrainConfig(model=model, plan=plan)
    demo = DemoConfig(num_samples=64, seed=SEED, max_audio_seconds=0.5,
                      mix={"text": 0.2, "image": 0.3, "multi_image": 0.2, "audio": 0.15, "image_audio": 0.15})
    cfg.data = dataclasses.replace(cfg.data, global_batch_size=GLOBAL_BATCH, demo=demo)
    return cfg


def _worker(rank: int, world_size: int, out: str) -> None:
    for case, (_, pack, clip) in CASES.items():
        cfg = _config(case)
        tokenizer, dataset = build_data(cfg)
        model = build_model(cfg.model, tokenizer, seed=SEED, device="meta")
        engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"), max_grad_norm=clip)
        result, loss = identity_step(engine, model, dataset, tokenizer, GLOBAL_BATCH, pack=pack)
        named = engine.stage.named_parameters()
        # TP shards gathered whole (a collective over the TP group: every rank of it, same order)
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                 for n, p in named.items() if p.grad is not None}
        torch.save({"loss": loss, "grads": grads,
                    "no_grad": sorted(n for n, p in named.items() if p.grad is None),
                    "grad_norm": result.grad_norm, "module": engine.stage.module,
                    "cp": {j: (rc.rank, rc.tokens.numel(), rc.sizes) for j, rc in engine.executor.cp_contexts.items()}},
                   Path(out) / f"{case}_rank{rank}.pt")
        engine.close()


@pytest.mark.multiprocess
def test_context_parallel_matches_single_process(tmp_path: Path) -> None:
    run_local(_worker, WORLD, str(tmp_path))
    for case, (llm, pack, clip) in CASES.items():
        cfg = _config(case)
        tokenizer, dataset = build_data(cfg)
        model = build_model(cfg.model, tokenizer, seed=SEED)
        ref_loss = reference_backward(model, dataset, tokenizer, GLOBAL_BATCH)
        results = [torch.load(tmp_path / f"{case}_rank{r}.pt", weights_only=True) for r in range(WORLD)]
        if clip:
            trainable = [p for p in model.parameters() if p.requires_grad]
            norm = float(torch.nn.utils.clip_grad_norm_(trainable, clip))
            assert norm > 2 * clip, case  # clipping is active
            for r, res in enumerate(results):
                assert res["grad_norm"] == pytest.approx(norm, rel=1e-5), f"{case} rank {r} grad_norm"
        assert_matches_reference(results, model, ref_loss)
        # the LLM's ranks really split its rows: per microbatch, CP rank c holds sizes[c] > 0 tokens
        # and every rank of the unit agrees on the sizes (one split from the same metadata)
        llm_ranks = [res for res in results if res["module"] == "llm"]
        assert len(llm_ranks) == 4, case
        cp, size = llm.context_parallel, llm.context_parallel * llm.tensor_parallel
        for unit in range(4 // size):
            ranks = llm_ranks[unit * size:(unit + 1) * size]  # CP-major, then TP (the rank layout)
            assert ranks[0]["cp"], f"{case}: LLM unit {unit} ran no CP microbatch"
            for j, (_, _, sizes) in ranks[0]["cp"].items():
                assert len(sizes) == cp and min(sizes) > 0, (case, j, sizes)
                assert all(n % llm.tensor_parallel == 0 for n in sizes), (case, j, sizes)  # even SP shards
                for i, res in enumerate(ranks):
                    c = i // llm.tensor_parallel
                    assert res["cp"][j] == (c, sizes[c], sizes), (case, unit, j, i, res["cp"][j])


def test_rows_shorter_than_the_cp_degree_are_refused_naming_the_field() -> None:
    ids = torch.tensor([[5, 9, 9]])
    with pytest.raises(ValueError, match=r"plan.modules\['llm'\].context_parallel = 4 but a microbatch's LLM rows "
                                         r"have 3 tokens"):
        microbatch_context(ids, None, {"vision": 9}, cp=4, rank=0)


def test_row_spans_follow_placeholders_and_packed_samples() -> None:
    ids = torch.tensor([1, 2, 9, 9, 9, 3, 4, 8, 8, 5])
    assert [[(s.kind, s.length) for s in sample] for sample in row_spans(ids, [6, 4], {"vision": 9, "audio": 8})] == [
        [("text", 2), ("vision", 3), ("text", 1)], [("text", 1), ("audio", 2), ("text", 1)]]
    assert len(row_spans(ids, None, {"vision": 9})) == 1  # unpacked: the row, padding included, is one sample
    # blocks: 128 tokens on long rows, smaller on short ones so each rank gets several
    assert cp_block(100_000, 8) == 128 and cp_block(64, 2) == 8 and cp_block(3, 2) == 1


def test_an_llm_without_a_cp_attention_hook_is_refused_before_any_group() -> None:
    transformers = pytest.importorskip("transformers")
    from loom.model.multimodal import MultimodalModel
    from loom.plan.plan import PlanError
    from loom.runtime.context_parallel import check_context_parallel

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = MultimodalModel({}, transformers.LlamaForCausalLM(config), {})
    with pytest.raises(PlanError, match=r"plan.modules\['llm'\].context_parallel = 2: the LLM \(LlamaForCausalLM\) "
                                        r"has no context-parallel attention hook"):
        check_context_parallel(ModuleSpec("llm", context_parallel=2), model)
    check_context_parallel(ModuleSpec("llm"), model)  # CP 1 needs no hook
