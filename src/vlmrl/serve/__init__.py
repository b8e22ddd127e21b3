"""`vlmrl serve`: a pulled GGUF folder behind an OpenAI-compatible chat API. `command` builds
and execs the server command; `app` is the server process itself."""
