"""Someone who gets only the GGUF folder must be able to tell which file to run, that the
projector is needed for images, how to run them and which system prompt the model was trained
with: export writes a README and an Ollama `Modelfile` (Qwen's ChatML template, the stop token,
the system prompt, the projector as a second FROM) beside the files. The upload stage puts the model-card metadata and the evaluation results on top of the
same README, so the two never disagree."""

from __future__ import annotations

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
    rows = [f"| `{name}` | {_size(sizes[name])} | "
            f"{'vision projector: needed for image input' if kind == PROJECTOR_KIND else FILE_USES.get(kind, kind)} |"
            for kind, name in names.items()]
    lines = [f"# {title}: GGUF files", "",
             "Files for llama.cpp, llama-cpp-python and Ollama. The chat template is stored in "
             "each model file." + (f" Images need the projector `{projector}` beside the model "
                                   "file." if projector else " A text model: no projector."),
             "", "| file | size | use |", "| --- | --- | --- |", *rows, "",
             "## Run it", "", "```sh", *_commands(model, projector), "```", "",
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


def _commands(model: str, projector: str | None) -> list[str]:
    mmproj = f" --mmproj {projector}" if projector else ""
    image = " --image problem.png" if projector else ""
    return [f"llama-mtmd-cli -m {model}{mmproj}{image} -p 'What is the value of x?'"
            if projector else f"llama-cli -m {model} -p 'What is 3 + 4?'",
            f"llama-server -m {model}{mmproj} --host 127.0.0.1 --port 8080   # OpenAI API",
            f"vlmrl serve --gguf . --file {model}   # the same, through llama-cpp-python",
            "ollama create vlmrl-gspo -f Modelfile && ollama run vlmrl-gspo"]


def _size(num_bytes: int) -> str:
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
