"""Measuring on the device (`loom profile`): per-layer timings on synthetic inputs, the
optimizer step, message and all-reduce costs with the runtime's communicator, co-running
processes. It writes the profile file that `loom.cost` fits and reads
(`loom.cost.profile_file`, `loom.cost.profiled.ProfiledCostModel`).

Modules: `profiler` (`Profiler`, `profile_model`), `layers` (timing one layer), `inputs`
(synthetic microbatches), `optimizer` (AdamW step timing), `comm` (message passes on two gloo
processes), `corun` (processes computing alongside).
"""

from loom.profile.comm import MESSAGE_SIZES, measure_communication, message_pass
from loom.profile.corun import CoRunners
from loom.profile.profiler import DEFAULT_TOKEN_COUNTS, Profiler, check_settings, profile_model

__all__ = ["CoRunners", "DEFAULT_TOKEN_COUNTS", "MESSAGE_SIZES", "Profiler", "check_settings",
           "measure_communication", "message_pass", "profile_model"]
