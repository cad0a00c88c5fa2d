"""Stage partitioning and plan search: every decision that picks a plan (DESIGN.md, layers)."""
