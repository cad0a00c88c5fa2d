"""Plans: per-module parallel degrees, stage boundaries, microbatching, schedule kind."""

from loom.plan.plan import LLM, ModuleSpec, Plan, PlanError, even_boundaries

__all__ = ["LLM", "ModuleSpec", "Plan", "PlanError", "even_boundaries"]
