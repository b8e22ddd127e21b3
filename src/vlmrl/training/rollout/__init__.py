"""Fast rollouts for GSPO training: code that only the train_gspo stage runs, kept apart from
`vlmrl.models` so that editing it reruns training alone, never the evaluations, verify or export
(which depend on `vlmrl.models`).

- `generation`: the policy's class for training (`rollout_class`), whose `generate` goes to the
  rollout decoding set on it; the top-k sampler on a CPU.
- `graph_decode`: the decode step as one CUDA graph, behind a `generate` of its own.
- `decode_attention`: grouped attention over the static cache, and the cache in float8.
- `nf4_decode`: the Triton kernel for NF4 projections (with their LoRA adapter) in decode steps.
- `shared_prompts`: each distinct prompt of a generation batch prefilled once.

It imports `vlmrl.models` (sampling settings) and never a stage module."""
