"""Pure balancing and reordering algorithms over per-sample workloads (docs/architecture.md principle 4):
OrchMLLM post-balancing (`orchmllm`), DistTrain reordering (`disttrain`), Entrain stratified
assignment with deferral (`entrain`). Deterministic, side-effect free, unit-tested against exact
oracles; the runtime applies their results."""
