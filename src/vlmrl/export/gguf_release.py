"""Someone who gets only the GGUF folder must be able to tell which file to run, that the
projector is needed for images, how to run them and which system prompt the model was trained
with: export writes a README and an Ollama `Modelfile` (Qwen's ChatML template, the stop token,
the system prompt, the projector as a second FROM) beside the files. The upload stage puts the model-card metadata and the evaluation results on top of the
same README, so the two never disagree."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

README_NAME = "README.md"
MODELFILE_NAME = "Modelfile"
PROJECTOR_KIND = "mmproj"
# Qwen3's ChatML in Ollama's Go template language; the GGUF itself carries the Jinja template
# that llama.cpp uses.
OLLAMA_TEMPLATE = """{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
OLLAMA_NAME = "vlmrl-gspo"
JSON_HEADER = "Content-Type: application/json"
SAMPLE_REQUEST = {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 64}
FILE_USES = {"f16": "reference quality, largest", "q8_0": "near f16 quality, half the size",
             "Q4_K_M": "smallest; the default to run"}


def default_model_file(names: Mapping[str, str]) -> str:
    """The file to run by default: Q4_K_M where there is one, else the smallest kind listed."""
    models = {kind: name for kind, name in names.items() if kind != PROJECTOR_KIND}
    return models.get("Q4_K_M") or models[max(models)]


def render_modelfile(names: Mapping[str, str], system: str) -> str:
    lines = [f"FROM ./{default_model_file(names)}"]
    if PROJECTOR_KIND in names:
        lines.append(f"FROM ./{names[PROJECTOR_KIND]}")
    lines += [f'TEMPLATE """{OLLAMA_TEMPLATE}"""', f'SYSTEM """{system}"""',
              *(f'PARAMETER stop "{token}"' for token in STOP_TOKENS), ""]
    return "\n".join(lines)


def render_gguf_readme(names: Mapping[str, str], sizes: Mapping[str, int], title: str,
                       checks: Mapping[str, str], system: str = "") -> str:
    """The folder's README: files and their uses, how to run them, the system prompt the model
    was trained with (its answers follow that prompt's format only when it is sent), and what
    export checked."""
    model = default_model_file(names)
    projector = names.get(PROJECTOR_KIND)
    rows = [f"| `{name}` | {size_text(sizes[name])} | "
            f"{'vision projector: needed for image input' if kind == PROJECTOR_KIND else FILE_USES.get(kind, kind)} |"
            for kind, name in names.items()]
    lines = [f"# {title}: GGUF files", "",
             "Files for llama.cpp, llama-cpp-python and Ollama. The chat template is stored in "
             "each model file." + (f" Images need the projector `{projector}` beside the model "
                                   "file." if projector else " A text model: no projector."),
             "", "| file | size | use |", "| --- | --- | --- |", *rows, "",
             "## Run it", "", "```sh", *run_commands(model, projector), "```", "",
             *_system_section(system)]
    if checks:
        lines += ["## Checked at export", "", *(f"- {name}: {detail}"
                                                for name, detail in checks.items()), ""]
    return "\n".join(lines)


def _system_section(system: str) -> list[str]:
    if not system:
        return []
    return ["## System prompt", "",
            ("The model was trained with this system prompt: send it as the system message "
             "(the `Modelfile` sets it for Ollama)."), "", "```text", system, "```", ""]


def run_commands(model: str, projector: str | None, folder: str = ".") -> list[str]:
    """Shell lines that serve `model` (with `projector`, where there is one) as an OpenAI chat
    API, ask it one question, or hand the folder to Ollama: only what installing vlmrl with its
    `gguf` extra provides (`vlmrl serve`, llama-cpp-python's server), and Ollama.

    Args:
        folder: the GGUF folder, as the commands are run from where the user is.
    """
    where = "" if folder == "." else f"{folder}/"
    vision = f" --clip_model_path {where}{projector} --chat_format mtmd" if projector else ""
    ollama = f"ollama create {OLLAMA_NAME} -f {MODELFILE_NAME}"
    if folder != ".":  # the Modelfile's FROM lines name files beside it
        ollama = f"(cd {folder} && {ollama})"
    return [(f"vlmrl serve --gguf {folder} --file {model}   # OpenAI chat API on "
             "http://127.0.0.1:8080/v1"),
            (f"python -m llama_cpp.server --model {where}{model}{vision} --host 127.0.0.1 "
             "--port 8080   # the same, llama-cpp-python's server alone"),
            f"curl -s http://127.0.0.1:8080/v1/chat/completions -H '{JSON_HEADER}' \\",
            f"  -d '{json.dumps(SAMPLE_REQUEST)}'",
            f"{ollama} && ollama run {OLLAMA_NAME}   # Ollama, where its version reads the files"]


def size_text(num_bytes: int) -> str:
    """A file's size as the README and the model card show it: KiB below 1 MiB, else MiB."""
    if num_bytes < 1024 * 1024:
        return f"{num_bytes / 1024:.1f} KiB"
    return f"{num_bytes / 1024**2:.1f} MiB"


def write_gguf_consumer_files(gguf_dir: Path, names: Mapping[str, str], title: str,
                              system: str, checks: Mapping[str, str]) -> None:
    sizes = {name: (gguf_dir / name).stat().st_size for name in names.values()}
    (gguf_dir / README_NAME).write_text(render_gguf_readme(names, sizes, title, checks, system),
                                        encoding="utf-8")
    (gguf_dir / MODELFILE_NAME).write_text(render_modelfile(names, system),
                                           encoding="utf-8")
