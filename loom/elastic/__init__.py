"""Training through rank failures without a restart (Oobleck; docs/elastic.md, "The runtime").

- `config`: the ``[elastic]`` section and what the runtime refuses;
- `layout`: a generation (pipelines, their plans, Eq. 2.6 shares) as published in the store;
- `planning`: the supervisor's generations from `loom.planner.oobleck`;
- `protocol`: the pure rules (commit decision, copy plan, layer-wise sync groups);
- `coordination`: the shared store's keys;
- `member`: a rank's part in a generation (groups, engine, copies, sync, clipping);
- `stop`: the survivors' save beyond ``f``;
- `supervisor`: the process that hosts the store, starts and watches the workers.

The training loop of a worker is `loom.train.elastic`.
"""
