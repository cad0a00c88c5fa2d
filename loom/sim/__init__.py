"""Simulation of schedules (docs/architecture.md, `loom.sim`): play an IR under a cost model for iteration
time, bubbles, MFU, peak memory per unit, the batch dispatch's cost and a timeline in the
executor's format.

- `loom.sim.simulator`: `simulate` (the entry point), over `loom.sim.play` (the event loop),
  `loom.sim.work` (workload tables), `loom.sim.memory` (`peak_memory`) and `loom.sim.result`
  (`SimResult`);
- `loom.sim.dispatch`: the dispatcher's price per step (metadata all-gather, layout decision,
  payload all-to-all per phase over intra- and inter-node links);
- `loom.sim.sharing`: `CoreSharing`, ranks sharing a CPU host's cores (each kept on one core,
  processor sharing of each core's compute, for CPU runs);
- `loom.sim.gantt`: `plot_gantt`, a PNG Gantt chart of any timeline (simulated or measured);
- `loom.sim.loads`: `PhaseLoads`, `phase_loads`, how evenly a layout spreads each phase's work;
- `loom.sim.scenario`: scenarios from published configs, also under balancing policies.
"""

from loom.sim.dispatch import DispatchCost, Links, price_dispatch
from loom.sim.gantt import plot_gantt
from loom.sim.loads import PhaseLoads, phase_loads
from loom.sim.play import DeadlockError
from loom.sim.result import SimResult
from loom.sim.sharing import CoreSharing
from loom.sim.simulator import peak_memory, simulate

__all__ = ["CoreSharing", "DeadlockError", "DispatchCost", "Links", "PhaseLoads", "SimResult", "peak_memory", "phase_loads",
           "plot_gantt", "price_dispatch", "simulate"]
