"""The training loop of an elastic worker (``[elastic]``; Oobleck, oobleck.md §2.5, §3.6-§3.10):
``python -m loom.train.elastic --config C --run-dir D``, started by
`loom.elastic.supervisor.ElasticSupervisor` (never by ``torchrun``, whose agent restarts every
worker when one fails).

The worker joins the generation the supervisor published (`loom.elastic.member.form`: its
pipeline's group and engine, the copies it lacks, the layer-wise groups) and runs steps: the
global batch of step ``k`` is the sampler's, whatever the layout; its pipeline runs its share
(Eq. 2.6) through the usual dispatcher and engine, with the loss normalised by the whole batch's
targets (one all-reduce over every member), then the layer-wise gradient sum and the commit vote
(`loom.elastic.protocol`) before the optimizer step. On any communication error, timeout or
newer generation, the step is voted ``abort`` (if not yet voted), the rank keeps its parameters
and optimizer state, drops its groups and joins the next generation, which redoes the same step
with the same samples. When the supervisor says the failures went beyond ``f``, the survivors
save what they hold (`loom.elastic.stop`) and exit with `STOP_EXIT`; the supervisor's process
then joins the parts into a regular loom checkpoint (`survivors_checkpoint`), which ``loom train
--resume`` continues from, elastically (``--resume CKPT`` here: every worker starts from the whole
state it reads, `loom.train.checkpoint.read_whole`) or under any plan (`Checkpointer.load`).

The generation's first member writes ``metrics.jsonl`` (per committed step: loss, generation,
each pipeline's sample indices, the commit time) and ``elastic.jsonl`` (each generation formed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from loom.cost.arch_from_model import arch_from_model
from loom.data.sampler import GlobalBatchSampler
from loom.elastic.coordination import STORE_ENV, Coordinator, connect
from loom.elastic.layout import BeyondTolerance, Generation
from loom.elastic.member import Formed, HeldState, StepAborted, form
from loom.elastic.stop import STOP_EXIT, save_survivors
from loom.plan.plan import LLM
from loom.runtime.dispatch import Dispatcher
from loom.runtime.engine import ParallelEngine
from loom.train.build import build_data, build_model, generation_specs, token_counters
from loom.train.checkpoint import expected_shapes, read_whole, save_whole
from loom.train.config import TrainConfig, load_config
from loom.train.launch import SUPERVISOR_ENV, die_with_parent
from loom.train.main import _own_output
from loom.train.rank import lr_lambda, make_lr_scheduler, make_optimizer
from loom.train.status import RankExit, classify, write_pid

EVENTS = "elastic.jsonl"


def _append(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


class ElasticWorker:
    def __init__(self, cfg: TrainConfig, run_dir: Path, rank: int, coord: Coordinator):
        self.cfg, self.run_dir, self.rank, self.coord = cfg, run_dir, rank, coord
        self.timeout = cfg.elastic.timeout_s
        self.tokenizer, self.dataset = build_data(cfg)
        model = build_model(cfg.model, self.tokenizer, seed=cfg.run.seed, device="meta")
        self.counters, self.arch, self.generations = token_counters(model), arch_from_model(model), generation_specs(model)
        self.all_names = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        held_out = cfg.data.eval_samples
        self.sampler = GlobalBatchSampler(len(self.dataset) - held_out, cfg.data.global_batch_size, seed=cfg.run.seed)
        self.device = torch.device("cpu")

    def build_engine(self, plan) -> ParallelEngine:
        model = build_model(self.cfg.model, self.tokenizer, seed=self.cfg.run.seed, device="meta")
        engine = ParallelEngine.create(model, plan, self.device, make_optimizer(self.cfg.optim), dtype=self.cfg.run.dtype)
        engine.eager_forward = self.cfg.balance.eager_forward
        return engine

    # ---- the loop ------------------------------------------------------------------------------
    def train(self, resume: Path | None = None) -> int:
        cfg, coord = self.cfg, self.coord
        state: HeldState | None = None
        committed, number = 0, 0
        if resume is not None:  # every rank holds the whole state: form loads its part, copies nothing
            committed, params, optim = read_whole(resume)
            state = HeldState(params, optim)
            print(f"rank {self.rank}: resumed from {resume} at step {committed}", flush=True)
        while committed < cfg.run.steps:
            gen = coord.generation(number)
            if gen.stop:
                return self.stop(gen, state, committed)
            if self.rank not in gen.members:
                print(f"rank {self.rank}: not in generation {gen.number} (its node was lost); leaving", flush=True)
                return 0
            t0 = time.time()
            try:
                formed = form(coord, gen, self.rank, self.build_engine, state, committed, self.timeout)
            except BeyondTolerance as e:
                gen.stop = str(e)
                return self.stop(gen, state, committed)
            except (RuntimeError, TimeoutError, ConnectionError) as e:  # a failure while forming: wait for the next
                print(f"rank {self.rank}: generation {gen.number} could not form ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]})", flush=True)
                del e
                _destroy()
                number = self.next_generation(gen.number)
                continue
            if formed.leader:
                self.backfill(committed, gen.number)
                _append(self.run_dir / EVENTS, {"event": "formed", "generation": gen.number, "time": time.time(),
                                                 "form_s": round(time.time() - t0, 3), "pipelines": gen.pipelines,
                                                 "samples": gen.samples, "lost": gen.lost, "step": committed})
            print(f"rank {self.rank}: generation {gen.number}, pipeline {formed.pipeline} {gen.pipelines[formed.pipeline]}"
                  f" position {formed.local}; received {formed.copied} parameters; step {committed}", flush=True)
            self.committed = committed
            try:
                committed = self.run_steps(formed, committed)
            except BaseException as e:
                committed = self.committed  # the steps committed before the failure
                if not isinstance(e, (RuntimeError, TimeoutError, ConnectionError)):  # not a peer's failure
                    if not coord.has_voted(gen.number, committed, self.rank):
                        coord.vote(gen.number, committed, self.rank, None)
                    raise
                print(f"rank {self.rank}: step {committed} abandoned ({type(e).__name__}: "
                      f"{(str(e).splitlines() or [''])[0][:200]})", flush=True)
                del e
                if not coord.has_voted(gen.number, committed, self.rank):
                    coord.vote(gen.number, committed, self.rank, None)
                state = HeldState.of(formed.engine)
                formed.drop()
                del formed
                number = self.next_generation(gen.number)
                continue
            _destroy()
        return 0

    def next_generation(self, after: int) -> int:
        """Wait for a generation newer than ``after`` (the supervisor publishes one once it has
        seen the death behind the error); without one the error was not a failure: give up."""
        deadline = time.monotonic() + 6 * self.timeout
        while time.monotonic() < deadline:
            latest = self.coord.latest()
            if latest > after:
                return latest
            time.sleep(0.01)
        raise RuntimeError(f"a communication error without a rank failure (no new generation after {after} within "
                           f"{6 * self.timeout:.0f} s)")

    def run_steps(self, formed: Formed, committed: int) -> int:
        cfg, coord, gen = self.cfg, self.coord, formed.gen
        plan = gen.plans[formed.pipeline]
        engine = formed.engine
        dispatcher = Dispatcher(plan, self.dataset, self.tokenizer, self.counters, self.arch, cfg.balance, self.device,
                                pack=cfg.data.pack_sequences, generations=self.generations,
                                microbatch_tokens=cfg.data.microbatch_tokens, on_error=cfg.data.on_error)
        scheduler = None
        if engine.optimizer is not None:  # the LR schedule where the run is: step `committed`
            scheduler = make_lr_scheduler(cfg, engine.optimizer)
            scheduler.last_epoch = committed
            for group in engine.optimizer.param_groups:
                group["lr"] = cfg.optim.lr * lr_lambda(cfg)(committed)
        terms = [LLM, *plan.generator_names]
        ctx: dict = {}

        def before_update(losses: dict[str, torch.Tensor]) -> None:
            formed.sync_gradients()
            if cfg.optim.max_grad_norm > 0:
                ctx["grad_norm"] = formed.clip(cfg.optim.max_grad_norm)
            payload = {"loss": {m: float(t) for m, t in losses.items()},
                       "samples": ctx["share"] if formed.local == 0 else None, "grad_norm": ctx.get("grad_norm")}
            coord.vote(gen.number, ctx["step"], self.rank, payload)
            verdict, payloads = coord.await_decision(gen.number, ctx["step"], gen.members, 3 * self.timeout)
            if verdict != "commit":
                raise StepAborted(f"step {ctx['step']} aborted: a member failed")
            ctx["payloads"] = payloads

        engine.executor.before_update = before_update
        while committed < cfg.run.steps:
            k = committed
            if coord.latest() > gen.number:
                raise StepAborted(f"generation {coord.latest()} published")
            coord.started(self.rank, k)
            t0 = time.time()
            share = gen.shares(self.sampler.batch(k))[formed.pipeline]
            ctx.clear()
            ctx.update(step=k, share=share)
            got = dispatcher.dispatch(share, k)
            counts = torch.tensor([got.num_targets, *(got.num_generations.get(m, 0) for m in terms[1:])],
                                  dtype=torch.float64) * (1 if formed.local == 0 else 0)
            formed.all_reduce(counts)  # the whole global batch's normalisers
            num_targets = int(counts[0])
            num_generations = {m: int(c) for m, c in zip(terms[1:], counts[1:].tolist())}
            engine.step(got.batches, num_targets, k, exact_timing=False, layout=got.layout, rows=got.rows,
                        num_generations=num_generations)
            if scheduler is not None:
                scheduler.step()
            committed = self.committed = k + 1
            if formed.leader:
                self.record(formed, k, ctx, time.time() - t0)
        return committed

    def record(self, formed: Formed, k: int, ctx: dict, seconds: float) -> None:
        gen, cfg = formed.gen, self.cfg
        payloads = ctx["payloads"]
        loss = sum(sum(payloads[m]["loss"].values()) for m in sorted(payloads))
        samples = [payloads[p[0]]["samples"] for p in gen.pipelines]
        row = {"step": k, "loss": loss, "generation": gen.number, "pipelines": [len(p) for p in gen.pipelines],
               "samples": samples, "step_time_s": round(seconds, 4), "time": time.time(),
               "lr": cfg.optim.lr * lr_lambda(cfg)(k)}
        if "grad_norm" in ctx:
            row["grad_norm"] = ctx["grad_norm"]
        _append(self.run_dir / "metrics.jsonl", row)
        if k % cfg.run.log_every == 0 or k == cfg.run.steps - 1:
            print(f"step {k:5d}/{cfg.run.steps}  loss {loss:.4f}  generation {gen.number}  "
                  f"{seconds * 1e3:7.1f} ms/step", flush=True)

    def backfill(self, committed: int, number: int) -> None:
        """The ``metrics.jsonl`` rows of committed steps whose leader died between the commit and
        its row, rebuilt from the votes (the store keeps them; every member of the committing
        generation voted ``ok`` with its loss share, the first ranks with their samples). Called by
        a leader once every member of generation ``number`` is there: no live rank still writes."""
        path = self.run_dir / "metrics.jsonl"
        rows = path.read_text().splitlines() if path.exists() else []
        done = json.loads(rows[-1])["step"] + 1 if rows else 0
        for k in range(done, committed):
            for g in range(number - 1, -1, -1):
                gen = self.coord.generation(g)
                votes = self.coord.votes(g, k, gen.members) if gen.pipelines and not gen.stop else {}
                if len(votes) == len(gen.members) and all(v.startswith("ok") for v in votes.values()):
                    payloads = {m: json.loads(v[2:]) for m, v in votes.items()}
                    row = {"step": k, "loss": sum(sum(payloads[m]["loss"].values()) for m in sorted(payloads)),
                           "generation": g, "pipelines": [len(p) for p in gen.pipelines],
                           "samples": [payloads[p[0]]["samples"] for p in gen.pipelines], "step_time_s": None,
                           "time": time.time(), "lr": self.cfg.optim.lr * lr_lambda(self.cfg)(k), "backfilled": True}
                    if payloads[gen.members[0]].get("grad_norm") is not None:
                        row["grad_norm"] = payloads[gen.members[0]]["grad_norm"]
                    _append(path, row)
                    break

    def stop(self, gen: Generation, state: HeldState | None, committed: int) -> int:
        where = save_survivors(self.coord, gen, self.rank, state, committed, self.run_dir, self.all_names, self.timeout)
        if self.rank == gen.members[0]:  # every survivor is in stop now (save_survivors waited for them)
            self.backfill(committed, gen.number)
        print(f"rank {self.rank}: beyond f: {gen.stop}; saved to {where}", flush=True)
        return STOP_EXIT


def _destroy() -> None:
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="loom elastic worker (started by loom train with an [elastic] section)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--resume", default=None, metavar="CHECKPOINT", help="a loom checkpoint directory to continue from")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    rank = int(os.environ["RANK"])
    supervisor = os.environ.get(SUPERVISOR_ENV)
    die_with_parent(int(supervisor) if supervisor and supervisor.isdigit() else None)
    _own_output(run_dir, rank)
    if rank == 0:  # the supervisor prints the run's progress; every worker's output goes to its log
        fd = os.open(run_dir / "logs" / "rank0.log", os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.close(fd)
    write_pid(run_dir, rank)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    torch.set_num_threads(1)
    code = 0
    try:
        cfg = load_config(args.config)
        coord = Coordinator(connect(os.environ[STORE_ENV], cfg.elastic.timeout_s))
        code = ElasticWorker(cfg, run_dir, rank, coord).train(Path(args.resume) if args.resume else None)
    except BaseException as e:  # noqa: BLE001 - every way a worker ends is recorded
        state, reason = classify(e)
        traceback.print_exc()
        RankExit(rank, os.getpid(), state, reason, time.time()).write(run_dir)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    RankExit(rank, os.getpid(), "done" if code == 0 else "stopped", "" if code == 0 else "beyond f",
             time.time()).write(run_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip teardown of groups a failure left behind


if __name__ == "__main__":
    main()


def elastic_planner(cfg: TrainConfig):
    """The run's `ElasticPlanner`: templates from the analytic cost model's per-layer times of the
    model (loom's frozen-aware costs on the mean sample of the first global batches, times
    ``elastic.microbatch_size``), the encoders in each pipeline's first stage."""
    from loom.cost.hardware import Cluster
    from loom.cost.analytic import AnalyticCostModel
    from loom.cost.model import Workload
    from loom.elastic.planning import ElasticPlanner
    from loom.plan.plan import ModuleSpec, Plan
    from loom.planner.oobleck_costs import layer_times_of_models
    from loom.train.build import mean_workloads

    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed, device="meta")
    arch = arch_from_model(model)
    names = list(model.module_names)
    one = Plan([ModuleSpec(n) for n in names], num_microbatches=1,
               placement="first_stage" if len(names) > 1 else "disaggregated")
    cost = AnalyticCostModel(arch, one, Cluster("H100", 8))
    _, per_sample = mean_workloads(cfg, model, dataset)
    b = cfg.elastic.microbatch_size
    work = {m: Workload(w.tokens * b, w.attn_sq * b, w.segments * b) for m, w in per_sample.items()}
    times = layer_times_of_models({1: cost}, work, [n for n in names if n != LLM])
    return ElasticPlanner.build(cfg.plan, model.layer_counts(), times, cfg.data.global_batch_size, cfg.elastic)


def survivors_checkpoint(cfg: TrainConfig, run_dir: Path, saved: Path) -> Path | None:
    """Join the survivors' save beyond ``f`` (``saved``: ``checkpoints/elastic_step_<N>``, one
    file per survivor, `loom.elastic.stop`) into the regular checkpoint ``checkpoints/step_<N>``
    (`save_whole`; ``latest`` names it). In one process, after the workers exit. Parameters
    nobody trained (frozen ones) and persistent buffers are the seed's, as on every worker.
    None when a parameter had no surviving copy (the manifest's ``missing``)."""
    manifest = json.loads((saved / "manifest.json").read_text())
    if manifest["missing"]:
        return None
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for name in manifest["files"]:
        part = torch.load(saved / name, weights_only=True)
        params.update(part["params"])
        optim.update(part["optim"])
    names = list(expected_shapes(cfg))  # every parameter and persistent buffer, model order
    if not set(names) <= set(params):
        tokenizer, _ = build_data(cfg)
        model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
        seeded = {f"{layer.name}.{k}": v for m in cfg.plan.module_names for layer in model.module_layers(m)
                  for k, v in layer.module.state_dict().items()}
        params = {n: params[n] if n in params else seeded[n] for n in names}
    return save_whole(run_dir, int(manifest["step"]), cfg, {n: params[n] for n in names}, optim)


def launch(cfg: TrainConfig, run_dir: Path, config_path: Path, kills: list | None = None, echo: bool = True,
           env: dict[str, str] | None = None, planner=None, resume: Path | None = None):
    """Run ``cfg`` (with ``[elastic]``, its ``config.toml`` at ``config_path``) under the elastic
    supervisor, from the checkpoint ``resume`` if given; returns its `ElasticOutcome`. Beyond ``f``
    the survivors' save becomes a regular checkpoint (`survivors_checkpoint`). ``kills``: `Kill`s
    for demos and tests."""
    from loom.elastic.supervisor import ElasticSupervisor, worker_command

    el = cfg.elastic
    planner = planner if planner is not None else elastic_planner(cfg)
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    supervisor = ElasticSupervisor(worker_command(config_path, run_dir, resume), run_dir, planner.first(),
                                   el.nodes * el.ranks_per_node, planner.next, env=env, ranks_per_node=el.ranks_per_node,
                                   kills=kills, echo=echo, stall_s=max(60.0, 12 * el.timeout_s),
                                   log_every=cfg.run.log_every)
    out = supervisor.run()
    saved = sorted((run_dir / "checkpoints").glob("elastic_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    if out.returncode == 2 and saved and (saved[-1] / "manifest.json").is_file():
        ckpt = survivors_checkpoint(cfg, run_dir, saved[-1])
        if ckpt is not None:
            out.message += f"; checkpoint {ckpt.name}: continue with loom train --resume {run_dir}"
        else:
            out.message += "; some parameters had no surviving copy (manifest.json's missing): it cannot be resumed"
    return out
