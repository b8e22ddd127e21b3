"""The one place that knows model backends and models; evaluation, training, verify and export
sit above it as peers and never load a model any other way.

- `backend`: CUDA, the backend choice (`model.backend: auto`), dtypes, bitsandbytes 4-bit.
- `loading`: the one dispatch on the backend: a model for evaluation (optionally with an
  adapter), the LoRA policy for training, the 16-bit merge for export.
- `unsloth`: the Unsloth backend; `unsloth` itself is imported only when it is chosen.
- `processor`: the processor, its chat template and how it is saved.
- `embedded`: the tiny built-in Qwen3-VL models (no hub needed).
- `forward`: the fixed input and the logits that verify and export compare.

Decoding that only training runs (compiled rollouts, their attention and kernels) lives in
`vlmrl.training.rollout`, so that editing it reruns no evaluation, verify or export.

It imports only the ground floor (`vlmrl.params`, `vlmrl.outputs`, `vlmrl.cache`,
`vlmrl.models.merged_weights`), never a stage module."""
