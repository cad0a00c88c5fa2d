"""Cost model: hardware specs, per-layer costs, memory and FLOPs, and the profiler that fits them."""
