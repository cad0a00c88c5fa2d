"""Simulation of schedules (DESIGN.md, `loom.sim`): play an IR under a cost model for iteration
time, bubbles, MFU, peak memory per unit and a timeline in the executor's format.

- `loom.sim.simulator`: `simulate`, `SimResult`, `DeadlockError`, `peak_memory`;
- `loom.sim.gantt`: `plot_gantt`, a PNG Gantt chart of any timeline (simulated or measured).
"""

from loom.sim.gantt import plot_gantt
from loom.sim.simulator import DeadlockError, SimResult, peak_memory, simulate

__all__ = ["DeadlockError", "SimResult", "peak_memory", "plot_gantt", "simulate"]
