"""The export stage: the merged 16-bit model and the GGUF files, each checked against the one
before it (`exporter`).

- `gguf`: llama.cpp's converter and GGUF reading (gguf-py), every failure naming the file.
- `llama_runtime`: the files run with llama.cpp: logits, greedy tokens, an image chat,
  quantization, the model's name for `vlmrl serve`.
- `checks`: the quantized files against f16, and the preflight for disk and memory.
- `gguf_release`: the README and Ollama `Modelfile` that travel with the GGUF folder.

`gguf_release` imports no torch: `vlmrl serve` and the model card read it."""
