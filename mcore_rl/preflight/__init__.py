"""Pre-flight: every rule a run is checked against before any process starts, in pure Python.

Nothing here imports Megatron, vLLM or transformers (tests/test_layers.py checks it in a fresh interpreter), so
`mcore-rl check` / `plan` / `train` decide in a second, and the engines and the actor build on these rules
instead of repeating them:
  layout.py          the parallel layout rules, the one `Layout` object, the `ARCHITECTURES` table, the engine
                     capability checks (`validate_layout`, `validate_run`)
  context_parallel.py  where cp > 1 runs and how it pads and cuts sequences
  inputs.py          the model folder and the installed packages (`check_run_inputs`)
  check.py           the model dimensions a check reads, and the report of a run that passed
  hf_tensors.py      the HF tensor names and shapes each architecture needs
  support.py         the support matrix: which releases can run together
  resume_changes.py  which settings a resume may change and which it refuses
  memory_plan.py     `mcore-rl plan`: per-rank bytes by phase;  host_chunks.py: the offload's pinned chunks
"""
