"""Every value that depends only on the config is refused before any process starts, in one
line that names the field, with exit status 2 (issue 8, points 12 and 15): `loom train
--dry-run`, `loom simulate` and `loom profile` alike. In-process `main` calls: nothing here
starts a worker."""

import pytest
import torch

from loom.cli import main

DEMO = "configs/demo.toml"
SCENARIO = "configs/sim/llama3-70b-vith-1024xh100.toml"
DP2 = ["plan.modules.vision.data_parallel=2", "plan.modules.audio.data_parallel=2",
       "plan.modules.llm.data_parallel=2"]

TRAIN = [
    # point 15
    (['run.device="cuda"'], "run.device"),
    (["model.llm.hidden_size=0"], "model.llm.hidden_size = 0"),
    (["model.vision.patch_size=0"], "model.vision.patch_size = 0"),
    (["model.vision.patch_size=16"], "model.vision.patch_size = 16"),
    (["model.llm.num_heads=0"], "model.llm.num_heads = 0"),
    (["model.audio.mlp_ratio=-1.0"], "model.audio.mlp_ratio"),
    (["run.log_every=0"], "run.log_every = 0"),
    (['model.audio="none"', 'plan.modules=[{name="vision"}, {name="llm", num_stages=2}]'],
     "data.demo.mix.audio = 0.2: these samples need the audio encoder"),
    (["run.eval_every=-1"], "run.eval_every = -1"),
    (["run.eval_every=5"], "run.eval_every = 5"),  # no held-out split
    (["run.eval_every=5", "data.eval_samples=12"], "data.eval_samples = 12"),  # not whole global batches
    (['run.dtype="fp16"'], "run.dtype = 'fp16'"),
    (["plan.modules.llm.tensor_parallel=3"], "plan.modules['llm'].tensor_parallel = 3 does not divide the attention heads"),
    (["plan.modules.llm.tensor_parallel=4"], "plan.modules['llm'].tensor_parallel = 4 does not divide the key/value heads"),
    (["plan.modules.vision.tensor_parallel=8"], "plan.modules['vision'].tensor_parallel = 8 does not divide"),
    (["plan.modules.vision.context_parallel=2"], "plan.modules['vision'].context_parallel = 2"),
    (["plan.modules.llm.context_parallel=2", "plan.modules.llm.data_parallel=2", "plan.modules.llm.zero_stage=1",
      "plan.modules.llm.tensor_parallel=2"],
     "plan.modules['llm'].context_parallel = 2 with zero_stage = 1 and tensor_parallel = 2"),
    (["plan.modules.llm.context_parallel=2", "plan.modules.llm.data_parallel=4", "plan.modules.llm.zero_stage=3",
      "plan.modules.llm.shard_degree=2"], "plan.modules['llm'].context_parallel = 2 with shard_degree = 2"),
    (["plan.modules.llm.zero_stage=1"], "plan.modules['llm'].zero_stage = 1 with data_parallel = 1"),
    (["plan.modules.llm.zero_stage=3"], "plan.modules['llm'].zero_stage = 3 with data_parallel = 1"),
    (["plan.modules.llm.data_parallel=2", "plan.modules.llm.zero_stage=3", "plan.modules.llm.shard_degree=3"],
     "plan.modules['llm'].shard_degree = 3: must divide data_parallel = 2"),
    (["plan.modules.llm.data_parallel=4", "plan.modules.llm.zero_stage=1", "plan.modules.llm.shard_degree=2"],
     "plan.modules['llm'].shard_degree = 2 needs zero_stage 2 or 3"),
    (["plan.modules.audio.recompute=true"], "plan.modules['audio'].recompute = true"),
    (["optim.warmup_steps=-5"], "optim.warmup_steps = -5"),
    (["optim.min_lr_ratio=5"], "optim.min_lr_ratio = 5"),
    (["data.demo.mix.generate=1"], "data.demo.mix.generate = 1: generation requests need a model with an image generator"),
    (["optim.lr=0"], "optim.lr = 0"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay"),
    (['run.name=""'], "run.name = ''"),
    (['run.name="a/b"'], "run.name = 'a/b'"),
    (["run.steps=0"], "run.steps = 0"),
    (["run.seed=-1"], "run.seed = -1"),
    (["run.steps=ten"], "run.steps = 'ten'"),
    (['plan.modules.llm.data_parallel="two"'], "plan.modules['llm'].data_parallel = 'two'"),
    (["plan.num_microbatches=0"], "plan.num_microbatches = 0"),
    (["data.global_batch_size=0"], "data.global_batch_size = 0"),
    (['model.projector="qformer"'], "model.projector = 'qformer'"),
    # point 12: balancing refusals that depend only on the config
    (["balance.default=entrain", "plan.modules.llm.data_parallel=2"], "data_parallel"),
    (["balance.default=disttrain", "plan.modules.llm.data_parallel=2"], "data_parallel"),
    (["balance.default=entrain", *DP2, "data.global_batch_size=9"], "data.global_batch_size = 9"),
    (["balance.default=orchmllm", "plan.modules.llm.data_parallel=2", "plan.num_microbatches=3"],
     "plan.num_microbatches = 3"),
    # balance.ranks_per_node must divide the world size (4 ranks in the demo plan)
    (["balance.ranks_per_node=3"], "balance.ranks_per_node = 3"),
    (["balance.ranks_per_node=8"], "balance.ranks_per_node = 8"),
    (["balance.ranks_per_node=0"], "balance.ranks_per_node = 0"),
]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loom: error: "), err
    return err[0]


@pytest.mark.parametrize("overrides, field", TRAIN, ids=[" ".join(o) for o, _ in TRAIN])
def test_train_dry_run_refuses(tmp_path, capsys, overrides, field):
    if overrides == ['run.device="cuda"'] and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    rc = main(["train", "--config", DEMO, "--dry-run", f"run.out_dir={tmp_path}", *overrides])
    assert rc == 2
    assert field in one_line_error(capsys)
    assert not any(tmp_path.iterdir())  # nothing written


def test_train_refuses_ranks_per_node_other_than_its_launch(tmp_path, capsys):
    """`loom train` starts all 4 ranks on this machine: 2 ranks per node is refused before any
    process starts (a dry run accepts it and prints the launch for 2 nodes of 2)."""
    args = ["train", "--config", DEMO, f"run.out_dir={tmp_path}", "balance.ranks_per_node=2"]
    assert main(args) == 2
    line = one_line_error(capsys)
    assert "balance.ranks_per_node = 2" in line and "4 processes per node" in line
    assert not any(tmp_path.iterdir())
    assert main([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--nnodes=2" in out and "--nproc-per-node=2" in out


@pytest.mark.parametrize("per_node, world, local, ok", [
    (1, 4, 4, True), (4, 4, 4, True), (2, 4, 2, True), (2, 4, None, True),
    (2, 4, 4, False), (3, 4, None, False), (4, 8, 8, False),
])
def test_ranks_per_node_against_the_launch(per_node, world, local, ok):
    """What each rank checks against torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE (`loom.train.main`)."""
    from loom.train.config import ConfigError, load_config

    cfg = load_config(DEMO, [f"balance.ranks_per_node={per_node}"])
    if ok:
        cfg.check_ranks_per_node(world, local)
    else:
        with pytest.raises(ConfigError, match="balance.ranks_per_node"):
            cfg.check_ranks_per_node(world, local)


SIMULATE = [
    (["totally.bogus=3"], "'totally'"),
    (["parallel.bogus=3"], "'bogus'"),
    (["parallel.tensor_parallel=abc"], "parallel.tensor_parallel = 'abc'"),
    (["parallel.tensor_parallel=0"], "parallel.tensor_parallel = 0"),
    (["parallel.zero_stage=5"], "parallel.zero_stage = 5"),
    (["cluster.num_gpus=1.5"], "cluster.num_gpus = 1.5"),
    (["cluster.gpu=B300"], "cluster.gpu = 'B300'"),
    (["data.llm_batching=ragged"], "data.llm_batching = 'ragged'"),
    (["data.mix=nope"], "data.mix = 'nope'"),
    (["model.freeze=3"], "model.freeze = 3"),
    (["cluster=3"], "cluster = 3"),
    (["parallel.tensor_parallel"], "dotted.key=value"),
    (['run.dtype="fp16"'], "run.dtype = 'fp16'"),
    (["optim.max_grad_norm=-1.0"], "optim.max_grad_norm = -1.0"),
    (["cost.efficiency=1.5"], "cost.efficiency = 1.5"),
    (["cost.bogus=1"], "'bogus'"),
    (["--policy", "entrain", "--entrain-eager-max", "-1"], "--entrain-eager-max -1"),
]


@pytest.mark.parametrize("overrides, field", SIMULATE, ids=[" ".join(o) for o, _ in SIMULATE])
def test_simulate_refuses(tmp_path, capsys, overrides, field):
    assert main(["simulate", "--config", SCENARIO, "--no-png", "--out", str(tmp_path), *overrides]) == 2
    assert field in one_line_error(capsys)


PROFILE = [
    (["--tokens", "abc"], "--tokens 'abc'"),
    (["--tokens", "1"], "--tokens"),
    (["--threads", "0"], "--threads 0"),
    (["--repeats", "0"], "--repeats 0"),
    (["--repeats", "x"], "--repeats"),
    (["--co-runners", "-1"], "--co-runners -1"),
    (["--device", "tpu"], "--device 'tpu'"),
    (["--out", "/proc/no/such/dir/p.json"], "--out"),
    (["model.llm.hidden_size=0"], "model.llm.hidden_size = 0"),
]


@pytest.mark.parametrize("args, field", PROFILE, ids=[" ".join(a) for a, _ in PROFILE])
def test_profile_refuses_before_measuring(tmp_path, capsys, args, field):
    with pytest.raises(SystemExit) if args == ["--repeats", "x"] else _no_raise() as e:
        rc = main(["profile", "--config", DEMO, f"run.out_dir={tmp_path}", *args])
    assert (e.value.code if e is not None else rc) == 2
    assert field in one_line_error(capsys)
    assert not any(tmp_path.iterdir())


class _no_raise:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_out_dir_to_a_directory_is_refused(tmp_path, capsys):
    assert main(["profile", "--config", DEMO, "--out", str(tmp_path)]) == 2
    assert "is a directory" in one_line_error(capsys)


def test_tensorboard_without_the_package_is_refused_by_the_dry_run(tmp_path, capsys, monkeypatch):
    from loom.train import scalars

    monkeypatch.setattr(scalars, "tensorboard_installed", lambda: False)
    rc = main(["train", "--config", DEMO, "--dry-run", f"run.out_dir={tmp_path}", "run.tensorboard=true"])
    assert rc == 2
    assert "pip install tensorboard" in one_line_error(capsys) and not any(tmp_path.iterdir())
