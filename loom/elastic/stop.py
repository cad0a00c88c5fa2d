"""Beyond ``f`` (oobleck.md §2.5: "Oobleck stores the progress, informs the user, and exits"; gap
G19, the format): the survivors write what they hold at the last committed step, each parameter
once (by its lowest surviving holder), as plain ``torch.save`` files, with a manifest::

    <run dir>/checkpoints/elastic_step_<N>/rank<R>.pt   {"step", "params": {name: tensor},
                                                          "optim": {name: {step, exp_avg, exp_avg_sq}}}
    <run dir>/checkpoints/elastic_step_<N>/manifest.json {"step", "reason", "files", "missing"}

No process group is needed (the failures may have taken every group's members). After the workers
exit, the supervisor's process joins the files into a regular loom checkpoint
(``checkpoints/step_<N>``, `loom.train.elastic.survivors_checkpoint`), which ``loom train
--resume`` continues from, elastically once enough nodes are back or under any plan.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loom.elastic.coordination import Coordinator
from loom.elastic.layout import Generation
from loom.elastic.member import HeldState

STOP_EXIT = 3  # a worker's exit status after saving beyond f


def save_survivors(coord: Coordinator, gen: Generation, rank: int, state: HeldState | None, committed: int,
                   run_dir: Path, all_names: list[str], timeout_s: float) -> Path:
    """This rank's part of the survivors' save (module docstring); the lowest survivor writes the
    manifest. Returns the checkpoint directory."""
    store, n = coord.store, gen.number
    survivors = gen.members
    have = sorted(state.params) if state is not None else []
    store.set(f"g{n}/stop/{rank}", json.dumps(have))
    coord.wait_keys([f"g{n}/stop/{m}" for m in survivors], n, max(60.0, 6 * timeout_s))
    owner: dict[str, int] = {}
    for m in survivors:
        for name in json.loads(store.get(f"g{n}/stop/{m}")):
            owner.setdefault(name, m)
    out = run_dir / "checkpoints" / f"elastic_step_{committed}"
    out.mkdir(parents=True, exist_ok=True)
    mine = sorted(k for k, m in owner.items() if m == rank)
    if state is not None:
        torch.save({"step": committed, "params": {k: state.params[k].clone() for k in mine},
                    "optim": {k: state.optim[k] for k in mine if k in state.optim}}, out / f"rank{rank}.pt")
    store.set(f"g{n}/saved/{rank}", "1")
    if rank == survivors[0]:
        coord.wait_keys([f"g{n}/saved/{m}" for m in survivors], n, max(60.0, 6 * timeout_s))
        files: dict[str, list[str]] = {}
        for k, m in sorted(owner.items()):
            files.setdefault(f"rank{m}.pt", []).append(k)
        missing = sorted(set(all_names) - set(owner))
        (out / "manifest.json").write_text(json.dumps({"step": committed, "reason": gen.stop, "files": files,
                                                       "missing": missing}, indent=1) + "\n")
    return out
