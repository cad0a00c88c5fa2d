"""The LLM-only benchmarks' run configs pass `TrainConfig.check` (no process runs): a config
rule added later (a model without encoders cannot take image or audio samples) once left
`benchmarks/memory.py`, `parallel_overhead.py` and `pipeline_overhead.py` failing at startup."""

from __future__ import annotations

import pytest

from benchmarks import memory, parallel_overhead, pipeline_overhead
from loom.plan.plan import LLM


@pytest.mark.parametrize("case", list(memory.CASES))
def test_memory_cases_check(case):
    dtype = "bf16" if case in memory.BF16_CASES else "fp32"
    train = memory.train_config(memory.BenchConfig(), memory.CASES[case], dtype)
    assert train.model.vision is None and train.data.demo.mix == {"text": 1.0} and train.run.dtype == dtype


@pytest.mark.parametrize("case", parallel_overhead.CASES)
def test_parallel_overhead_cases_check(case):
    train = parallel_overhead.train_config(parallel_overhead.BenchConfig(), 5, case)
    spec = train.plan.spec(LLM)
    assert (spec.zero_stage, spec.tensor_parallel) == ((3, 1) if case == "fsdp" else (0, 2))
    assert train.run.steps == 5


@pytest.mark.parametrize("name", list(pipeline_overhead.CONFIGS))
def test_pipeline_overhead_configs_check(name):
    cfg = pipeline_overhead.CONFIGS[name][0]
    train = pipeline_overhead.train_config(cfg, 5)
    assert train.plan.spec(LLM).num_stages == pipeline_overhead.WORLD_SIZE and train.optim.lr == cfg.lr
