"""Simulation of schedules (DESIGN.md, `loom.sim`): play an IR under a cost model for iteration
time, bubbles, MFU, peak memory per unit and a timeline in the executor's format.

- `loom.sim.simulator`: `simulate`, `SimResult`, `DeadlockError`, `peak_memory`;
- `loom.sim.gantt`: `plot_gantt`, a PNG Gantt chart of any timeline (simulated or measured);
- `loom.sim.loads`: `PhaseLoads`, `phase_loads`, how evenly a layout spreads each phase's work;
- `loom.sim.scenario`: scenarios from published configs, also under balancing policies.
"""

from loom.sim.gantt import plot_gantt
from loom.sim.loads import PhaseLoads, phase_loads
from loom.sim.simulator import DeadlockError, SimResult, peak_memory, simulate

__all__ = ["DeadlockError", "PhaseLoads", "SimResult", "peak_memory", "phase_loads", "plot_gantt", "simulate"]
