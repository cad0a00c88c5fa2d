"""bf16 mixed precision (issue 9 point 7, ``run.dtype = "bf16"``, `loom.runtime.precision`): a
pipelined, data-parallel run of 20 training steps (the production `build_rank` / `RankRun.step`
path: dispatcher, AdamW, LR schedule, clipping) follows a single-process bf16 run of the same
model on the same batches within 2 % at every step; point-to-point messages are bf16, master
weights, gradients and optimizer state fp32. The LLM runs ZeRO 3 (FSDP2): its all-gathers move
bf16 parameters (``MixedPrecisionPolicy``), its reduce-scatters fp32 gradients."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loom.plan.plan import ModuleSpec, Plan
from loom.runtime.local import run_local
from loom.runtime.precision import Precision
from loom.train.build import build_data, build_model
from loom.train.config import ConfigError, RunConfig, TrainConfig
from loom.train.rank import build_rank
from reference import single_process_losses
from test_parallel_reference import _config

STEPS = 20
TOLERANCE = 0.02  # per-step relative loss difference, the acceptance
MAX_NORM = 1.0


def _bf16_config(dtype: str = "bf16") -> TrainConfig:
    cfg = _config("multimodal_1f1b")
    # encoders on a rank each, the LLM in 2 stages x 2 replicas with ZeRO 3: every edge kind
    # (encoder -> LLM, LLM stage -> stage) and FSDP2's bf16 gathers with fp32 reduction. 1F1B
    # with one encoder rank feeding both LLM replicas, whose FSDP collectives pair their
    # microbatches: the encoders look far enough ahead (generators._lockstep_slack)
    cfg.plan = Plan([ModuleSpec("vision"), ModuleSpec("audio"),
                     ModuleSpec("llm", num_stages=2, data_parallel=2, zero_stage=3)], num_microbatches=4,
                    schedule="1f1b")
    cfg.run = dataclasses.replace(cfg.run, steps=STEPS, dtype=dtype)
    cfg.optim = dataclasses.replace(cfg.optim, max_grad_norm=MAX_NORM)
    return cfg.check()


def _worker(rank: int, world_size: int, out: str) -> None:
    cfg = _bf16_config()
    run = build_rank(cfg, torch.device("cpu"))
    comm = run.engine.executor.comm
    sent, received = set(), set()
    send, recv_shaped = comm.send, comm.recv_shaped

    def recording_send(tensor, peer, tag, header=True):
        sent.add(str(tensor.dtype))
        send(tensor, peer, tag, header)

    def recording_recv(shape, dtype, peer, tag):
        got = recv_shaped(shape, dtype, peer, tag)
        received.add(str(got.dtype))
        return got

    comm.send, comm.recv_shaped = recording_send, recording_recv
    grads: set[str] = set()
    if run.optimizer is not None:  # the gradients the optimizer applies (after sync and clipping)
        run.optimizer.register_step_pre_hook(
            lambda opt, *_: grads.update(str(p.grad.dtype) for g in opt.param_groups for p in g["params"]
                                         if p.grad is not None))
    computed: set[str] = set()  # what the stage's matrix products give: bf16 under autocast
    weights: set[str] = set()  # a linear's weight as its forward reads it: FSDP's gathered dtype
    for layer in run.engine.stage.layers:
        for m in layer.module.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(lambda mod, args, out: computed.add(str(out.dtype)))
                m.register_forward_pre_hook(lambda mod, args: weights.add(str(mod.weight.dtype)))
    losses = [run.step(s).loss for s in range(STEPS)]
    state = set()
    if run.optimizer is not None:
        state = {str(v.dtype) for s in run.optimizer.state.values() for k, v in s.items()
                 if torch.is_tensor(v) and k != "step"}
    params = {str(p.dtype) for p in run.engine.stage.named_parameters().values()}
    torch.save({"losses": losses, "sent": sorted(sent), "received": sorted(received), "grads": sorted(grads),
                "state": sorted(state), "params": sorted(params), "computed": sorted(computed), "weights": sorted(weights),
                "fsdp": run.engine.executor.zero is not None, "module": run.engine.stage.module},
               Path(out) / f"rank{rank}.pt")
    run.close()




@pytest.mark.multiprocess
def test_bf16_pipeline_follows_single_process_bf16_within_2_percent(tmp_path: Path) -> None:
    cfg = _bf16_config()
    world = cfg.plan.resolve(build_model(cfg.model, build_data(cfg)[0], device="meta").layer_counts()).world_size
    run_local(_worker, world, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    ref = single_process_losses(cfg)
    losses = results[0]["losses"]
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref)]
    print(f"bf16 pipeline vs single-process bf16: max per-step relative loss difference {max(rel):.4%} "
          f"(step {rel.index(max(rel))}); first {losses[0]:.4f} vs {ref[0]:.4f}, last {losses[-1]:.4f} vs {ref[-1]:.4f}")
    for r, res in enumerate(results):
        assert res["losses"] == losses, f"rank {r}: every rank reports the global loss"
    assert all(d <= TOLERANCE for d in rel), [f"{d:.4%}" for d in rel]
    assert ref[-1] < 0.9 * ref[0]  # the runs train: the curves compared are not flat
    for r, res in enumerate(results):
        assert res["params"] == ["torch.float32"], f"rank {r}: master weights {res['params']}"
        assert res["computed"] == ["torch.bfloat16"], f"rank {r}: linear outputs {res['computed']}"
        assert res["sent"] and res["received"], f"rank {r} ({res['module']}) exchanged no message"
        # activations and their gradients cross stages in bf16 (headers are int64)
        assert set(res["sent"]) <= {"torch.bfloat16", "torch.int64"} and "torch.bfloat16" in res["sent"], (r, res)
        assert res["received"] == ["torch.bfloat16"], (r, res)
        assert res["grads"] == ["torch.float32"], f"rank {r}: gradients {res['grads']}"
        assert res["state"] == ["torch.float32"], f"rank {r}: optimizer state {res['state']}"
        # FSDP (the LLM's ranks) gathers bf16 parameters; the encoders' ranks read their fp32 weights
        assert res["fsdp"] == (res["module"] == "llm"), (r, res["module"])
        assert res["weights"] == (["torch.bfloat16"] if res["fsdp"] else ["torch.float32"]), (r, res["weights"])


def test_run_dtype_is_checked():
    cfg = TrainConfig()
    assert cfg.run.dtype == "fp32"  # the default
    for bad in ("fp16", "bfloat16", ""):
        cfg.run = RunConfig(dtype=bad)
        with pytest.raises(ConfigError, match=r"run.dtype = .*: unknown precision; choose \"fp32\" or \"bf16\""):
            cfg.check()
    cfg.run = RunConfig(dtype="bf16")
    cfg.check()
    with pytest.raises(ValueError, match="run.dtype = 'fp16'"):
        Precision("fp16", "cpu")


def test_precision_rule():
    """Autocast computes in bf16 from fp32 weights; messages go bf16 and come back fp32 on entry;
    fp32 changes nothing."""
    bf16, fp32 = Precision("bf16", "cpu"), Precision("fp32", "cpu")
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    with bf16.autocast():
        y = layer(x)
    assert y.dtype == torch.bfloat16 and layer.weight.dtype == torch.float32
    with fp32.autocast():
        assert layer(x).dtype == torch.float32
    out = bf16.message(x.requires_grad_())
    assert out.dtype == torch.bfloat16 and out.grad_fn is not None  # the cast is in the graph
    assert bf16.message(torch.ones(2, dtype=torch.int64)).dtype == torch.int64
    assert fp32.message(x) is x
    got = bf16.stage_input({"vision": out.detach()})
    assert got["vision"].dtype == torch.float32
    assert fp32.stage_input(out) is out



def test_bf16_on_a_cuda_device_without_it_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    """`loom train --dry-run` on a (pretended) CUDA machine whose GPUs lack bf16 names
    ``run.dtype`` and the fix, before any process starts."""
    from loom.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    rc = main(["train", "--config", "configs/demo.toml", "--dry-run", f"run.out_dir={tmp_path}",
               'run.device="cuda"', 'run.dtype="bf16"'])
    assert rc == 2
    err = capsys.readouterr().err
    assert 'run.dtype = "bf16"' in err and 'use run.dtype="fp32"' in err, err
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match='run.dtype = "bf16": this CUDA device has no bf16 support'):
        Precision("bf16", "cuda")


def test_fsdp_policy_follows_run_dtype():
    """ZeRO 2/3 under ``run.dtype = "bf16"``: FSDP2 gathers bf16 and reduces fp32, without
    casting the stage's inputs (the residual stream stays fp32); under fp32 FSDP's defaults."""
    from loom.runtime.zero import mixed_precision_policy

    policy = mixed_precision_policy(Precision("bf16", "cpu"))
    assert (policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs) == (torch.bfloat16, torch.float32,
                                                                                      False)
    for fp32 in (Precision("fp32", "cpu"), None):
        policy = mixed_precision_policy(fp32)
        assert (policy.param_dtype, policy.reduce_dtype) == (None, None)


def test_recomputed_forward_replays_under_autocast():
    """Activation checkpointing (`loom.runtime.recompute`) replays a block's forward in the
    backward, which runs outside the forward's autocast: the recomputation must still be bf16,
    or its saved tensors would not match and the gradients would differ from the plain run's."""
    from loom.runtime.recompute import checkpoint_module

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    ckpt = torch.nn.Sequential(*(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)))
    ckpt.load_state_dict(plain.state_dict())
    assert checkpoint_module(ckpt)
    seen = []
    ckpt[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    x = torch.randn(4, 8)
    bf16 = Precision("bf16", "cpu")
    for model in (plain, ckpt):
        with bf16.autocast():
            out = model(x)
        out.float().pow(2).sum().backward()  # outside autocast, as the executor's backward
    assert seen == [torch.bfloat16, torch.bfloat16]  # the forward and its replay
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert q.grad.dtype == torch.float32
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
