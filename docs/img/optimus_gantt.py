"""Draw docs/img/optimus-gantt-*.png: one simulated step of Megatron-LM's layout (the encoder
inside the LLM's first pipeline stage) and of Optimus's (an encoder replica on every rank, its
work moved into the LLM's bubbles), on the same time axis (docs/optimus.md).

    python docs/img/optimus_gantt.py

The scenario: Llama-3-8B with a trainable EVA-CLIP-E vision encoder (4.4 B parameters) on 8
H200, the LLM in 8 pipeline stages at TP 1, 16 microbatches of 2 LLaVA-like samples, the plans
`loom simulate --compare` builds (`loom.planner.baselines.first_stage_plan`, `optimus_plan`)."""

from __future__ import annotations

from pathlib import Path

from loom.planner.baselines import first_stage_plan, optimus_plan
from loom.sim.scenario import load_scenario

HERE = Path(__file__).resolve().parent
SCENARIO = HERE.parent.parent / "configs" / "sim" / "llama3-70b-vith-1024xh100.toml"
OVERRIDES = ['model.llm="llama3-8b"', 'model.encoders={vision="eva-clip-e"}', "model.freeze=[]", 'cluster.gpu="H200"',
             "cluster.num_gpus=8", "parallel.tensor_parallel=1", "parallel.zero_stage=0", "parallel.data_parallel=1",
             "parallel.microbatches_per_pipeline=16", "data.global_batch_size=32"]


def main() -> None:
    scenario = load_scenario(SCENARIO, OVERRIDES)
    runs = {"first-stage": scenario.run(first_stage_plan(scenario)), "optimus": scenario.run(optimus_plan(scenario))}
    span = max(r.iteration_time for r in runs.values())
    titles = {"first-stage": "Megatron-LM's layout (first_stage): EVA-CLIP-E inside the LLM's first stage",
              "optimus": "Optimus: an EVA-CLIP-E replica on every rank, its work in the LLM's bubbles"}
    for name, result in runs.items():
        path = HERE / f"optimus-gantt-{name}.png"
        result.plot_gantt(path, title=f"{titles[name]}: {result.iteration_time:.3f} s, bubbles "
                                      f"{result.bubble_fraction:.1%}", span_s=span)
        print(f"{path.relative_to(HERE.parent.parent)}: {result.iteration_time:.3f} s")


if __name__ == "__main__":
    main()
