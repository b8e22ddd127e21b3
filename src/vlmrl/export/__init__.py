"""The export stage: the merged 16-bit model and the GGUF files, each checked against the one
before it (`exporter`).

- `gguf`: llama.cpp's converter, quantization and GGUF reading, every failure naming the file.
- `checks`: the quantized files against f16, and the preflight for disk and memory.
- `gguf_release`: the README and Ollama `Modelfile` that travel with the GGUF folder.

`gguf_release` imports no torch: `vlmrl serve` and the model card read it."""
