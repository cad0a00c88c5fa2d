"""Stage partitioning and plan search: every decision that picks a plan (docs/architecture.md, layers)."""
