"""Cost model: hardware specs, architectures, per-layer costs, memory and FLOPs, profile fitting
and the profile file format (the measuring harness is `loom.profile`)."""
