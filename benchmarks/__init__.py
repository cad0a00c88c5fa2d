"""Side-by-side benchmarks of loom against what it is compared with (docs/architecture.md, "Benchmarks").

Each ``benchmarks/<name>.py`` runs both sides in one process tree, prints a table and writes
``benchmarks/results/<name>.json``; `benchmarks.common` holds what they share.
"""
