"""The model card: what the merged model is, how it was trained, how it scored before and after
training, which GGUF files come with it and how to run them. Rendered by the upload stage from
files the pipeline already wrote (params, eval and export metrics, the GGUF folder), so that
rerunning an eval stage rewrites the card without rerunning the export; the release carries it as
the merged model's README.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCardData

from vlmrl.export.gguf_release import README_NAME, run_commands, size_text
from vlmrl.models.portable import EMBEDDED_PREFIX, release_base_name
from vlmrl.params import LOCAL_SOURCE, DataParams, SftParams
from vlmrl.publish.errors import MissingInputError, PublishError
from vlmrl.reporting.tables import markdown_table
from vlmrl.rewards.answer_format import answer_format

CARD_METRICS = ("n", "accuracy", "format_compliance", "mean_reward", "mean_generated_tokens")
PROJECTOR_PREFIX = "mmproj"  # llama.cpp's name for the vision projector's GGUF file


@dataclass(frozen=True)
class CardInputs:
    """The files the cards are rendered from; the upload stage is given each by dvc.yaml."""

    baseline_metrics: Path
    post_metrics: Path
    export_metrics: Path
    gguf: Path  # the export's GGUF folder, with its README

    def evals(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(baseline, post) metrics, None for one not written (yet)."""
        return _read_json(self.baseline_metrics), _read_json(self.post_metrics)


def build_model_card(params: Mapping[str, Any], inputs: CardInputs) -> str:
    """The merged model's card from params.yaml's sections, the metrics and the GGUF folder."""
    export_metrics = _read_json(inputs.export_metrics)
    if export_metrics is None:
        raise MissingInputError(
            f"missing {inputs.export_metrics} (the model card's export settings and "
            "checks); it is made by export"
        )
    gguf_dir = inputs.gguf
    if not gguf_dir.is_dir():
        raise MissingInputError(f"missing input directory {gguf_dir} (gguf); it is made by export")
    baseline, post = inputs.evals()
    sizes = {path.name: path.stat().st_size for path in sorted(gguf_dir.glob("*.gguf"))}
    gguf_roles(sizes, where=str(gguf_dir))
    return render_model_card(params, export_metrics, baseline, post, sizes)


def build_release_cards(params: Mapping[str, Any], inputs: CardInputs) -> dict[str, str]:
    """group -> its README.md: the merged model's card, the adapter's and the GGUF folder's
    (the export's README of the folder under the same metadata and results)."""
    merged = build_model_card(params, inputs)
    readme = inputs.gguf / README_NAME
    if not readme.is_file():
        raise MissingInputError(f"missing {readme} (the GGUF folder's README); it is made by "
                                "export")
    baseline, post = inputs.evals()
    vision = any(path.name.startswith(PROJECTOR_PREFIX) for path in inputs.gguf.glob("*.gguf"))
    adapter = "\n".join([card_header(params, "adapter", post, vision),
                         *_adapter_body(params, vision), *_training_section(params, vision),
                         *_answer_format_section(params),
                         *_results_section(params, baseline, post)])
    gguf = "\n".join([card_header(params, "gguf", post, vision),
                      readme.read_text(encoding="utf-8"), *_results_section(params, baseline, post)])
    return {"adapter": adapter, "merged": merged, "gguf": gguf}


INDEX_METRICS = ("accuracy", "format_compliance", "mean_reward")  # the card's model-index
RELATIONS = {"adapter": ("adapter", "peft"), "merged": ("finetune", "transformers"),
             "gguf": ("quantized", "gguf")}


def card_header(params: Mapping[str, Any], kind: str, post: Mapping | None,
                vision: bool) -> str:
    """Hugging Face model-card metadata (the YAML front matter) for one group of the release,
    through huggingface_hub's ModelCardData and EvalResult: the hub's own schema, so the card
    loads with `huggingface_hub.ModelCard` and the hub shows its results."""
    model, data = params.get("model", {}), DataParams.from_params(params.get("data", {}))
    relation, library = RELATIONS[kind]
    name = str(model.get("name"))
    pipeline_tag = "image-text-to-text" if vision else "text-generation"
    metrics = card_metrics(post)
    indexed = [key for key in INDEX_METRICS if key in metrics]
    meta = ModelCardData(
        base_model=release_base_name(name), base_model_relation=relation,
        library_name=library, pipeline_tag=pipeline_tag,
        tags=["qwen3-vl" if vision else "qwen3", "lora", "gspo", "grpo",
              "visual-math" if vision else "math"] + (["gguf"] if kind == "gguf" else []),
        datasets=[dataset_name(data)], metrics=indexed or None,
        model_name=f"{release_base_name(name)}-gspo" if indexed else None,
        eval_results=[EvalResult(
            task_type=pipeline_tag, dataset_type=dataset_name(data),
            dataset_name=dataset_name(data), dataset_split=data.split if data.from_hub else None,
            metric_type=key, metric_value=metrics[key], metric_name=f"{key} (held-out eval)")
            for key in indexed] or None,
        **({"base_model_seed": model.get("seed", 0)} if name.startswith(EMBEDDED_PREFIX) else {}))
    return f"---\n{meta.to_yaml()}\n---\n"


def dataset_name(data: DataParams) -> str:
    """The hub id or built-in set's name; for local data, the file or folder's name."""
    return Path(data.path).name if data.source == LOCAL_SOURCE else data.source


def _adapter_body(params: Mapping[str, Any], vision: bool) -> list[str]:
    model = params.get("model", {})
    base = release_base_name(str(model.get("name")))
    what = ("on the language model (the vision tower is not adapted)" if vision
            else "on the decoder layers of a text model")
    return [f"# {base} + GSPO LoRA adapter", "",
            (f"A PEFT LoRA adapter {what}, trained with GSPO. Load it on its base model; run "
             "this in the adapter's folder:"), "", "```python",
            *adapter_snippet(str(model.get("name")), int(model.get("seed", 0)), vision), "```",
            ""]


def adapter_snippet(name: str, seed: int, vision: bool) -> list[str]:
    """Python that loads the adapter on its base model (a hub id, or the built-in model rebuilt
    by vlmrl from its name and seed) with the auto classes for the model's kind."""
    model_class = "AutoModelForImageTextToText" if vision else "AutoModelForCausalLM"
    inputs = ("# the processor: transformers.AutoProcessor.from_pretrained(BASE) (needs torchvision)"
              if vision else "tokenizer = AutoTokenizer.from_pretrained(BASE)")
    imports = model_class if vision else "AutoModelForCausalLM, AutoTokenizer"
    base = release_base_name(name)
    if name.startswith(EMBEDDED_PREFIX):
        where = ["from vlmrl.models.embedded import ensure_embedded_model", "",
                 f"# {base}: the project's built-in model, random weights from seed {seed}",
                 f"BASE = ensure_embedded_model({base!r}, seed={seed})"]
    else:
        where = ["", f"BASE = {base!r}"]
    return ["from peft import PeftModel", f"from transformers import {imports}", *where,
            f"base = {model_class}.from_pretrained(BASE)",
            "model = PeftModel.from_pretrained(base, '.')  # this folder", inputs]


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise PublishError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise PublishError(f"{path} must hold a JSON object, got {type(payload).__name__}")
    return payload


def card_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """An evaluation's headline numbers and per-reward means, flattened for the results table."""
    if not metrics:
        return {}
    flat = {key: metrics[key] for key in CARD_METRICS if isinstance(metrics.get(key), int | float)}
    for name, value in (metrics.get("rewards") or {}).items():
        if isinstance(value, int | float):
            flat[f"reward {name}"] = value
    return flat


def gguf_roles(gguf_sizes: Mapping[str, int],
               where: str = "the GGUF folder") -> tuple[str, str | None]:
    """(model file, projector file or None) for the usage examples: the smallest language-model
    file, which is the most quantized one, and the vision projector (a text model has none)."""
    projectors = [name for name in gguf_sizes if name.startswith(PROJECTOR_PREFIX)]
    models = [name for name in gguf_sizes if not name.startswith(PROJECTOR_PREFIX)]
    if not models:
        raise MissingInputError(
            f"{where} needs a GGUF model file (and a {PROJECTOR_PREFIX}-*.gguf projector for a "
            f"vision-language model), has {sorted(gguf_sizes)}; they are made by export"
        )
    return (min(models, key=lambda name: (gguf_sizes[name], name)),
            projectors[0] if projectors else None)


def render_model_card(
    params: Mapping[str, Any],
    export_metrics: Mapping[str, Any],
    baseline: Mapping | None,
    post: Mapping | None,
    gguf_sizes: Mapping[str, int],
) -> str:
    model = params.get("model", {})
    quant, projector = gguf_roles(gguf_sizes)
    vision = projector is not None
    header = [
        card_header(params, "merged", post, vision),
        (f"# {release_base_name(str(model.get('name')))} + GSPO LoRA for "
        f"{'visual ' if vision else ''}maths (merged)"),
        "",
        (
            "The base model with the GSPO-trained LoRA adapter merged in "
            f"({params.get('export', {}).get('dtype')}), saved as safetensors with its tokenizer, chat "
            f"template{' and image processor' if vision else ''}, plus GGUF files for llama.cpp."
        ),
        "",
    ]
    return "\n".join(
        [
            *header,
            *_training_section(params, vision),
            *_answer_format_section(params),
            *_results_section(params, baseline, post),
            *_files_section(gguf_sizes, export_metrics.get("logit_max_abs_diff") or {}),
            *(_usage_section(quant, projector) if vision else _text_usage_section(quant)),
        ]
    )


def _answer_format_section(params: Mapping[str, Any]) -> list[str]:
    """The prompt the model was trained on and the tags its answers come in."""
    fmt = answer_format(params)
    return [
        "## Answer format",
        "",
        (f"Trained with this system prompt; answers come as `{fmt.reasoning_open}...`"
         f"`{fmt.reasoning_close}` then `{fmt.solution_open}...{fmt.solution_close}`, and the "
         "final answer is the solution block's text:"),
        "",
        f"> {fmt.system_text()}",
        "",
    ]


def _training_section(params: Mapping[str, Any], vision: bool) -> list[str]:
    model, data = params.get("model", {}), params.get("data", {})
    source = DataParams.from_params(data).describe()
    train = params.get("train", {})
    lora, grpo = train.get("lora", {}), train.get("grpo", {})
    weights = params.get("rewards", {}).get("weights", {})
    return [
        "## Training",
        "",
        f"- Base model: `{model.get('name')}`",
        (
            f"- Data: {source}, question types "
            f"{data.get('question_types')}, answer types {data.get('answer_types')}, "
            f"{data.get('eval_size')} items held out for evaluation"
        ),
        "",
        "Rewards and weights:",
        "",
        markdown_table(["reward", "weight"], list(weights.items())),
        "",
        ("LoRA (language model only; the vision tower is not adapted):" if vision
         else "LoRA (decoder layers):"),
        "",
        markdown_table(
            ["r", "alpha", "dropout", "target modules"],
            [
                (
                    lora.get("r"),
                    lora.get("alpha"),
                    lora.get("dropout"),
                    ", ".join(lora.get("target_modules", [])),
                )
            ],
        ),
        "",
        "GRPO / GSPO (TRL `GRPOConfig`):",
        "",
        markdown_table(["setting", "value"], list(grpo.items())),
        "",
    ]


def baseline_label(params: Mapping[str, Any]) -> str:
    """What the baseline evaluation ran: the model GSPO started from."""
    sft = SftParams.from_params(params.get("sft", {}))
    return "before (base + SFT)" if sft.trains else "before (base)"


def _results_section(params: Mapping[str, Any], baseline: Mapping | None,
                     post: Mapping | None) -> list[str]:
    before, after = card_metrics(baseline), card_metrics(post)
    rows = [(key, before.get(key), after.get(key)) for key in dict.fromkeys([*before, *after])]
    table = (
        markdown_table(["metric", baseline_label(params), "after (GSPO adapter)"], rows)
        if rows
        else "No evaluation metrics were found (baseline_eval's and post_eval's)."
    )
    return ["## Results", "", table, ""]


def _files_section(gguf_sizes: Mapping[str, int], diffs: Mapping[str, float]) -> list[str]:
    return [
        "## Files and checks",
        "",
        markdown_table(["GGUF file", "size"], [(name, size_text(size)) for name, size in gguf_sizes.items()]),
        "",
        markdown_table(["check (max abs logit difference)", "value"], list(diffs.items())),
        "",
    ]


def _serve_lines(quant: str, projector: str | None) -> list[str]:
    """The card's heading for running the GGUF files and the shell lines of the GGUF folder's
    own README, so the two never disagree."""
    return ["## Running it", "",
            (f"In the release's GGUF folder (`vlmrl pull --what gguf --to gguf && cd gguf`), an "
             f"OpenAI chat API{' (a text model: no projector)' if projector is None else ''}:"),
            "", "```sh", *run_commands(quant, projector), "```", ""]


def _text_usage_section(quant: str) -> list[str]:
    return [
        *_serve_lines(quant, None),
        "llama-cpp-python:",
        "",
        "```python",
        "from llama_cpp import Llama",
        "",
        f"llm = Llama(model_path='{quant}', n_ctx=4096)",
        ("reply = llm.create_chat_completion(messages=[{'role': 'user', 'content': 'Tom has 3 "
         "apples and buys 4 more. How many apples?'}])"),
        "llm.close()",
        "```",
        "",
        ("transformers: `AutoModelForCausalLM.from_pretrained(this_dir)` and "
         "`AutoTokenizer.from_pretrained(this_dir)`."),
        "",
    ]


def _usage_section(quant: str, projector: str) -> list[str]:
    return [
        *_serve_lines(quant, projector),
        "llama-cpp-python:",
        "",
        "```python",
        "from llama_cpp import Llama",
        "from llama_cpp.llama_chat_format import MTMDChatHandler",
        "",
        f"handler = MTMDChatHandler(clip_model_path='{projector}')",
        f"llm = Llama(model_path='{quant}', chat_handler=handler, n_ctx=4096)",
        "reply = llm.create_chat_completion(messages=[{'role': 'user', 'content': [",
        "    {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}},",
        "    {'type': 'text', 'text': 'What is the value of x?'}]}])",
        "llm.close()",
        "```",
        "",
        (
            "transformers: `AutoModelForImageTextToText.from_pretrained(this_dir)` and "
            "`AutoProcessor.from_pretrained(this_dir)`."
        ),
        "",
    ]
