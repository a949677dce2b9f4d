"""Pre-flight: every rule a run is checked against before any process starts, in pure Python.

Nothing here imports Megatron, vLLM or transformers (tests/test_layers.py checks it in a fresh interpreter), so
`mcore-rl check` / `plan` / `train` decide in a second, and the engines and the actor build on these rules
instead of repeating them:
  run.py             the whole run (`validate_run`): architecture, engine, layout, the step's split
  placement.py       the separate placement's split into actor and rollout ranks, and the roles `check` prints
  layout.py          the actor's parallel layout rules and the one `Layout` object (`validate_layout`), `ModelDims`
  context_parallel.py  context parallelism's rules
  architectures.py   the `ARCHITECTURES` table and the check of a run's model against it
  engines.py         the rollout engine: vLLM's tensor-parallel size, what a platform's engine cannot deliver
  inputs.py          the model folder and the installed packages (`check_run_inputs`)
  node.py            what the node must offer: the allocator setting vLLM's sleep mode takes, the rebuild's disk
  check.py           the model dimensions a check reads, and the report of a run that passed
  hf_tensors.py      the HF tensor names and shapes each architecture needs
  support.py         the support matrix: which releases can run together
  resume_changes.py  which settings a resume may change and which it refuses
  memory_plan.py     `mcore-rl plan`: per-rank bytes by phase;  host_chunks.py: the offload's pinned chunks
  role_memory.py     `mcore-rl plan` for the separate placement: one plan per role
  split_plan.py      `mcore-rl plan --from-run`: the actor / rollout split from a colocated run's phase times
"""
